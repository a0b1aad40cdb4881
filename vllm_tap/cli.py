"""`vllm-tap`: run the daemon, subscribe to a capture, show status. Commands stay thin: the work
lives in vllm_tap.daemon and vllm_tap.client."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import click
import numpy as np

from vllm_tap.client.stream import ENDPOINT_ENV
from vllm_tap.daemon.cli_options import config_options


def endpoint_option(f: Callable) -> Callable:
    """The one --endpoint option every command shares."""
    return click.option(
        "--endpoint", envvar=ENDPOINT_ENV, default=None, metavar="URL",
        help=f"ZeroMQ endpoint of the daemon (ipc://PATH or tcp://HOST:PORT); default ${ENDPOINT_ENV}, "
             "else the daemon's default socket.",
    )(f)


def _fail(message: str) -> None:
    """One line on stderr and a non-zero exit, never a traceback, for anything the user can fix."""
    raise click.ClickException(message)


@click.group()
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


def _ranges(ps: list[int]) -> str:
    from vllm_tap.wire_format import ranges_of

    return ",".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in ranges_of(ps))


# -- status --


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _status_text(s: dict[str, Any]) -> str:
    lines = [f"daemon pid {s['pid']} up {s['uptime_s']:.0f} s at {s['endpoint']} watching {s['shm_dir']}"]
    bell = s.get("doorbell")
    lines.append(f"woken by writers at {bell} ({s.get('doorbell_wakeups', 0)} wake-ups)" if bell
                 else "no doorbell: polling the rings on a timer")
    rings = s["rings"]
    if rings:
        lines.append(f"{'RING':<40} {'RANK':>5} {'WRITER':>8} {'ALIVE':>5} {'CAPACITY':>10} {'PENDING':>10} "
                     f"{'WRITTEN':>9} {'DROPPED':>8}")
        for r in rings:
            lines.append(
                f"{r['instance'] + '/' + r['name']:<40} {r['rank']:>5} {r['writer_pid']:>8} "
                f"{'yes' if r['alive'] else 'no':>5} {_mib(r['capacity']):>10} {_mib(r['pending_bytes']):>10} "
                f"{r['writer']['records_written']:>9} {r['writer']['records_dropped']:>8}"
            )
    else:
        lines.append("no rings yet")
    d = s["drops"]
    lat = s["delivery_latency_s"]
    mean = f"{1000 * lat['sum'] / lat['count']:.2f} ms" if lat["count"] else "-"
    lines += [
        f"requests in flight: {s['requests_in_flight']}   retained: {s['retained_requests']} ({_mib(s['retained_bytes'])})"
        f"   evicted: {s['evicted_requests']}",
        f"records in: {s['records_in']} ({_mib(s['bytes_in'])})   drops: {d['records']} records "
        f"({_mib(d['bytes'])}), {d['missing_positions']} positions missing",
        f"subscribers: {s['subscribers']} ({s['subscribers_waiting']} waiting, {s['subscribers_too_slow']} cut off as too slow)"
        f"   delivered: {s['delivered_messages']} messages ({_mib(s['delivered_bytes'])}), mean latency {mean}",
    ]
    return "\n".join(lines)


@main.command()
@endpoint_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--timeout", type=click.FloatRange(min=0), default=5.0, show_default=True)
def status(endpoint: str | None, as_json: bool, timeout: float) -> None:
    """Rings, writers, requests in flight, bytes and drops of the running daemon."""
    from vllm_tap.client import Client, TapError

    try:
        s = Client(endpoint).status(timeout)
    except TapError as e:
        _fail(str(e))
    click.echo(json.dumps(s, indent=2, sort_keys=True) if as_json else _status_text(s))


# -- record, export (datasets; vllm_tap.dataset_cli) --

from vllm_tap.dataset_cli import register as _register_datasets  # noqa: E402

_register_datasets(main)

# -- bench (its module imports only click and the stdlib; each part imports what it needs) --

from vllm_tap.tools.bench.cli import bench as _bench  # noqa: E402

main.add_command(_bench)


if __name__ == "__main__":
    sys.exit(main())
