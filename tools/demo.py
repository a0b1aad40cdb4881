"""The main job, end to end: `python -m vllm_tap.tools.demo` (or `./run demo`).

1. makes a tiny random Llama (float32) in a cache directory, so no model hub is needed;
2. starts `vllm-tap daemon` on a private shm directory and ipc socket, then the vLLM OpenAI
   server with the tap enabled (`--additional-config '{"vllm_tap": {...}}'`);
3. sends three requests with the `openai` SDK: a completion that a subscriber, started before the
   request, follows token by token; a chat completion; a two-prompt completion;
4. checks every capture against what vLLM itself returned (log_softmax of the captured logits vs
   the returned logprobs, token ids, number of positions) and the first one against a
   transformers forward pass (logits and every hidden layer);
5. stops the server and the daemon and removes its temporary directories.

Exits 0 when every check passes, else 1 with a one-line reason (2 for bad arguments).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_tap.client import Capture, Client, Gap, TapError
from vllm_tap.tools.launch import DaemonHandle, ServerHandle, cpu_server_args, free_port, tap_server_args
from vllm_tap.tools.tiny_model import TinyLlamaSpec, make_tiny_llama, prompt_text

SPEC = TinyLlamaSpec()  # 4 decoder layers, hidden size 128, vocabulary 512, float32
LAYERS = list(range(SPEC.num_layers + 1))  # 0 = embeddings, i = output of decoder layer i
TOL = 1e-4  # float32 on CPU agrees to ~1e-6; anything near this bound is a real mismatch
INSTANCE = "demo"


class DemoFailed(Exception):
    """A check failed or a step could not run; the message is the one line the user sees."""


def say(msg: str = "") -> None:
    print(msg, flush=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def token_id(tok: str) -> int:
    """vLLM's `return_tokens_as_token_ids` spelling of a token: 'token_id:123'."""
    return int(tok.rsplit(":", 1)[1])


# -- start-up --


def model_dir() -> str:
    base = os.environ.get("VLLM_TAP_DEMO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-tap")
    return os.path.join(base, f"tiny-llama-v{SPEC.vocab_size}-h{SPEC.hidden_size}-l{SPEC.num_layers}-s{SPEC.seed}")


def last_log_line(path: str) -> str:
    """The newest line of the server's log, without vLLM's 'INFO date [file.py:123]' prefix."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            # INFO lines only: warnings and their continuation lines say little about progress.
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if " INFO " in ln]
    except OSError:
        return ""
    if not lines:
        return ""
    m = re.search(r"\[[\w./-]+\.py:\d+\] (.*)", lines[-1])
    return " ".join((m.group(1) if m else lines[-1]).split())[:90]


def start_server(server: ServerHandle) -> None:
    """server.start() in a thread, with a progress line every few seconds (it takes 30-60 s)."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            server.start(timeout=420)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            err.append(e)

    t0 = time.monotonic()
    t = threading.Thread(target=run, name="start-vllm", daemon=True)
    t.start()
    while t.is_alive():
        t.join(5.0)
        if t.is_alive():
            hint = last_log_line(server.log_path)
            say(f"  ... waiting for vLLM to be healthy: {time.monotonic() - t0:4.0f} s" + (f"  [{hint}]" if hint else ""))
    if err:
        first = str(err[0]).strip().splitlines()[0] if str(err[0]).strip() else type(err[0]).__name__
        raise DemoFailed(f"the vLLM server did not start: {first} (log: {server.log_path})")
    say(f"  vLLM is up after {time.monotonic() - t0:.0f} s at {server.base_url}")


# -- the streaming subscriber --


@dataclass
class Streamed:
    """What the subscriber thread received for one capture."""

    positions: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    hidden: dict[int, list[np.ndarray]] = field(default_factory=dict)
    gaps: list[Gap] = field(default_factory=list)
    end: Any = None
    error: BaseException | None = None

    def capture(self) -> Capture:
        """The streamed records stacked like a fetched Capture, so both go through the same checks."""
        e = self.end
        return Capture(
            e.request_id, e.instance, e.response_id, e.choice_index, e.num_prompt_tokens, None,
            np.asarray(self.positions, np.int32), np.asarray(self.token_ids, np.int32),
            np.stack(self.logits) if self.logits else None,
            {layer: np.stack(rows) for layer, rows in self.hidden.items()},
            None, None, None, e.reason, e.num_output_tokens, list(e.output_token_ids), e.missing_positions,
            e.expected, e.source, e.end_position,
        )


def follow(client: Client, name: str, out: Streamed, ready: threading.Event) -> None:
    """Print one line per token as the capture streams in."""
    try:
        sub = client.subscribe(name, timeout=120)
        ready.set()
        for item in sub:
            if item.missing:
                out.gaps.append(item)
                say(f"    [{name}] positions {item.positions.start}..{item.positions.stop - 1} MISSING ({item.reason})")
                continue
            rec = item
            out.positions.append(rec.position)
            out.token_ids.append(rec.token_id)
            line = f"    [{name}] pos {rec.position:3d} {rec.phase:<6} token {rec.token_id:3d}"
            if rec.logits is not None:
                out.logits.append(rec.logits)
                p = np.exp(log_softmax(rec.logits))
                top = int(p.argmax())
                line += f" | next: top-1 {top:3d} (p={p[top]:.2f})"
            for layer, h in sorted(rec.hidden.items()):
                out.hidden.setdefault(layer, []).append(h)
            if rec.hidden:
                line += " | |h| " + " ".join(f"{layer}:{np.linalg.norm(h):6.2f}" for layer, h in sorted(rec.hidden.items()))
            say(line)
        out.end = sub.end
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        out.error = e
    finally:
        ready.set()


# -- checks --


@dataclass
class Row:
    """One line of the summary table."""

    request: str
    found_by: str
    positions: str
    tokens_ok: bool
    count_ok: bool
    lp_sampled: float
    lp_top: float
    layers: str
    missing: int
    finish: str

    @property
    def ok(self) -> bool:
        return (self.tokens_ok and self.count_ok and self.lp_sampled <= TOL and self.lp_top <= TOL
                and self.missing == 0 and self.finish == "length")


def check_capture(request: str, found_by: str, cap: Capture, prompt_ids: list[int], gen_ids: list[int],
                  returned: list[tuple[int, float, dict[int, float]]], first: int) -> Row:
    """Compare one capture with vLLM's own answer.

    `returned[k]` is what vLLM reported for generated token k: (token id, logprob, top logprobs).
    `first` is the first position the capture should start at (0, or P-1 for tap_positions=output).
    Positions run to P+G-2: the last generated token is never fed through the model.
    """
    P, G = len(prompt_ids), len(gen_ids)
    seq = prompt_ids + gen_ids
    expected = list(range(first, P + G - 1))
    positions = cap.positions.tolist()
    count_ok = positions == expected
    tokens_ok = count_ok and cap.token_ids.tolist() == seq[first : P + G - 1] and cap.output_token_ids == gen_ids
    tokens_ok = tokens_ok and [t for t, _, _ in returned] == gen_ids
    lp_sampled = lp_top = float("inf")
    if count_ok and cap.logits is not None:
        rows = [P - 1 + k - first for k in range(G)]  # the positions whose logits predict generated token k
        lsm = log_softmax(cap.logits[rows])
        lp_sampled = max(abs(lsm[k, t] - lp) for k, (t, lp, _) in enumerate(returned))
        lp_top = max(abs(lsm[k, tid] - lp) for k, (_, _, top) in enumerate(returned) for tid, lp in top.items())
        if [int(a) for a in cap.logits[rows].argmax(-1)] != gen_ids:  # greedy: argmax is what was sampled
            tokens_ok = False
    layers = ",".join(str(layer) for layer in sorted(cap.hidden)) or "-"
    span = f"{positions[0]}..{positions[-1]} ({len(positions)})" if positions else "none"
    return Row(request, found_by, span, tokens_ok, count_ok, lp_sampled, lp_top, layers, len(cap.missing_positions),
               cap.finish_reason)


def completion_returned(choice: Any) -> list[tuple[int, float, dict[int, float]]]:
    lp = choice.logprobs
    return [(token_id(t), float(v), {token_id(k): float(x) for k, x in top.items()})
            for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)]


def chat_returned(choice: Any) -> list[tuple[int, float, dict[int, float]]]:
    return [(token_id(c.token), float(c.logprob), {token_id(t.token): float(t.logprob) for t in c.top_logprobs})
            for c in choice.logprobs.content]


def check_against_transformers(path: str, cap: Capture) -> tuple[float, float]:
    """Max |diff| of the captured logits and hidden states vs an fp32 transformers forward.

    transformers' hidden_states[i] is vllm-tap's layer i for i < n; its last entry has the final
    norm applied, while vllm-tap's layer n is the last decoder layer's output before it.
    """
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    seen: dict[str, torch.Tensor] = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, i, o: seen.__setitem__("last", o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            out = model(torch.tensor([cap.token_ids.tolist()]), output_hidden_states=True)
    finally:
        hook.remove()
    n = model.config.num_hidden_layers
    ref = {i: out.hidden_states[i][0].numpy() for i in range(n)}
    ref[n] = seen["last"][0].numpy()
    d_logits = float(np.abs(cap.logits - out.logits[0].numpy()).max())
    d_hidden = max(float(np.abs(cap.hidden[layer] - ref[layer]).max()) for layer in cap.hidden)
    return d_logits, d_hidden


# -- the job --


def run_demo(compiled: bool, keep: bool) -> int:
    t_start = time.monotonic()
    say("== vllm-tap demo: raw logits and hidden states out of a running vLLM ==")
    path = model_dir()
    say(f"[1/5] tiny Llama (random weights, float32, {SPEC.num_layers} layers, vocab {SPEC.vocab_size}) in {path}")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the demo's output readable
    make_tiny_llama(path, SPEC)

    shm_dir = tempfile.mkdtemp(prefix="vllm-tap-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    work = tempfile.mkdtemp(prefix="vllm-tap-demo-")
    endpoint = f"ipc://{work}/tap.sock"
    daemon = DaemonHandle(shm_dir, endpoint, os.path.join(work, "daemon.log"))
    server_args = cpu_server_args(eager=not compiled) + tap_server_args(shm_dir, instance=INSTANCE) + ["--max-logprobs", "-1"]
    server = ServerHandle(path, free_port(), os.path.join(work, "server.log"), server_args)
    ok = False
    try:
        say(f"[2/5] vllm-tap daemon: rings under {shm_dir}, subscribers on {endpoint}")
        try:
            daemon.start()
        except (RuntimeError, TapError) as e:
            raise DemoFailed(f"the daemon did not start: {str(e).strip().splitlines()[0]} (log: {daemon.log_path})") from None
        mode = "compiled (torch.compile, slower start)" if compiled else "eager (--enforce-eager: faster start; the tap works compiled too, try --compiled)"
        say(f"[3/5] vLLM OpenAI server with the tap, {mode}:")
        say("  " + shlex.join(["python", "-m", "vllm.entrypoints.openai.api_server", "--model", path,
                               "--port", str(server.port), *server_args]))
        say(f"  (log: {server.log_path})")
        start_server(server)

        rows = run_requests(server, endpoint, path)
        status = Client(endpoint).status()
        say()
        say("[5/5] summary")
        print_table(rows)
        drops = status["drops"]
        say(f"daemon: {status['records_in']} records ({status['bytes_in'] / 1e6:.2f} MB) read from "
            f"{len(status['rings'])} rings; dropped {drops['records']} records, {drops['missing_positions']} positions missing")
        bad = [r for r in rows if not r.ok]
        if bad:
            r = bad[0]
            raise DemoFailed(f"check failed for {r.request} ({r.found_by}): positions {r.positions}, tokens ok {r.tokens_ok}, "
                             f"logprob diff {r.lp_sampled:.2g}/{r.lp_top:.2g}, missing {r.missing}, finish {r.finish}")
        if drops["records"]:
            raise DemoFailed(f"the daemon reports {drops['records']} dropped records")
        ok = True
    finally:
        say("stopping the vLLM server and the daemon ...")
        server.stop()
        daemon.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(shm_dir.rstrip("/") + ".arena", ignore_errors=True)  # the daemon's arena, kept for a next run
        if ok and not keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"logs kept in {work}")
    say(f"PASS: every capture matches what vLLM returned (tolerance {TOL:g}); {time.monotonic() - t_start:.0f} s in all")
    return 0


def run_requests(server: ServerHandle, endpoint: str, path: str) -> list[Row]:
    import openai

    api = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    client = Client(endpoint)
    common = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    rows: list[Row] = []

    # (a) A completion followed live by a subscriber that was there first.
    say()
    say("[4/5] requests")
    say("(a) completion, vllm_xargs {tap: 1, tap_key: 'demo-1'}, logprobs=20, max_tokens=8;")
    say("    a subscriber to 'demo-1' is waiting before the request is sent; it prints each position as it arrives:")
    streamed = Streamed()
    ready = threading.Event()
    sub_thread = threading.Thread(target=follow, args=(client, "demo-1", streamed, ready), name="subscriber", daemon=True)
    sub_thread.start()
    ready.wait(10)
    time.sleep(0.2)  # let the subscription reach the daemon (it would replay from position 0 anyway)
    prompt_ids = [(7 * i) % 500 + 3 for i in range(10)]
    r1 = api.completions.create(
        model=path, prompt=prompt_text(prompt_ids), max_tokens=8, temperature=0.0, logprobs=20,
        extra_body={"vllm_xargs": {"tap": 1, "tap_key": "demo-1"}, **common},
    )
    sub_thread.join(60)
    if sub_thread.is_alive():
        raise DemoFailed("the subscriber to 'demo-1' did not see the capture end within 60 s")
    if streamed.error is not None:
        raise DemoFailed(f"subscriber to 'demo-1': {type(streamed.error).__name__}: {streamed.error}")
    c1 = r1.choices[0]
    cap1 = streamed.capture()
    say(f"    response {r1.id}: {len(c1.prompt_token_ids)} prompt + {len(c1.token_ids)} generated tokens, "
        f"finish_reason={c1.finish_reason}; capture end reason={cap1.finish_reason}")
    rows.append(check_capture("(a) completion", "tap_key 'demo-1' (streamed)", cap1, list(c1.prompt_token_ids),
                              list(c1.token_ids), completion_returned(c1), 0))
    d_logits, d_hidden = check_against_transformers(path, cap1)
    say(f"    vs transformers fp32 forward: max|logits diff| {d_logits:.1e}, max|hidden diff| {d_hidden:.1e} "
        f"over layers {sorted(cap1.hidden)}")
    if not (d_logits <= TOL and d_hidden <= TOL):
        raise DemoFailed(f"capture of 'demo-1' differs from transformers: logits {d_logits:.2g}, hidden {d_hidden:.2g}")

    # (b) A chat completion, fetched afterwards by its response id, then by its X-Request-Id.
    say("(b) chat completion with header X-Request-Id: demo-chat, vllm_xargs {tap: 1, tap_layers: [0, 4]}, "
        "top_logprobs=5; fetched after it finished:")
    r2 = api.chat.completions.create(
        model=path, messages=[{"role": "user", "content": prompt_text([11, 12, 13, 14, 15])}], max_tokens=6,
        temperature=0.0, logprobs=True, top_logprobs=5, extra_headers={"X-Request-Id": "demo-chat"},
        extra_body={"vllm_xargs": {"tap": 1, "tap_layers": [0, SPEC.num_layers]}, **common},
    )
    c2 = r2.choices[0]
    cap2 = client.fetch(r2.id, timeout=30)
    again = client.fetch("demo-chat", timeout=30)
    say(f"    fetch({r2.id!r}) and fetch('demo-chat') -> the same capture: {again.request_id == cap2.request_id} "
        f"(internal id {cap2.request_id}); logits {cap2.logits.shape}, hidden layers {sorted(cap2.hidden)}")
    if again.request_id != cap2.request_id:
        raise DemoFailed(f"fetch('demo-chat') found {again.request_id}, fetch({r2.id!r}) found {cap2.request_id}")
    rows.append(check_capture("(b) chat", f"response id {r2.id}", cap2, list(r2.prompt_token_ids), list(c2.token_ids),
                              chat_returned(c2), 0))

    # (c) One request, two prompts: one capture per choice, told apart by the choice index.
    say("(c) completion of two prompts, vllm_xargs {tap: 1, tap_positions: 'output', tap_layers: 'none'}, logprobs=5:")
    prompts = [[20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36]]
    r3 = api.completions.create(
        model=path, prompt=[prompt_text(p) for p in prompts], max_tokens=5, temperature=0.0, logprobs=5,
        extra_body={"vllm_xargs": {"tap": 1, "tap_positions": "output", "tap_layers": "none"}, **common},
    )
    for c in sorted(r3.choices, key=lambda c: c.index):
        cap = client.fetch(r3.id, index=c.index, timeout=30)
        P = len(c.prompt_token_ids)
        say(f"    fetch({r3.id!r}, index={c.index}): positions {cap.positions.tolist()} (P-1 = {P - 1} onwards), "
            f"logits {cap.logits.shape}")
        rows.append(check_capture(f"(c) prompt {c.index}", f"response id, index={c.index}", cap, list(c.prompt_token_ids),
                                  list(c.token_ids), completion_returned(c), P - 1))
    return rows


def print_table(rows: list[Row]) -> None:
    head = ["request", "found by", "positions (count)", "tokens", "count", "max|dlogprob| sampled", "top-k",
            "layers", "missing", "finish", "result"]
    body = [[r.request, r.found_by, r.positions, "ok" if r.tokens_ok else "BAD", "ok" if r.count_ok else "BAD",
             f"{r.lp_sampled:.1e}", f"{r.lp_top:.1e}", r.layers, str(r.missing), r.finish, "PASS" if r.ok else "FAIL"]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    for i, line in enumerate([head, *body]):
        say("  " + "  ".join(x.ljust(w) for x, w in zip(line, widths)))
        if i == 0:
            say("  " + "  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_tap.tools.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--compiled", action="store_true", help="run vLLM compiled instead of --enforce-eager (slower start)")
    ap.add_argument("--keep", action="store_true", help="keep the logs directory")
    args = ap.parse_args(argv)
    try:
        return run_demo(args.compiled, args.keep)
    except DemoFailed as e:
        print(f"FAIL: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("FAIL: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - one line instead of a traceback
        msg = " ".join(str(e).split())[:300]
        print(f"FAIL: {type(e).__name__}: {msg}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
