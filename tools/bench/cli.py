"""`vllm-tap bench serving|hook|transport|all` (and record, ingest, reducer alone): run benchmark parts,
write tables and plots.

Each run writes `<out>/bench-<timestamp>/` (results.md, results.json, PNGs, server and daemon
logs). `--into DIR` adds parts to an existing results folder instead (parts run later replace
earlier ones; the tables are rebuilt from everything there), so the long serving part can run on
its own. A full run (`all`, not --quick) also refreshes tools/bench/LATEST.md, the table meant
for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict
from typing import Any

import click

PARTS = ("serving", "hook", "transport")
ALONE = ("record", "ingest", "reducer")  # parts that `all` does not run
LATEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "LATEST.md")


def _ints(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def _sizes(value: str | None) -> list[int] | None:
    if value is None:
        return None
    out = []
    for x in value.split(","):
        x = x.strip().upper().removesuffix("B")
        mult = 1
        if x.endswith("K"):
            mult, x = 1 << 10, x[:-1]
        elif x.endswith("M"):
            mult, x = 1 << 20, x[:-1]
        try:
            out.append(int(float(x) * mult))
        except ValueError:
            raise click.BadParameter(f"bad size {x!r}; use e.g. 4K,64K,1M") from None
    return out


def _sigterm_to_exit(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C, so `finally` blocks stop the servers and daemons we started
    (once: a second SIGTERM during that cleanup is ignored)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _compare(part: str, params: dict[str, Any], revs: list[str], repeats: int, outdir: str) -> dict[str, Any]:
    """`part` of this checkout and of `revs`, interleaved; prints each version's medians."""
    from vllm_tap.tools.bench import versions

    try:
        res = versions.compare(part, params, revs, repeats, outdir, click.echo)
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    click.echo("\n".join(versions.lines(res)))
    return res



@click.command("bench")
@click.argument("what", type=click.Choice(("all",) + PARTS + ALONE), default="all")
@click.option("--out", default="results", show_default=True, metavar="DIR", help="Parent folder for bench-<timestamp>/.")
@click.option("--into", default=None, metavar="DIR", help="Add to this existing results folder instead.")
@click.option("--quick", is_flag=True, help="Small, fast configurations: a smoke check, not a measurement.")
@click.option("--repeats", type=click.IntRange(min=1), default=None, help="Repeats of every part (default per part).")
@click.option("--latest/--no-latest", default=None, help="Also write tools/bench/LATEST.md (default: for a full `all`).")
# serving
@click.option("--gpu", is_flag=True, help="Serving on one GPU: the 'gpu' preset (a ~1.1 B bf16 Llama, compiled, configs "
              "a b o t h l e, servers started together).")
@click.option("--model", "preset", type=click.Choice(("default", "small", "gpu")), default="default", show_default=True,
              help="Serving preset: 'default' (8 x 1024, vocabularies 32000 and 128256, configs a-f) or 'small' "
                   "(8 x 512, vocabulary 32000, configs a b t h l e, 7 repeats; per-process CPU per request). "
                   "For `hook`: 'small' times the decode steps of those configurations against 30 us + memcpy.")
@click.option("--vocab", default=None, metavar="V,V", help="Serving vocabulary points (first gets every config). [32000,128256]")
@click.option("--configs", default=None, metavar="abthle", help="Serving configurations at the first point (letters of "
              "a b c d e f t h l; see `vllm_tap.tools.bench.serving`).")
@click.option("--extra-configs", default=None, metavar="abcd", help="Serving configurations at later points.")
@click.option("--warmup-rounds", type=click.IntRange(min=0), default=None,
              help="Unmeasured rounds of every serving configuration first. [small: 1, default: 0]")
@click.option("--requests", "num_requests", type=click.IntRange(min=1), default=None, help="Requests per run. [64]")
@click.option("--prompt-len", type=click.IntRange(min=2), default=None, help="[128]")
@click.option("--output-len", type=click.IntRange(min=2), default=None, help="[64]")
@click.option("--concurrency", type=click.IntRange(min=1), default=None, help="[8]")
@click.option("--d-requests", type=click.IntRange(min=0), default=None, help="Requests for (d) (0 = as many as the others). [8]")
@click.option("--hidden", type=click.IntRange(min=64), default=None, help="Bench model hidden size. [1024]")
@click.option("--layers", "num_layers", type=click.IntRange(min=1), default=None, help="Bench model layers. [8]")
@click.option("--heads", type=click.IntRange(min=1), default=None, help="Attention heads. [16]")
@click.option("--kv-heads", type=click.IntRange(min=1), default=None, help="KV heads. [4]")
@click.option("--intermediate", type=click.IntRange(min=1), default=None, help="MLP size. [2816]")
@click.option("--tap-layers", default=None, metavar="L,L", help="Layers (c) captures. [2,5]")
# hook
@click.option("--hook-vocab", default=None, metavar="V,V", help="Hook-cost vocabulary sizes. [32000,128256]")
@click.option("--hook-steps", type=click.IntRange(min=1), default=None, help="Timed steps per scenario and repeat. [40]")
@click.option("--against", "against", multiple=True, metavar="REV",
              help="Hook, ingest, transport: also measure with the code of this git revision of the checkout "
                   "(repeatable), interleaved with this one, medians and ratios: before/after in one run. "
                   "(Hook: its host-only scenario.)")
# transport
@click.option("--sizes", default=None, metavar="4K,1M", help="Transport record sizes. [4K,16K,64K,256K,1M,4M]")
@click.option("--subscribers", default=None, metavar="1,4", help="Transport subscriber counts. [1,4]")
@click.option("--note", "notes", multiple=True, help="A note for the results (repeatable).")
def bench(what: str, out: str, into: str | None, quick: bool, repeats: int | None, latest: bool | None, **opt: Any) -> None:
    """Benchmark the tap: serving overhead, hook cost against memcpy, transport latency/throughput.

    Writes results.md (tables with ratios and targets), results.json and PNG plots. Serving starts
    vLLM servers (one at a time per configuration's server) and takes long on a CPU machine: --quick
    first. Configurations are interleaved and repeated; medians and within-repeat ratios are reported.
    """
    from vllm_tap.tools.bench import machine_info, report

    signal.signal(signal.SIGTERM, _sigterm_to_exit)
    parts = PARTS if what == "all" else (what,)
    if into:
        outdir = into
    else:
        outdir = os.path.join(out, "bench-" + time.strftime("%Y%m%d-%H%M%S") + ("-quick" if quick else ""))
    os.makedirs(outdir, exist_ok=True)
    results: dict[str, Any] = {}
    jpath = os.path.join(outdir, "results.json")
    if os.path.exists(jpath):
        with open(jpath) as f:
            results = json.load(f)
    results.setdefault("machine", machine_info())
    results["quick"] = quick or results.get("quick", False)
    results["notes"] = list(results.get("notes", [])) + list(opt.pop("notes"))
    echo = lambda msg: click.echo(msg, err=False)  # noqa: E731

    from vllm_tap.tools.bench import versions

    try:
        versions.check_revisions(list(opt["against"]))
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    for part in parts:
        t0 = time.time()
        click.echo(f"== {part} ({'quick' if quick else 'full'}) -> {outdir}")
        if part == "record":
            from vllm_tap.tools.bench import record

            p = record.RecordParams.quick() if quick else record.RecordParams()
            if repeats:
                p.repeats = repeats
            results["record"] = record.run(p, echo)
            click.echo(record.table(results["record"]))
        elif part == "ingest":
            from vllm_tap.tools.bench import ingest

            p = ingest.IngestParams.quick() if quick else ingest.IngestParams()
            if repeats:
                p.repeats = repeats
            if opt["against"]:
                results["ingest_versions"] = _compare("ingest", asdict(p), list(opt["against"]), p.repeats, outdir)
            else:
                results["ingest"] = ingest.run(p, outdir, echo)
                click.echo(ingest.table(results["ingest"]))
        elif part == "reducer":
            from vllm_tap.tools.bench import reducer

            p = reducer.ReducerParams.quick() if quick else reducer.ReducerParams()
            if repeats:
                p.repeats = repeats
            results["reducer"] = reducer.run(p, echo)
            click.echo("\n".join(reducer.table(results["reducer"])))
        elif part == "transport":
            from vllm_tap.tools.bench import transport

            p = transport.TransportParams.quick() if quick else transport.TransportParams()
            if repeats:
                p.repeats = repeats
            p.sizes = _sizes(opt["sizes"]) or p.sizes
            p.subscribers = _ints(opt["subscribers"]) or p.subscribers
            if opt["against"]:
                results["transport_versions"] = _compare("transport", asdict(p), list(opt["against"]), p.repeats,
                                                         outdir)
            else:
                results["transport"] = transport.run(p, outdir, echo)
        elif part == "hook":
            from vllm_tap.tools.bench import hook_cost, hook_host

            if opt["preset"] == "small":
                p = hook_cost.HookParams.small()
                if quick:
                    p.repeats, p.steps, p.warmup = 2, 20, 3
            else:
                p = hook_cost.HookParams.quick() if quick else hook_cost.HookParams()
            if repeats:
                p.repeats = repeats
            p.vocab_sizes = _ints(opt["hook_vocab"]) or p.vocab_sizes
            if opt["hook_steps"]:
                p.steps = opt["hook_steps"]
            results["hook"] = hook_cost.run(p, echo)
            hp = hook_host.HostParams.quick() if quick else hook_host.HostParams()
            if repeats:
                hp.repeats = repeats
            hp.against = list(opt["against"])
            try:
                results["hook_host"] = hook_host.run(hp, echo)
            except RuntimeError as e:
                raise click.ClickException(str(e)) from None
            click.echo("\n".join(hook_host.table(results["hook_host"])))
        else:
            from vllm_tap.tools.bench import serving

            p = serving.ServingParams.preset_params("gpu" if opt["gpu"] else opt["preset"], quick)
            if repeats:
                p.repeats = repeats
            m = p.model
            for key, attr in (("hidden", "hidden_size"), ("num_layers", "num_layers"), ("heads", "num_heads"),
                              ("kv_heads", "num_kv_heads"), ("intermediate", "intermediate_size")):
                if opt[key]:
                    setattr(m, attr, opt[key])
            for key in ("num_requests", "prompt_len", "output_len", "concurrency", "d_requests", "warmup_rounds"):
                if opt[key] is not None:
                    setattr(p, key, opt[key])
            p.vocab_sizes = _ints(opt["vocab"]) or p.vocab_sizes
            p.tap_layers = _ints(opt["tap_layers"]) or p.tap_layers
            if opt["configs"]:
                unknown = sorted(set(opt["configs"]) - set(serving.CONFIGS) - {","})
                if unknown:
                    raise click.BadParameter(f"unknown configuration {unknown[0]!r}; known: {''.join(serving.CONFIGS)}",
                                             param_hint="--configs")
                p.configs = [c for c in opt["configs"] if c in serving.CONFIGS]
            if opt["extra_configs"] is not None:
                p.extra_point_configs = [c for c in opt["extra_configs"] if c in serving.CONFIGS]
            if "a" not in p.configs:
                raise click.BadParameter("the serving configurations must include (a), the baseline", param_hint="--configs")
            bad = [x for x in p.tap_layers if not 0 <= x <= m.num_layers]
            if bad:
                raise click.BadParameter(f"layer {bad[0]} is outside 0..{m.num_layers}", param_hint="--tap-layers")
            results["serving"] = serving.run(p, outdir, echo)
        click.echo(f"== {part} done in {time.time() - t0:.0f} s")
        results["machine"]["loadavg_end"] = os.getloadavg()
        report.write(results, outdir)  # after every part, so a later failure keeps what was measured

    if latest is None:
        latest = what == "all" and not quick
    paths = report.write(results, outdir, LATEST if latest else None)
    click.echo(f"wrote {paths['md']} and {paths['json']}" + (f"; {paths['latest']}" if "latest" in paths else ""))
    with open(paths["md"]) as f:
        md = f.read()
    click.echo(md.split("## Serving overhead")[0] if "## Targets" in md else md[:3000])


if __name__ == "__main__":
    sys.exit(bench())
