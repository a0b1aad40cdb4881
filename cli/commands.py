"""`vllm-tap`: run the daemon, subscribe to a capture, watch every capture, show status. Commands stay thin: the work
lives in vllm_tap.daemon and vllm_tap.client."""

from __future__ import annotations

import json
from typing import Any, Callable

import click
import numpy as np

from vllm_tap.client.stream import ENDPOINT_ENV
from vllm_tap.daemon.cli_options import config_options
from vllm_tap.status_format import DaemonStatus, from_map

from .keys import key_options


def endpoint_option(f: Callable) -> Callable:
    """The one --endpoint option every command shares (with the CURVE key options)."""
    return click.option(
        "--endpoint", envvar=ENDPOINT_ENV, default=None, metavar="URL",
        help=f"ZeroMQ endpoint of the daemon (ipc://PATH or tcp://HOST:PORT); default ${ENDPOINT_ENV}, "
             "else the daemon's default socket.",
    )(key_options(f))


def _fail(message: str) -> None:
    """One line on stderr and a non-zero exit, never a traceback, for anything the user can fix."""
    raise click.ClickException(message)


class _Main(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        from vllm_tap.client.errors import KeyFileError

        try:
            return super().invoke(ctx)
        except KeyFileError as e:  # unusable --server-key / --client-key, from whichever command
            raise click.ClickException(str(e)) from None


@click.group(cls=_Main)
@click.version_option(package_name="vllm-tap")
def main() -> None:
    """Tap raw logits and hidden states out of a running vLLM."""


# -- daemon --


@main.command()
@config_options
def daemon(config_path: str | None, **flags: Any) -> None:
    """Read every ring under the shm directory and serve subscribers until SIGTERM/SIGINT.

    Settings come from the TOML file, then VLLM_TAP_* environment variables, then these flags.
    """
    from vllm_tap.daemon.service import cli_entry  # logging, sd_notify, metrics, signals

    click.get_current_context().exit(cli_entry(config_path, flags))


# -- subscribe --


def _summary(rec: Any) -> str:
    parts = [f"{rec.position:>6}", f"{rec.phase:<6}", f"tok={rec.token_id:<7}"]
    if rec.logits is not None and rec.logits.size:
        x = rec.logits.astype(np.float64)
        p = np.exp(x - x.max())
        p /= p.sum()
        entropy = float(-(p * np.log(np.where(p > 0, p, 1.0))).sum())
        parts.append(f"argmax={int(x.argmax()):<7} H={entropy:.3f}")
    if rec.topk_ids is not None:
        parts.append(f"top1={int(rec.topk_ids[0])}")
    for layer, h in sorted(rec.hidden.items()):
        parts.append(f"|h{layer}|={float(np.linalg.norm(h.astype(np.float64))):.3g}")
    for name, r in sorted(getattr(rec, "reduced", {}).items()):
        if hasattr(r, "ids"):  # an SAE's latents: how many are active, and the most active
            active = r.ids[r.ids >= 0]
            parts.append(f"{name}:{len(active)}" + (f"(top {int(active[0])}={float(r.values[0]):.3g})" if len(active) else ""))
        else:  # a probe's scores
            parts.append(f"{name}=" + ",".join(f"{float(v):.3g}" for v in r[:4]) + ("…" if len(r) > 4 else ""))
    return " ".join(parts)


@main.command()
@click.argument("name")
@click.option("--index", type=click.IntRange(min=0), default=None, help="Choice index, when NAME has several choices.")
@click.option("--instance", default=None, help="Engine instance, when NAME exists in several.")
@endpoint_option
@click.option("--timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds to wait for the capture to appear.")
@click.option("--out", "out", default=None, metavar="FILE", help="Also write the whole capture to FILE (.npz or .safetensors).")
@click.option("--quiet", is_flag=True, help="No per-token lines.")
def subscribe(name: str, index: int | None, instance: str | None, endpoint: str | None, timeout: float,
              out: str | None, quiet: bool) -> None:
    """Print a per-token summary of capture NAME (request id, response id, X-Request-Id or tap_key)."""
    from vllm_tap.client import Client, Chunk, TapError
    from vllm_tap.client.records import CaptureBuilder

    if out is not None and not out.endswith((".npz", ".safetensors")):
        _fail(f"--out {out}: use a .npz or .safetensors file name")
    sub = Client(endpoint).subscribe(name, index, instance, timeout)
    builder = CaptureBuilder()
    try:
        for item in sub.chunks():
            builder.add(item)
            if isinstance(item, Chunk):
                if not quiet:
                    for rec in item.rows():
                        click.echo(_summary(rec))
            else:
                click.echo(f"{item.positions.start:>6} MISSING positions {item.positions.start}..{item.positions.stop - 1} ({item.reason})")
    except TapError as e:
        _fail(str(e))
    end = sub.end
    assert end is not None
    missing = end.missing_positions
    click.echo(f"end reason={end.reason} request={end.request_id} prompt={end.num_prompt_tokens} "
               f"output={end.num_output_tokens} missing={len(missing)}{' ' + _ranges(missing) if missing else ''}")
    if out is not None:
        builder.build(sub.begin, end).save(out)
        click.echo(f"wrote {out}")


def _ranges(ps) -> str:
    from vllm_tap.positions import PositionRanges

    ranges = ps.ranges if isinstance(ps, PositionRanges) else PositionRanges.of(ps).ranges
    return ",".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in ranges)


# -- watch --


def _capture_line(seq: int, begin: Any, end: Any, positions: int) -> str:
    missing = end.missing_positions if end is not None else []
    source = end.source if end is not None else begin.source
    parts = [f"seq={seq}", f"{begin.instance}/{begin.request_id}", f"source={source}"]
    if begin.tap_key:
        parts.append(f"tap_key={begin.tap_key}")
    if begin.model:
        parts.append(f"model={begin.model}")
    if end is not None:
        span = f"{end.expected[0]}..{end.expected[1] - 1}" if end.expected else "-"
        parts += [f"positions={span}", f"delivered={positions}", f"missing={len(missing)}"
                  + (f" ({_ranges(missing)})" if missing else ""), f"end={end.reason}"]
    return " ".join(parts)


@main.command()
@click.option("--since", type=click.IntRange(min=0), default=None, metavar="SEQ",
              help="Resume after this sequence number (the last one you stored); default: only captures that "
                   "begin from now on. 0: everything the daemon still retains.")
@click.option("--instance", default=None, help="Only this engine instance.")
@click.option("--source", default=None, metavar="client|policy",
              help="Only captures the request opted into (client) or the server's policy chose (policy).")
@click.option("--tap-key-prefix", default=None, metavar="PREFIX", help="Only captures whose tap_key starts with PREFIX.")
@click.option("--model", default=None, help="Only captures of this served model.")
@click.option("--stream", is_flag=True, help="A line when each capture starts and ends, instead of one at its end.")
@click.option("--count", type=click.IntRange(min=1), default=None, metavar="N", help="Exit after N captures.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@endpoint_option
@click.option("--timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Give up after this long without contact with the daemon (seconds).")
def watch(since: int | None, instance: str | None, source: str | None, tap_key_prefix: str | None, model: str | None,
          stream: bool, count: int | None, as_json: bool, endpoint: str | None, timeout: float) -> None:
    """Print one line per capture of every request, in sequence order, as they end.

    Lost captures print as `seq=A..B LOST (reason)`. At exit the last sequence number handled goes to
    stderr as `last_seq=N`: pass it to --since to go on where this left off.
    """
    from vllm_tap.client import (
        Client, LostCaptures, TapError, WatchData, WatchedCapture, WatchEnd, WatchStart,
    )

    w = Client(endpoint).watch(since, instance=instance, source=source, tap_key_prefix=tap_key_prefix, model=model,
                               whole=not stream, timeout=timeout)
    done = 0
    delivered: dict[int, int] = {}
    begins: dict[int, Any] = {}

    def emit(obj: dict[str, Any], text: str) -> None:
        click.echo(json.dumps(obj) if as_json else text)

    try:
        for item in w:
            if isinstance(item, LostCaptures):
                emit({"lost": [item.first, item.last], "reason": item.reason, "detail": item.detail},
                     f"seq={item.first}..{item.last} LOST ({item.reason}{': ' + item.detail if item.detail else ''})")
                for seq in [s for s in begins if s in item]:
                    del begins[seq]
                    delivered.pop(seq, None)
                done += len(item)
            elif isinstance(item, WatchedCapture):
                emit({"seq": item.seq, "instance": item.instance, "request_id": item.request_id, "source": item.source,
                      "tap_key": item.tap_key, "response_id": item.response_id, "choice_index": item.choice_index,
                      "model": item.model, "positions": len(item.capture.positions),
                      "missing": len(item.end.missing_positions), "reason": item.end.reason},
                     _capture_line(item.seq, item.begin, item.end, len(item.capture.positions)))
                done += 1
            elif isinstance(item, WatchStart):
                begins[item.seq] = item.begin
                delivered[item.seq] = 0
                emit({"seq": item.seq, "start": True, "instance": item.begin.instance,
                      "request_id": item.begin.request_id, "source": item.source},
                     "START " + _capture_line(item.seq, item.begin, None, 0))
            elif isinstance(item, WatchData):
                if not item.item.missing:
                    delivered[item.seq] = delivered.get(item.seq, 0) + len(item.item)
            elif isinstance(item, WatchEnd):
                begin = begins.pop(item.seq, None)
                n = delivered.pop(item.seq, 0)
                emit({"seq": item.seq, "end": item.end.reason, "request_id": item.end.request_id, "positions": n,
                      "missing": len(item.end.missing_positions)},
                     "END   " + (_capture_line(item.seq, begin, item.end, n) if begin is not None
                                 else f"seq={item.seq} end={item.end.reason}"))
                done += 1
            if count is not None and done >= count:
                break
    except TapError as e:
        _fail(str(e))  # one line, nothing else: a refused watch handled nothing
    except KeyboardInterrupt:
        pass
    if w.last_seq is not None:
        click.echo(f"last_seq={w.last_seq}", err=True)


# -- status --


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _status_text(s: DaemonStatus) -> str:
    lines = [f"daemon pid {s.pid} up {s.uptime_s:.0f} s at {s.endpoint} watching {s.shm_dir}"]
    bell = s.doorbell
    lines.append(f"woken by writers at {bell} ({s.doorbell_wakeups} wake-ups)" if bell
                 else "no doorbell: polling the rings on a timer")
    rings = s.rings
    if rings:
        lines.append(f"{'RING':<40} {'RANK':>5} {'WRITER':>8} {'ALIVE':>5} {'CAPACITY':>10} {'PENDING':>10} "
                     f"{'BEHIND':>8} {'WRITTEN':>9} {'DROPPED':>8} {'REJECTED':>8}")
        for r in rings:
            lines.append(
                f"{r['instance'] + '/' + r['name']:<40} {r['rank']:>5} {r['writer_pid']:>8} "
                f"{'yes' if r['alive'] else 'no':>5} {_mib(r['capacity']):>10} {_mib(r['pending_bytes']):>10} "
                f"{r.get('pending_s', 0.0):>7.1f}s "
                f"{r['writer']['records_written']:>9} {r['writer']['records_dropped']:>8} {r.get('rejected', 0):>8}"
            )
    else:
        lines.append("no rings yet")
    d = s.drops
    lat = s.delivery_latency_s
    mean = f"{1000 * lat['sum'] / lat['count']:.2f} ms" if lat["count"] else "-"
    lines += [
        f"requests in flight: {s.requests_in_flight}"
        + (f" ({s.requests_waiting_for_rings} ended, waiting for their rings to be read)"
           if s.requests_waiting_for_rings else "")
        + f"   retained: {s.retained_requests} ({_mib(s.retained_bytes)})   evicted: {s.evicted_requests}",
        f"records in: {s.records_in} ({_mib(s.bytes_in)})   drops: {d.records} records "
        f"({_mib(d.bytes)}), {d.missing_positions} positions missing, {d.captures_shed} captures shed "
        f"(daemon behind)",
        *(["gaps by reason (positions): " + ", ".join(f"{reason} {n}" for reason, n in sorted(s.gap_positions.items())
                                                      if n)]
          if any(s.gap_positions.values()) else []),
        f"subscribers: {s.subscribers} ({s.subscribers_waiting} waiting, {s.subscribers_too_slow} cut off as too slow)"
        f"   delivered: {s.delivered_messages} messages ({_mib(s.delivered_bytes)}), mean latency {mean}",
    ]
    if s.connections is not None:  # daemons that count their connections
        c = s.connections
        lines += [
            f"in flight: {_mib(s.inflight_bytes)} of {_mib(s.inflight_budget)}   cut: {s.captures_cut}   "
            f"ends lost: {s.reassembly.get('ends_lost', 0)}   writers exited: {s.writers_exited}",
            f"rejected records: {s.rejected_records}   corrupt: {s.corrupt_records}   rings refused: "
            f"{s.rings_refused}   dirs refused: {s.dirs_refused}   rings broken: {s.rings_broken}"
            f"   discovery: {s.discovery}",
            f"connections: {c.open} open from {c.peers} peers, {c.refused} refused"
            f" ({c.refused_key} for their key)"
            f"{', NOT ACCEPTING (descriptor limit)' if c.accept_paused else ''}   subscriptions refused: "
            f"{s.subscriptions_refused}",
        ]
        lines += [f"broken: {b['path']}: {b['why']}" for b in s.broken_rings]
    a = s.arena
    if a:
        lines.append(f"arena: {a['path']}  {_mib(a['allocated_bytes'])} of {_mib(a['capacity'])} in {a['regions']} "
                     f"regions (peak {_mib(a['peak_bytes'])}), {a['fallbacks']} fallbacks to frames, "
                     f"{s.arena_messages} messages as descriptors")
    lines += _watch_status_lines(s)
    lines += _across_hosts_lines(s)
    return "\n".join(lines)


def _across_hosts_lines(s: DaemonStatus) -> list[str]:
    """Federation (a peer or a home daemon) and the engines' start-up check; absent keys say nothing."""
    lines = []
    f = s.federation
    if f and f.get("role") == "peer":
        lines.append(f"peer of the home daemon {f['home']}: {f['state']}, {f['sessions']} sessions, "
                     f"{f['batches_sent']} batches ({_mib(f['bytes_sent'])}) sent"
                     + (f", REFUSED: {f['refused']}" if f.get("refused") else ""))
    elif f:
        ended = ", ".join(f"{reason} {n}" for reason, n in sorted(f.get("sessions_ended", {}).items())) or "none"
        lines.append(f"home of {len(f['peers'])} peer daemons on {f['endpoint']} (sessions ended: {ended})")
        lines += [f"  peer {p['host']}: {p['rings']} rings, {p['records_in']} records ({_mib(p['bytes_in'])})"
                  for p in f["peers"]]
    for e in s.engines:
        lines.append(f"engine {e['instance']}: world {e['world_size']} on {', '.join(e['hosts'])}, ranks reporting "
                     f"{e['ranks_reporting']}"
                     + (f", NEVER REPORTED: {e['ranks_missing']}" if e["ranks_missing"] else "")
                     + (f", OTHER TAP SETTINGS on {e['settings_differ']}" if e["settings_differ"] else ""))
    return lines


def _watch_status_lines(s: DaemonStatus) -> list[str]:
    """The sequence range still retained and the watchers (a daemon without watch has neither key)."""
    q = s.sequence
    if not q:
        return []
    retained = (f"{q['first_retained']}..{q['last_retained']} ({q['retained']} captures)" if q.get("retained")
                else "none")
    lines = [f"sequence: last {q['last']}, retained {retained}, this run from {q['run_first']}, "
             f"state {q['state_file']}" + (f" NOT PERSISTED: {q['persist_error']}" if q.get("persist_error") else "")]
    ws = s.watchers
    lines.append(f"watchers: {len(ws)}" + (f" ({s.watchers_total} since start)" if ws or s.watchers_total
                                           else ""))
    if ws:
        lines.append(f"  {'PEER/ID':<28} {'MODE':<8} {'HANDLED':>8} {'BEHIND':>7} {'DELIVERED':>9} {'LOST':>6} "
                     f"{'SLOW':>6} {'FILTERED':>8}  FILTERS")
        for w in ws:
            filters = " ".join(f"{k}={v}" for k, v in sorted(w["filters"].items())) or "-"
            wait = f" (waiting for {w['waiting_for']} to end)" if w.get("waiting_for") else ""
            lines.append(f"  {w['peer'][:16] + '/' + str(w['id']):<28} {w['mode']:<8} {w['handled']:>8} {w['behind']:>7} "
                         f"{w['delivered']:>9} {w['lost']:>6} {w['lost_too_slow']:>6} {w['filtered']:>8}  {filters}{wait}")
    return lines


@main.command()
@endpoint_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--timeout", type=click.FloatRange(min=0), default=5.0, show_default=True)
def status(endpoint: str | None, as_json: bool, timeout: float) -> None:
    """Rings, writers, requests in flight, bytes, drops, the retained sequence range and the watchers."""
    from vllm_tap.client import Client, TapError

    try:
        s = Client(endpoint).status(timeout)
    except TapError as e:
        _fail(str(e))
    if as_json:
        click.echo(json.dumps(s, indent=2, sort_keys=True))
        return
    try:
        typed = from_map(s)
    except ValueError as e:
        _fail(f"the daemon's status does not read as one: {e}")
    click.echo(_status_text(typed))


# -- keygen --


@main.command()
@click.argument("directory")
@click.option("--name", default="client", show_default=True,
              help="File names: NAME.key (public) and NAME.key_secret (the pair). `server` for the daemon's.")
def keygen(directory: str, name: str) -> None:
    """Make a CURVE key pair in DIRECTORY: NAME.key (public, to hand out) and NAME.key_secret (keep private).

    The daemon uses server.key_secret (curve_key) and allows the clients whose NAME.key files are in its
    curve_clients directory; a client passes --server-key server.key --client-key NAME.key_secret.
    """
    from vllm_tap.keys import KeygenError, make_keys

    try:
        public_path, secret_path, public = make_keys(directory, name)
    except KeygenError as e:
        _fail(str(e))
    click.echo(f"public key {public}\nwrote {public_path} (public: give it out)\n"
               f"wrote {secret_path} (secret: mode 0600, keep it private)")


# -- record, export (datasets; vllm_tap.cli.datasets) --

from .datasets import register as _register_datasets  # noqa: E402

_register_datasets(main)

# -- bench (its module imports only click and the stdlib; each part imports what it needs) --

from vllm_tap.tools.bench.cli import bench as _bench  # noqa: E402

main.add_command(_bench)
