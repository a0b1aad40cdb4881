"""Datasets from a live vLLM server: the hook, the daemon, `vllm-tap record` and the readers.

One eager OpenAI server with the tap (tiny float32 Llama) and one daemon. The server's capture
policy captures all traffic (share 1.0: full logits and three layers at every position, tap_key
"traffic"); most requests carry no tap options and are captured by the policy, two opt in with
their own `vllm_xargs` (the policy lets a request's options win), so the dataset holds both
sources. The recorder writes them to a directory, and what is read back is compared with the
daemon's own fetch of the same requests (by response id), with vLLM's returned logprobs (through
the distillation export), with the SAELens export, and with a live shuffled iterator reading the
daemon directly.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reference import log_softmax
from server_stack import ServerStack
from vllm_tap import dataset_format as df
from vllm_tap.client import Client
from vllm_tap.client.datasets import activation_batches, open_dataset
from vllm_tap.tools.tiny_model import TinyLlamaSpec, prompt_text

pytestmark = pytest.mark.vllm

SPEC = TinyLlamaSpec()
LAYERS = [0, 2, SPEC.num_layers]
POLICY = {"share": 1.0, "layers": LAYERS, "logits": "full", "positions": "all", "key": "traffic"}


def _ids(n: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % (SPEC.vocab_size - 3) + 3 for i in range(n)]


def _token_id(s: str) -> int:
    return int(s.strip()[1:])


@pytest.fixture(scope="module")
def stack():
    with ServerStack("rec", eager=True, server_args=["--max-logprobs", "-1"], policy=POLICY) as s:
        yield s.model, s.daemon, s.openai, s.tmp


def _complete(api, model, prompt_ids, key: str | None, **kw):
    """A completion; key=None: no tap options (the policy captures it), else the request's own."""
    body = {"ignore_eos": True}
    if key is not None:
        body["vllm_xargs"] = {"tap": 1, "tap_layers": LAYERS, "tap_key": key}
    return api.completions.create(model=model, prompt=prompt_text(prompt_ids), temperature=0.0, max_tokens=6,
                                  logprobs=5, extra_body=body, **kw)


def test_recorded_traffic_equals_fetch_logprobs_and_exports(stack, tmp_path) -> None:
    model, daemon, api, tmp = stack
    dest = str(tmp_path / "ds")
    log = open(tmp_path / "rec.log", "wb")
    rec = subprocess.Popen([sys.executable, "-m", "vllm_tap.cli", "record", dest, "--endpoint", daemon.endpoint,
                            "--writer", "node1", "--quiet", "--shard-age", "1s", "--shard-size", "200KB"],
                           stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(dest, "writers/node1/manifest.json")):
        assert rec.poll() is None and time.monotonic() < deadline, open(tmp_path / "rec.log").read()
        time.sleep(0.1)

    # a live iterator reading the daemon directly (online training: no files)
    live_rows: list[np.ndarray] = []
    it = activation_batches(daemon.endpoint, 2, 4, shuffle_buffer=8, seed=0)

    def consume() -> None:
        for b in it:
            live_rows.extend(b)
            if len(live_rows) >= 40:
                return

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(1.0)  # the live watch attaches before the requests

    lengths = (5, 23, 40, 9, 17, 31)
    # None: no tap options, captured by the server's policy; a key: the request opts in itself
    keys = [None, "own-1", None, None, "own-4", None]
    with cf.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda a: _complete(api, model, _ids(a[1], a[0]), keys[a[0]]), enumerate(lengths)))

    client = Client(daemon.endpoint)
    caps = {r.id: client.fetch(r.id, timeout=60) for r in responses}  # by response id (policy captures share a key)
    deadline = time.monotonic() + 60
    while True:
        m = df.decode_manifest(open(os.path.join(dest, "writers/node1/manifest.json"), "rb").read())
        st = client.status()
        if m.committed_seq >= st["sequence"]["next"] - 1 and not st["requests_in_flight"]:
            break
        assert time.monotonic() < deadline, "the recorder did not commit the requests"
        time.sleep(0.2)
    rec.send_signal(signal.SIGTERM)
    assert rec.wait(60) == 0, open(tmp_path / "rec.log").read()

    # A top-k capture (after the recorder, whose dataset holds full logits): with the logsumexp the
    # hook sends beside it, topk_values - logsumexp are vLLM's own returned top-5 logprobs.
    n = 12
    r = api.completions.create(model=model, prompt=prompt_text(_ids(n, 7)), temperature=0.0, max_tokens=6, logprobs=5,
                               extra_body={"ignore_eos": True, "vllm_xargs": {
                                   "tap": 1, "tap_logits": "topk", "tap_topk": 5, "tap_layers": "none",
                                   "tap_positions": "output", "tap_key": "rec-topk"}})
    topk = client.fetch("rec-topk", timeout=60)
    assert topk.logsumexp is not None and topk.logsumexp.shape == (len(topk.positions),)
    at = {p: j for j, p in enumerate(topk.positions.tolist())}
    for k, top in enumerate(r.choices[0].logprobs.top_logprobs):
        j = at[n - 1 + k]  # the position whose logits chose output token k
        got = dict(zip(topk.topk_ids[j].tolist(), (topk.topk_values[j] - topk.logsumexp[j]).tolist()))
        want = {_token_id(w): v for w, v in top.items()}
        assert set(got) == set(want)
        for tok, v in want.items():
            assert abs(got[tok] - v) <= 1e-5, (k, tok)

    ds = open_dataset(dest)
    assert ds.verify() == [] and ds.gaps == [] and ds.lost == []
    assert sorted(ds.layout.layers, key=df.layer_of) == [df.hook_name(l) for l in LAYERS]
    t = ds.to_pyarrow().to_table()
    for (i, n), key, r in zip(enumerate(lengths), keys, responses):
        cap = caps[r.id]
        part = t.filter(pa.compute.equal(t.column("request_id"), cap.request_id))
        part = part.take(pa.compute.sort_indices(part, [("position", "ascending")]))
        assert part.column("position").to_numpy().tolist() == cap.positions.tolist() == list(range(n + 5))
        assert part.column("token_id").to_numpy().tolist() == cap.token_ids.tolist()
        assert set(part.column("source").to_pylist()) == ({"policy"} if key is None else {"client"})
        assert set(part.column("tap_key").to_pylist()) == {"traffic" if key is None else key}
        assert set(part.column("model").to_pylist()) == {model}
        assert np.array_equal(np.stack(part.column("logits").to_numpy(zero_copy_only=False)), cap.logits)
        for layer in LAYERS:
            got = np.stack(part.column(df.hook_name(layer)).to_numpy(zero_copy_only=False))
            assert np.array_equal(got, cap.hidden[layer]), (key, layer)
        gen = [_token_id(x) for x in r.choices[0].logprobs.tokens]
        full = _ids(n, i) + gen
        assert part.column("next_token_id").to_numpy().tolist() == full[1:]
        lse = part.column("logsumexp").to_numpy()
        np.testing.assert_allclose(cap.logits - lse[:, None], log_softmax(cap.logits), atol=1e-5)
    assert t.num_rows == sum(len(c.positions) for c in caps.values())
    hf = ds.to_hf(cache_dir=str(tmp_path / "hf"), columns=["tap_key", "position", df.hook_name(2)])
    assert hf.num_rows == t.num_rows

    # distillation export: its targets are vLLM's own top-5 logprobs at the output positions
    from vllm_tap.client.datasets.export import export_distill, export_saelens

    export_distill(ds, str(tmp_path / "kd"), top_k=5)
    kd = {row["request_id"]: row for row in pq.read_table(str(tmp_path / "kd" / "data-00000.parquet")).to_pylist()}
    for (i, n), r in zip(enumerate(lengths), responses):
        row = kd[caps[r.id].request_id]
        lp = r.choices[0].logprobs
        assert row["input_ids"] == _ids(n, i) + [_token_id(x) for x in lp.tokens]
        for k, top in enumerate(lp.top_logprobs):
            j = n - 1 + k  # the position whose logits chose output token k
            assert row["target_mask"][j] == [1] * 5
            got = dict(zip(row["target_token_ids"][j], row["target_logprobs"][j]))
            want = {_token_id(w): v for w, v in top.items()}
            assert set(got) == set(want)
            for tok, v in want.items():
                assert abs(got[tok] - v) <= 1e-5
        assert row["target_mask"][n - 2] == [0] * 5  # a prompt position: labels -100 there

    # SAELens's layout, read back with HF datasets
    import datasets

    export_saelens(ds, str(tmp_path / "sae"), 2, 8)
    sae = datasets.load_from_disk(str(tmp_path / "sae"))
    acts = np.asarray(sae[df.hook_name(2)], np.float32).reshape(-1, SPEC.hidden_size)
    # in the export's order: shard by shard as the manifest lists them, each in (seq, position) order
    # (shards written at once, --parallel-shards, interleave their seqs)
    ordered = pa.concat_tables([pq.read_table(s.rows_path, columns=[df.hook_name(2)]) for s in ds.shards])
    want = np.stack(ordered.column(df.hook_name(2)).to_numpy(zero_copy_only=False))[:len(acts)]
    assert np.array_equal(acts, want)

    # the live iterator saw the same hidden states (layer 2), each at most once
    consumer.join(60)
    assert len(live_rows) >= 40
    every = {bytes(np.ascontiguousarray(h)) for c in caps.values() for h in c.hidden[2]}
    seen = [bytes(np.ascontiguousarray(x)) for x in live_rows]
    assert len(set(seen)) == len(seen) and set(seen) <= every
