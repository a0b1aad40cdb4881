"""Markdown tables and PNG plots from a bench's results dict (matplotlib, Agg backend)."""

from __future__ import annotations

import math
import os
from typing import Any

from vllm_tap.tools.bench import serving, transport


def _f(v: Any, fmt: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return format(v, fmt)


def _x(v: Any) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}×"


def _ok(met: bool | None) -> str:
    return "–" if met is None else ("met" if met else "**missed**")


def _bytes(n: float) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "–"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


# -- targets --


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target with its measured value and whether it was met."""
    out: list[dict[str, Any]] = []
    sv = results.get("serving")
    if sv:
        for pt in sv["points"]:
            s = pt["summary"]
            v = pt["vocab"]
            if any(c in s for c in ("t", "h", "l")):
                out += _small_targets(s, v)
                continue
            for c in ("b", "c"):
                if c not in s:
                    continue
                r = s[c]["ratio_to_a"]
                t = r["tok_s"]["median"]
                out.append({"part": "serving", "target": f"V={v}: ({c}) output tok/s ≥ {serving.TARGET_TPUT} × (a)",
                            "measured": _x(t), "met": None if math.isnan(t) else t >= serving.TARGET_TPUT})
                i = r["itl_p99_ms"]["median"]
                out.append({"part": "serving", "target": f"V={v}: ({c}) ITL p99 ≤ {serving.TARGET_ITL_P99} × (a)",
                            "measured": _x(i), "met": None if math.isnan(i) else i <= serving.TARGET_ITL_P99})
            if "c_over_d" in s:
                cd = s["c_over_d"]["median"]
                out.append({"part": "serving", "target": f"V={v}: (c) output tok/s ≥ {serving.TARGET_C_OVER_D:g} × (d)",
                            "measured": _x(cd), "met": None if math.isnan(cd) else cd >= serving.TARGET_C_OVER_D})
            for c in serving.CAPTURING:
                if c not in s:
                    continue
                d = s[c]["drain"]
                full = d["complete_captures"] == d["captures"] and d["missing"] == 0
                out.append({"part": "serving", "target": f"V={v}: ({c}) subscriber received every position",
                            "measured": f"{d['positions']}/{d['expected_positions']} positions, "
                                        f"{d['complete_captures']}/{d['captures']} captures complete",
                            "met": full})
    hk = results.get("hook")
    if hk:
        for row in hk["summary"]:
            if not row["captured_bytes"]:
                continue
            out.append({"part": "hook", "target": f"V={row['vocab']} {row['scenario']}: hook ≤ {_limit_words(hk)}",
                        "measured": f"{row['hook_cpu_us']:.0f} µs vs limit {row['limit_cpu_us']:.0f} µs",
                        "met": row["met"]})
    hh = results.get("hook_host")
    if hh:
        this = hh["versions"][0]
        for row in hh["summary"]:
            if row["version"] != this:
                continue
            out.append({"part": "hook (host-only)",
                        "target": f"{row['spec']} @ {row['batch']}: ≤ 30 µs"
                                  + (" + its top-k" if row["topk_us"] else "") + f", ≤ {_host_calls(row)} calls",
                        "measured": f"{row['host_less_topk_us']:.0f} µs"
                                    + (f" (+ top-k {row['topk_us']:.0f})" if row["topk_us"] else "")
                                    + f", {row['step_ops']} calls (+ {row['copies']} copy)"
                                    + ("" if row.get("calls_constant", True) else
                                                                   " (not the same at every batch)"),
                        "met": row["met_us"] and row["met_calls"] and row.get("calls_constant", True)})
    tp = results.get("transport")
    if tp:
        rows = [r for r in tp["summary"] if r.get("path", "arena") == "arena"]
        for row in rows:
            if row["p99_target"] is not None:
                out.append({"part": "transport",
                            "target": f"arena, {transport.size_label(row['size'])} × {row['subscribers']} sub: "
                                      f"p99 ≤ {transport.P99_TARGET_MS:g} ms",
                            "measured": f"{row['p99_ms']:.3f} ms", "met": row["p99_target"]})
        for row in rows:
            if row["size"] < transport.SHARE_FROM or "share_per_sub" not in row:
                continue
            if row["subscribers"] == 1:
                out.append({"part": "transport",
                            "target": f"arena, {transport.size_label(row['size'])} × 1 sub: ≥ "
                                      f"{transport.SHARE_1_TARGET:.0%} of memcpy",
                            "measured": f"{row['gbps_per_sub']:.2f} GB/s = {row['share_per_sub']:.0%} of "
                                        f"{row['memcpy_gbps']:.2f}", "met": row["share_per_sub"] >= transport.SHARE_1_TARGET})
            else:
                out.append({"part": "transport",
                            "target": f"arena, {transport.size_label(row['size'])} × {row['subscribers']} sub: in all ≥ "
                                      f"{transport.SHARE_ALL_TARGET:.0%} of memcpy",
                            "measured": f"{row['gbps_total']:.2f} GB/s = {row['share_total']:.0%} of "
                                        f"{row['memcpy_gbps']:.2f}", "met": row["share_total"] >= transport.SHARE_ALL_TARGET})
        for row in tp.get("path_summary") or []:
            if row["cpu_target"] is not None:
                out.append({"part": "transport",
                            "target": f"{transport.size_label(row['size'])} × {row['subscribers']} sub: daemon CPU s/GB, "
                                      f"arena ≤ {transport.CPU_RATIO_TARGET:g} × frames",
                            "measured": f"× {row['cpu_per_gb_ratio']:.2f}", "met": row["cpu_target"]})
    ig = results.get("ingest")
    if ig:
        from vllm_tap.tools.bench import ingest

        out += ingest.targets(ig)
    rd = results.get("reducer")
    if rd:
        from vllm_tap.tools.bench import reducer

        out += reducer.targets(rd)
    return out


def _small_targets(s: dict[str, Any], v: int) -> list[dict[str, Any]]:
    """The small preset's serving targets: output tok/s against (a) and (e), CPU per request."""
    out: list[dict[str, Any]] = []
    for c, limit in serving.TARGET_SMALL_TPUT.items():
        if c not in s:
            continue
        q = s[c]["ratio_to_a"]["tok_s"]
        t = q["median"]
        out.append({"part": "serving", "target": f"V={v}: ({c}) output tok/s ≥ {limit} × (a)",
                    "measured": _xr(q), "met": None if math.isnan(t) else t >= limit})
    if "t_over_e" in s:
        q = s["t_over_e"]
        out.append({"part": "serving", "target": f"V={v}: (t) output tok/s ≥ (e) (vLLM's own top-20 logprobs)",
                    "measured": _xr(q), "met": None if math.isnan(q["median"]) else q["median"] >= 1.0})
    for key, label in (("api", "API server"), ("vllm", "vLLM processes")):
        extra = s.get("b", {}).get("cpu_extra_ms_per_request", {}).get(key)
        if not extra or not extra["n"]:
            continue
        base = s.get("a", {}).get("cpu_ms_per_request", {}).get(key, {}).get("median", math.nan)
        lo, hi = extra["range"]
        measured = f"{extra['median']:+.2f} ms/request ({lo:+.2f} – {hi:+.2f}) of {base:.1f}"
        # Differences spread wider than 10 % of (a) cannot show a cost of 1 %: not judged.
        resolved = hi - lo <= 0.1 * base
        out.append({"part": "serving",
                    "target": f"V={v}: (b) adds no measurable CPU per request to the {label} "
                              "(the per-repeat differences to (a) straddle 0, median ≤ 1 % of (a))",
                    "measured": measured if resolved else measured + "; not resolved (spread > 10 % of (a))",
                    "met": (lo <= 0.0 and extra["median"] <= 0.01 * base) if resolved else None})
    for c in serving.CAPTURING:
        if c not in s:
            continue
        d = s[c]["drain"]
        out.append({"part": "serving", "target": f"V={v}: ({c}) subscriber received every position",
                    "measured": f"{d['positions']}/{d['expected_positions']} positions, "
                                f"{d['complete_captures']}/{d['captures']} captures complete",
                    "met": d["complete_captures"] == d["captures"] and d["missing"] == 0})
    return out


def _xr(q: dict[str, Any]) -> str:
    """A ratio's median with its range over repeats."""
    m = q.get("median", math.nan)
    if m is None or math.isnan(m):
        return "–"
    lo, hi = q.get("range", (math.nan, math.nan))
    return f"{m:.3f}× ({lo:.3f}–{hi:.3f})"


def _msr(q: dict[str, Any] | None, sign: bool = False) -> str:
    """Milliseconds per request: median (min–max)."""
    if not q or q.get("median") is None or math.isnan(q["median"]):
        return "–"
    lo, hi = q["range"]
    f = "+.2f" if sign else ".2f"
    return f"{format(q['median'], f)} ({format(lo, f)} – {format(hi, f)})"


# -- markdown --


def _machine(results: dict[str, Any]) -> list[str]:
    m = results.get("machine", {})
    load = [(k, results.get(k, {}).get("loadavg_start")) for k in ("hook", "transport")]
    sv = results.get("serving")
    if sv:
        load += [(f"serving V={p['vocab']}", p.get("loadavg_start")) for p in sv["points"]]
    loads = [f"{k} {l[0]:.1f}" for k, l in load if l]
    lines = [
        f"Measured {m.get('started', '?')} on {m.get('cpu', '?')}, {m.get('cpus', '?')} CPUs, {m.get('mem_gib', '?')} GiB, "
        f"Python {m.get('python', '?')}; " + (
            f"vLLM on {m['gpu']} (bf16, compiled, CUDA graphs)." if m.get("gpu") else "vLLM CPU backend (float32, eager)."),
    ]
    if loads:
        lines.append(f"1-minute load average when the parts started: {', '.join(loads)} "
                     f"(on {m.get('cpus', '?')} CPUs: other jobs shared the machine; configurations are interleaved "
                     "and repeated, and medians and within-repeat ratios are reported to absorb that).")
    return lines


def serving_md(sv: dict[str, Any]) -> list[str]:
    p = sv["params"]
    out = ["## Serving overhead", ""]
    mdl = p["model"]
    if any(c in pt["configs"] for pt in sv["points"] for c in ("t", "h", "l")):
        return out + _small_md(sv)
    out.append(
        f"Random Llama, {mdl['num_layers']} layers × {mdl['hidden_size']} hidden, {mdl['num_heads']} heads "
        f"(head_dim {mdl['hidden_size'] // mdl['num_heads']}), {mdl['num_kv_heads']} KV heads, MLP {mdl['intermediate_size']}; "
        f"{p['num_requests']} requests × ({p['prompt_len']} prompt + {p['output_len']} output tokens, ignore_eos), "
        f"concurrency {p['concurrency']}, streamed; {p['repeats']} repeats, configurations interleaved. "
        f"(c) captures full logits + layers {p['tap_layers']} at every position and a subscriber process drains "
        f"every capture; (f) is (c) at output positions only, so without the extra lm-head pass over the prompt that (c)'s prompt logits need. (d) gets {p['d_requests'] or p['num_requests']} requests (it is slow; throughput is per token). "
        "Every run gets a fresh random request set of that shape (vLLM's prefix cache would otherwise serve "
        "repeated prompts, and a capture of prompt positions bypasses it) and an unmeasured wave of short requests "
        "first (a server that sat idle while the other was measured starts slowly). "
        "Ratios are to (a) within the same repeat, then the median over repeats; ITL is the gap between streamed "
        "events (vLLM may put several tokens in one event under load), TPOT the per-request mean.")
    out.append("")
    for pt in sv["points"]:
        s = pt["summary"]
        out.append(f"### Vocabulary {pt['vocab']} ({pt['model_params'] / 1e6:.0f} M parameters)")
        out.append("")
        out.append("| config | | req | out tok/s | ×(a) | TTFT p50 ms | ×(a) | TTFT p99 ms | ×(a) | ITL p50 ms | ×(a) "
                   "| ITL p99 ms | ×(a) | TPOT ms | bytes/request |")
        out.append("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        for c in pt["configs"]:
            if c not in s:
                continue
            r = s[c]
            q = r["ratio_to_a"]
            out.append(
                f"| ({c}) | {serving.CONFIGS[c]} | {r['requests']} | {_f(r['tok_s'], '.1f')} | {_x(q['tok_s']['median'])} "
                f"| {_f(r['ttft_p50_ms'], '.0f')} | {_x(q['ttft_p50_ms']['median'])} | {_f(r['ttft_p99_ms'], '.0f')} "
                f"| {_x(q['ttft_p99_ms']['median'])} | {_f(r['itl_p50_ms'], '.1f')} | {_x(q['itl_p50_ms']['median'])} "
                f"| {_f(r['itl_p99_ms'], '.1f')} | {_x(q['itl_p99_ms']['median'])} | {_f(r['tpot_ms'], '.1f')} "
                f"| {_bytes(r['bytes_per_request'])} |")
        out.append("")
        for c in serving.CAPTURING:
            if c not in s:
                continue
            d = s[c]["drain"]
            cpu = s[c]["cpu_s"]
            out.append(
                f"({c}) drained {d['complete_captures']}/{d['captures']} captures complete, "
                f"{d['positions']}/{d['expected_positions']} positions, {d['missing']} missing, {d['gb']:.2f} GB "
                f"({d['gb_per_s']:.3f} GB/s during a run), ring drops {d['ring_drops']}; last capture drained "
                f"{d['lag_s']:.2f} s after the last response (median). CPU seconds per run (median): server "
                f"{cpu.get('server', 0):.1f}, daemon {cpu.get('daemon', 0):.1f}, subscriber {cpu.get('drainer', 0):.1f}.")
        if "c_over_d" in s:
            cd = s["c_over_d"]
            out.append(f"(c) / (d) output tok/s: {_x(cd['median'])} (range {_x(cd['range'][0])} – {_x(cd['range'][1])}).")
        if "a" in s and any(k in s for k in "bc"):
            rng = "; ".join(f"({c}) tok/s ×(a) {_x(s[c]['ratio_to_a']['tok_s']['range'][0])} – "
                            f"{_x(s[c]['ratio_to_a']['tok_s']['range'][1])}" for c in "bc" if c in s)
            out.append(f"Spread over repeats: {rng}.")
        out.append("")
    return out


def _small_md(sv: dict[str, Any]) -> list[str]:
    """The per-process CPU view (the small preset: per-process CPU per request)."""
    p = sv["params"]
    mdl = p["model"]
    out = [
        f"Preset `{p.get('preset', 'default')}`: random Llama, {mdl['num_layers']} layers × {mdl['hidden_size']} hidden, "
        f"{mdl['num_heads']} heads, {mdl['num_kv_heads']} KV heads, MLP {mdl['intermediate_size']}, "
        f"{'bfloat16 on the GPU' if p.get('device') == 'cuda' else 'float32'}; "
        f"{p['num_requests']} requests × ({p['prompt_len']} prompt + {p['output_len']} output tokens, ignore_eos), "
        f"concurrency {p['concurrency']}, streamed; {p['repeats']} repeats after {p.get('warmup_rounds', 0)} unmeasured "
        f"round(s), configurations interleaved (order rotated each repeat). Layers captured by (h): {p['tap_layers']}; (t) is top-{p.get('topk', 20)}. Every capturing "
        "configuration has a subscriber process draining each capture by its key. Ratios and differences are to (a) "
        "within the same repeat, then the median over repeats, with the range (min–max) over repeats in brackets.",
        "",
        "CPU time is utime+stime of each process from /proc over the measured window (first request sent to the last "
        "capture drained), per request: the server's API process, engine core and worker(s), the daemon and the "
        "subscriber. The daemon runs alongside (a) and (e) too (it belongs to the tap server, which idles then); there "
        "it counts as background, with the idle server. The engine core's and the worker's times include vLLM's "
        "own busy-wait on its shared-memory message queues (a reader spins on `sched_yield` for up to 1 s after "
        "each message, `vllm/distributed/device_communicators/shm_broadcast.py`, `SpinCondition.wait`), so they "
        "follow wall time and give way to other processes; the API server's, the daemon's and the subscriber's "
        "times are work. The hook's own cost per step is in the worker's profile and the `hook` part.",
        "",
    ]
    for pt in sv["points"]:
        s = pt["summary"]
        out.append(f"### Vocabulary {pt['vocab']} ({pt['model_params'] / 1e6:.0f} M parameters)")
        out.append("")
        out.append("| config | | out tok/s | ×(a) | TTFT p50 ms | ×(a) | ITL p50 ms | ×(a) | ITL p99 ms | ×(a) | captured/request |")
        out.append("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        for c in pt["configs"]:
            if c not in s:
                continue
            r = s[c]
            q = r["ratio_to_a"]
            cap = "–"
            if "drain" in r and r["drain"]["captures"]:
                cap = _bytes(r["drain"]["gb"] * 1e9 / r["drain"]["captures"])
            elif c in ("d", "e"):
                cap = f"JSON {_bytes(r['bytes_per_request'])}"
            out.append(
                f"| ({c}) | {serving.CONFIGS[c]} | {_f(r['tok_s'], '.1f')} | {_xr(q['tok_s'])} "
                f"| {_f(r['ttft_p50_ms'], '.0f')} | {_xr(q['ttft_p50_ms'])} | {_f(r['itl_p50_ms'], '.1f')} "
                f"| {_xr(q['itl_p50_ms'])} | {_f(r['itl_p99_ms'], '.1f')} | {_xr(q['itl_p99_ms'])} | {cap} |")
        out.append("")
        if not any("cpu_ms_per_request" in s[c] for c in pt["configs"] if c in s):
            continue
        workers = sorted({k for c in pt["configs"] if c in s for k in s[c].get("cpu_ms_per_request", {})
                          if k.startswith("worker") and k != "workers"})
        cols = ["api", "engine", *workers, "daemon", "subscriber"]
        names = {"api": "API server", "engine": "engine core", "daemon": "daemon", "subscriber": "subscriber"}
        out.append("CPU milliseconds per request, median (min – max) over repeats:")
        out.append("")
        out.append("| config | " + " | ".join(names.get(k, k) for k in cols)
                   + " | vLLM processes | vLLM ×(a) | vLLM − (a) | all − (a) |")
        out.append("|---|" + "--:|" * (len(cols) + 4))
        for c in pt["configs"]:
            if c not in s or "cpu_ms_per_request" not in s[c]:
                continue
            r = s[c]
            cm = r["cpu_ms_per_request"]
            tap_server = serving.SERVER_OF[c] == "tap"
            cells = [_msr(cm.get(k)) if (k not in ("daemon", "subscriber") or tap_server) else "–" for k in cols]
            ex = r["cpu_extra_ms_per_request"]
            out.append(f"| ({c}) | " + " | ".join(cells) + f" | {_msr(cm.get('vllm'))} | {_xr(r['cpu_ratio_to_a']['vllm'])} "
                       f"| {_msr(ex.get('vllm'), sign=True) if c != 'a' else '–'} "
                       f"| {_msr(ex.get('total'), sign=True) if c != 'a' else '–'} |")
        out.append("")
        loads = [s[c]["load"] for c in pt["configs"] if c in s and "load" in s[c]]
        if loads:
            la = [l["loadavg1"]["median"] for l in loads]
            lmax = max(l["loadavg1"]["range"][1] for l in loads)
            fs = [l["foreign_share"]["median"] for l in loads if l["foreign_share"]["n"]]
            fmax = max((l["foreign_share"]["range"][1] for l in loads if l["foreign_share"]["n"]), default=math.nan)
            bg = [s[c]["background_ms_per_request"]["median"] for c in pt["configs"] if c in s and "background_ms_per_request" in s[c]]
            out.append(
                f"Machine during the runs: 1-minute load average {min(la):.2f} – {max(la):.2f} (median per configuration; "
                f"highest {lmax:.2f}) on {pt['runs'][0].get('cpus', '?') if pt['runs'] else '?'} CPUs; other jobs used {100 * min(fs):.0f} – "
                f"{100 * max(fs):.0f} % of the CPUs (median per configuration; highest run {100 * fmax:.0f} %). "
                f"The idle server (and the daemon, for (a) and (e)) used {min(bg):.2f} – {max(bg):.2f} ms per request.")
        for c in serving.CAPTURING:
            if c not in s:
                continue
            d = s[c]["drain"]
            out.append(
                f"({c}) drained {d['complete_captures']}/{d['captures']} captures complete, "
                f"{d['positions']}/{d['expected_positions']} positions, {d['missing']} missing, ring drops {d['ring_drops']}, "
                f"{d['gb']:.3f} GB; last capture drained {d['lag_s']:.2f} s after the last response (median).")
        if "t_over_e" in s:
            out.append(f"(t) / (e) output tok/s: {_xr(s['t_over_e'])}.")
        out.append("")
    return out


def _limit_words(hk: dict[str, Any]) -> str:
    p = hk.get("params", {})
    f, slack = p.get("factor", 2.0), p.get("slack_us", 50.0)
    return f"{'' if f == 1 else f'{f:g} × '}memcpy + {slack:g} µs"


def hook_md(hk: dict[str, Any]) -> list[str]:
    p = hk["params"]
    bw = hk["bandwidth_gbps"]
    out = ["## Hook cost against memcpy", "",
           f"`CaptureCore.capture` driven in-process with real tensors (hidden {p['hidden_size']}, layers {p['layers']} "
           f"exposed; each scenario says what its requests capture, default: full logits and those layers; float32, "
           f"{p['threads']} torch thread), {p['repeats']} repeats × {p['steps']} steps "
           "per scenario, interleaved. Time is the thread's CPU time per step (wall-clock alongside; on a busy machine "
           "wall time also counts time spent preempted). memcpy = captured bytes ÷ memcpy bandwidth measured in the "
           f"same run (torch copy of {p['memcpy_bytes'] >> 20} MiB into shared memory: "
           f"{min(bw):.1f} – {max(bw):.1f} GB/s by wall time). The extra lm-head pass a prefill capture asks for is "
           "model compute the user requested, shown separately and not counted as hook time.", "",
           f"| vocab | scenario | captured | torch ops | hook CPU µs | hook wall µs | memcpy µs | limit µs ({_limit_words(hk)}) | hook ÷ memcpy | target | extra lm-head µs |",
           "|--:|---|--:|--:|--:|--:|--:|--:|--:|---|--:|"]
    for row in hk["summary"]:
        out.append(
            f"| {row['vocab']} | {row['scenario']} ({hk['scenarios'].get(row['scenario'], '')}) | {_bytes(row['captured_bytes'])} "
            f"| {row.get('torch_ops', '–')} | {_f(row['hook_cpu_us'], '.0f')} | {_f(row['hook_us'], '.0f')} | {_f(row['memcpy_cpu_us'], '.0f')} "
            f"| {_f(row['limit_cpu_us'], '.0f')} | {_f(row['hook_cpu_us'] / row['memcpy_cpu_us'] if row['memcpy_cpu_us'] else float('nan'), '.2f')} "
            f"| {_ok(row['met']) if row['captured_bytes'] else '–'} | {_f(row['lm_head_us'], '.0f') if row['extra_rows'] else '–'} |")
    out.append("")
    return out


def transport_md(tp: dict[str, Any]) -> list[str]:
    p = tp["params"]
    mc = tp.get("memcpy_gbps")
    out = ["## Transport: ring commit → subscriber holding a numpy array", "",
           f"Writer process → ring → `vllm-tap daemon` → N subscriber processes (ipc socket), one position of float32 per "
           f"record; {p['repeats']} repeats, configurations interleaved. Latency: records paced (≥ {p['min_pace_s'] * 1e3:g} ms "
           f"apart, ≤ {p['pace_bandwidth'] / 1e6:g} MB/s), {p['latency_records']} per trial, commit timestamp in the payload. "
           "Throughput: as fast as the ring allows (the writer waits for room, nothing dropped), from the first commit "
           "to each subscriber's last record.", "",
           "Two paths, interleaved against the same daemon: **frames** (payloads as ZeroMQ frames, the path before "
           "the arena and the one tcp:// subscribers take) and **arena** (descriptors; the subscriber copies each "
           "array out of the daemon's shared memory once)."
           + (f" One core's memcpy bandwidth, measured in the same run: {mc:.2f} GB/s "
              f"(range {tp['memcpy_gbps_range'][0]:.2f}–{tp['memcpy_gbps_range'][1]:.2f})." if mc else ""), "",
           "| path | record | subscribers | p50 ms | p99 ms | p99 ≤ 1 ms | GB/s per subscriber | GB/s delivered (all) "
           "| share of memcpy (all) | daemon CPU s/GB | complete |",
           "|---|--:|--:|--:|--:|---|--:|--:|--:|--:|---|"]
    for row in tp["summary"]:
        out.append(
            f"| {row.get('path', 'frames')} | {transport.size_label(row['size'])} | {row['subscribers']} "
            f"| {_f(row['p50_ms'], '.3f')} | {_f(row['p99_ms'], '.3f')} "
            f"| {_ok(row['p99_target'])} | {_f(row['gbps_per_sub'], '.3f')} | {_f(row['gbps_total'], '.3f')} "
            f"| {_f(row.get('share_total', float('nan')), '.0%')} | {_f(row.get('daemon_cpu_s_per_gb', float('nan')), '.2f')} "
            f"| {'yes' if row['complete'] else '**no**'} |")
    out.append("")
    ps = tp.get("path_summary") or []
    if ps:
        out += ["Arena against frames, ratios within each repeat (same load), medians:", "",
                "| record | subscribers | GB/s delivered × | daemon CPU s/GB × | p99 × |", "|--:|--:|--:|--:|--:|"]
        out += [f"| {transport.size_label(r['size'])} | {r['subscribers']} | {_f(r['gbps_ratio'], '.2f')} "
                f"| {_f(r['cpu_per_gb_ratio'], '.2f')} | {_f(r['p99_ratio'], '.2f')} |" for r in ps]
        out.append("")
    for key, pp in (tp.get("per_poll") or {}).items():
        out.append(
            f"- daemon poll {float(key) * 1e3:g} ms: daemon CPU while one capture trickles in at 100 records/s "
            f"{100 * pp['trickle_cpu']:.1f}% of a core (the price of polling: one 0.5 ms sleep costs "
            f"{pp.get('cpu_per_sleep_us', float('nan')):.0f} µs of CPU on this machine); wake-up floor (a thread sleeping "
            f"0.5 ms wakes this late) p50 {pp['oversleep_p50_ms']:.3f} ms, p99 {pp['oversleep_p99_ms']:.3f} ms; "
            f"filling a fresh daemon's retention ran at {pp['warmup_gbps']:.2f} GB/s.")
    out.append("")
    out.append(f"Before each round's trials the daemon's retention ({p['retain_bytes'] >> 20} MiB) is filled once, so "
               "its copies land in memory it reuses, as in a daemon that has been up a while (a fresh daemon's first "
               "retain-bytes of data go to newly faulted pages, at the rate above). Every record needs at least three "
               "wake-ups on its way (daemon, its zmq I/O thread, the subscriber), so the wake-up floor bounds the p99.")
    out.append("")
    out += _watch_md(tp)
    return out


def _watch_md(tp: dict[str, Any]) -> list[str]:
    """Watch against one subscription per capture, from the same run as the table above."""
    rows = tp.get("watch_summary") or []
    if not rows:
        return []
    out = ["### Watch: every capture through one watch, against one subscription per capture", "",
           "The writer writes captures one after another (BEGIN, 4 records, END) as fast as the ring allows; each "
           "consumer process receives every capture whole, through one `Client.watch` (whole mode) or through one "
           "`fetch` per capture name (the per-request API). Per consumer, from the first commit to its last capture; "
           "daemon with the default poll interval. The writer's own rate (one Python process) bounds both.", "",
           "| capture | consumers | via | captures/s per consumer | GB/s per consumer | GB/s delivered (all) "
           "| writer alone, captures/s | complete |",
           "|--:|--:|---|--:|--:|--:|--:|---|"]
    for row in rows:
        out.append(f"| {transport.size_label(row['capture_bytes'])} | {row['consumers']} | {row['mode']} "
                   f"| {_f(row['captures_per_s'], '.0f')} | {_f(row['gbps'], '.3f')} | {_f(row['gbps_total'], '.3f')} "
                   f"| {_f(row['writer_captures_per_s'], '.0f')} | {'yes' if row['complete'] else '**no**'} |")
    out.append("")
    return out


def _host_calls(row: dict[str, Any]) -> int:
    from vllm_tap.tools.bench import hook_host

    return hook_host.TARGET_CALLS[row["spec"]]


def markdown(results: dict[str, Any], title: str = "vllm-tap benchmark") -> str:
    lines = [f"# {title}", ""] + _machine(results) + [""]
    ts = targets(results)
    if ts:
        lines += ["## Targets", "", "| part | target | measured | |", "|---|---|---|---|"]
        lines += [f"| {t['part']} | {t['target']} | {t['measured']} | {_ok(t['met'])} |" for t in ts]
        lines.append("")
    if results.get("serving"):
        lines += serving_md(results["serving"])
    if results.get("hook"):
        lines += hook_md(results["hook"])
    if results.get("hook_host"):
        from vllm_tap.tools.bench import hook_host

        lines += hook_host.table(results["hook_host"])
    if results.get("transport"):
        lines += transport_md(results["transport"])
    if results.get("ingest"):
        from vllm_tap.tools.bench import ingest

        lines += ["## Ingest: a GPU worker's steps into the daemon", "", ingest.table(results["ingest"]), ""]
    if results.get("reducer"):
        from vllm_tap.tools.bench import reducer

        lines += reducer.table(results["reducer"])
    notes = results.get("notes")
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


# -- plots --


def plots(results: dict[str, Any], outdir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    sv = results.get("serving")
    if sv:
        metrics = [("tok_s", "output tok/s"), ("ttft_p50_ms", "TTFT p50"), ("itl_p50_ms", "ITL p50"), ("itl_p99_ms", "ITL p99")]
        for pt in sv["points"]:
            s = pt["summary"]
            cs = [c for c in pt["configs"] if c in s and c != "a"]
            if not cs:
                continue
            fig, ax = plt.subplots(figsize=(8, 4))
            w = 0.8 / len(metrics)
            for k, (m, label) in enumerate(metrics):
                vals = [s[c]["ratio_to_a"][m]["median"] for c in cs]
                ax.bar([i + k * w for i in range(len(cs))], vals, w, label=label)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_yscale("log")
            ax.set_xticks([i + w * (len(metrics) - 1) / 2 for i in range(len(cs))])
            ax.set_xticklabels([f"({c}) {serving.CONFIGS[c]}" for c in cs], fontsize=7, rotation=10)
            ax.set_ylabel("ratio to (a), median over repeats")
            ax.set_title(f"Serving, vocab {pt['vocab']}: ratio to plugin not enabled")
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = os.path.join(outdir, f"serving_v{pt['vocab']}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
        for pt in sv["points"]:
            path = _cpu_plot(plt, pt, outdir)
            if path:
                written.append(path)
    hk = results.get("hook")
    if hk:
        rows = [r for r in hk["summary"] if r["captured_bytes"]]
        if rows:
            fig, ax = plt.subplots(figsize=(8, 4))
            labels = [f"{r['scenario']}\nV={r['vocab']}" for r in rows]
            xs = range(len(rows))
            ax.bar([x - 0.2 for x in xs], [r["hook_cpu_us"] for r in rows], 0.4, label="hook (CPU time)")
            ax.bar([x + 0.2 for x in xs], [r["memcpy_cpu_us"] for r in rows], 0.4, label="memcpy of the same bytes")
            ax.scatter(list(xs), [r["limit_cpu_us"] for r in rows], marker="_", s=400, color="r", label=f"target {_limit_words(hk)}", zorder=3)
            ax.set_yscale("log")
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, fontsize=7)
            ax.set_ylabel("µs per step")
            ax.set_title("Hook time per step against memcpy")
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = os.path.join(outdir, "hook_cost.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    tp = results.get("transport")
    if tp:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
        for path in tp["params"].get("paths", ["frames"]):
            for nsub in tp["params"]["subscribers"]:
                rows = [r for r in tp["summary"] if r["subscribers"] == nsub and r.get("path", "frames") == path]
                sizes = [r["size"] / 1024 for r in rows]
                tag = f"{nsub} sub, {path}"
                a1.plot(sizes, [r["p99_ms"] for r in rows], "o-", label=f"p99, {tag}")
                a2.plot(sizes, [r["gbps_per_sub"] for r in rows], "o-", label=tag)
        a1.axhline(transport.P99_TARGET_MS, color="r", lw=0.8, label="p99 target")
        if tp.get("memcpy_gbps"):
            a2.axhline(tp["memcpy_gbps"] * transport.SHARE_1_TARGET, color="r", lw=0.8, label="50% of memcpy")
        for a in (a1, a2):
            a.set_xscale("log", base=2)
            a.set_yscale("log")
            a.set_xlabel("record size (KiB)")
            a.legend(fontsize=7)
        a1.set_ylabel("commit → subscriber array (ms)")
        a2.set_ylabel("GB/s")
        a1.set_title("Transport latency")
        a2.set_title("Sustained throughput")
        fig.tight_layout()
        path = os.path.join(outdir, "transport.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    hh = results.get("hook_host")
    if hh:
        from vllm_tap.tools.bench import hook_host

        path = hook_host.plot(plt, hh, outdir)
        if path:
            written.append(path)
    ig = results.get("ingest")
    if ig:
        path = _ingest_plot(plt, ig, outdir)
        if path:
            written.append(path)
    rd = results.get("reducer")
    if rd:
        from vllm_tap.tools.bench import reducer

        path = reducer.plot(plt, rd, outdir)
        if path:
            written.append(path)
    return written


def _ingest_plot(plt: Any, ig: dict[str, Any], outdir: str) -> str | None:
    """Each repeat's rate against its target: full logits as a share of the tmpfs copy, top-k in steps/s."""
    from vllm_tap.tools.bench import ingest

    n = ig["params"]["requests"]
    main = [t for t in ig["trials"] if t.get("requests", n) == n]
    shapes = [s for s in ingest.SHAPES if any(t["shape"] == s for t in main)]
    if not shapes:
        return None
    fit = ig.get("captures_fit")
    fig, axes = plt.subplots(1, len(shapes) + bool(fit), figsize=(5 * (len(shapes) + bool(fit)), 4), squeeze=False)
    if fit:
        ax = axes[0][-1]
        topk = [t for t in ig["trials"] if t["shape"] == "topk"]
        ax.scatter([t["requests"] for t in topk], [t["daemon_cpu_s_per_kstep"] * 1e3 for t in topk], label="trials")
        xs = [0, max(fit["captures"])]
        ax.plot(xs, [fit["us_per_step"] + fit["us_per_capture"] * x for x in xs], "r-", lw=0.8,
                label=f"{fit['us_per_step']:.0f} µs + {fit['us_per_capture']:.2f} µs a capture")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("captures a step")
        ax.set_ylabel("daemon CPU µs a step")
        ax.set_title(f"top-{ig['params']['topk']}: the daemon's cost against a step's rows")
        ax.legend(fontsize=8)
    for ax, shape in zip(axes[0], shapes):
        ts = [t for t in main if t["shape"] == shape]
        xs = range(len(ts))
        if shape != "topk":
            ax.bar(list(xs), [100 * t["share_of_copy"] for t in ts], 0.6, label="daemon ingest")
            ax.axhline(100 * ingest.TARGET_COPY_SHARE, color="r", lw=0.8, label="target")
            ax.set_ylabel("% of the tmpfs copy rate")
            ax.set_title(f"Full logits, {n} decoding requests" + ("" if shape == "logits" else ",\nthe writer's copy left to DMA"))
        else:
            ax.bar(list(xs), [t["steps_per_s"] for t in ts], 0.6, label="daemon ingest")
            ax.axhline(ingest.TARGET_TOPK_STEPS, color="r", lw=0.8, label="target")
            ax.set_ylabel("steps/s")
            ax.set_title(f"{n} × top-{ig['params']['topk']}")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"repeat {t['repeat']}" for t in ts], fontsize=8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(outdir, "ingest.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cpu_plot(plt: Any, pt: dict[str, Any], outdir: str) -> str | None:
    """Stacked bars: CPU ms per request by process, per configuration (medians), ranges of the
    total as error bars."""
    s = pt["summary"]
    cs = [c for c in pt["configs"] if c in s and "cpu_ms_per_request" in s[c]]
    if not cs:
        return None
    parts = ["api", "engine", "workers", "daemon", "subscriber"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(cs)
    for part in parts:
        vals = [s[c]["cpu_ms_per_request"].get(part, {}).get("median", 0.0) for c in cs]
        vals = [0.0 if v is None or math.isnan(v) else v for v in vals]
        if not any(vals):
            continue
        ax.bar(range(len(cs)), vals, 0.6, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    lo = [s[c]["cpu_ms_per_request"]["total"]["range"][0] for c in cs]
    hi = [s[c]["cpu_ms_per_request"]["total"]["range"][1] for c in cs]
    med = [s[c]["cpu_ms_per_request"]["total"]["median"] for c in cs]
    ax.errorbar(range(len(cs)), med, yerr=[[m - l for m, l in zip(med, lo)], [h - m for m, h in zip(med, hi)]],
                fmt="none", ecolor="k", capsize=4, lw=0.8)
    ax.set_xticks(range(len(cs)))
    ax.set_xticklabels([f"({c}) {serving.CONFIGS[c]}" for c in cs], fontsize=7, rotation=12)
    ax.set_ylabel("CPU ms per request (median)")
    ax.set_title(f"Serving, vocab {pt['vocab']}: CPU per request by process (bars: range of the total)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(outdir, f"serving_cpu_v{pt['vocab']}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(results: dict[str, Any], outdir: str, latest: str | None = None) -> dict[str, str]:
    """results.md, results.json and the PNGs into outdir; the markdown also to `latest` if given."""
    import json

    os.makedirs(outdir, exist_ok=True)
    md = markdown(results)
    paths = {"md": os.path.join(outdir, "results.md"), "json": os.path.join(outdir, "results.json")}
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1, default=_json_default)
    try:
        pngs = plots(results, outdir)
    except ImportError:
        pngs = []
        md += "\n(PNG plots skipped: matplotlib is not installed; `pip install matplotlib`.)\n"
    if pngs:
        md += "\n" + "\n".join(f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs) + "\n"
    with open(paths["md"], "w") as f:
        f.write(md)
    if latest:
        with open(latest, "w") as f:
            f.write(markdown(results, "vllm-tap benchmark (latest full run)"))
        paths["latest"] = latest
    for i, p in enumerate(pngs):
        paths[f"png{i}"] = p
    return paths


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)

