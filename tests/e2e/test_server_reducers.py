"""Reducers in a live OpenAI server: probes and SAE encoders declared in the tap's settings, run on the
worker inside the step, delivered as `capture.reduced[name]`.

One daemon and one vLLM server (tiny float32 Llama, hidden 128) for the module, with a reducer of
every kind: a linear and an MLP probe, SAELens SAEs (standard, jumprelu in threshold mode, top-k) and
a sparsify SAE of random weights, and two SAEs trained by SAELens inside the test (when .venv-sae is
there) on the model's own layer-2 activations. The same request captures the layers the reducers
read, so every output is checked against a numpy float32 reference computed from the hidden states
that request captured (≤ 1e-4; top-k ids equal except ties), and the trained SAEs against SAELens's
own `encode` of those rows. The policy names a reducer too. Bad names are HTTP 400; bad files stop
start-up with one line (servers of their own, which must exit before any engine starts).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import numpy as np
import pytest

import reducer_reference as ref
from reference import hf_forward, tiny_model
from server_stack import ServerStack
from vllm_tap.client import Client, Latents
from vllm_tap.tools.launch import ServerHandle, cpu_server_args, free_port, tap_server_args
from vllm_tap.tools.tiny_model import TinyLlamaSpec, prompt_text

pytestmark = pytest.mark.vllm

SPEC = TinyLlamaSpec()
H = SPEC.hidden_size
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAE_PY = os.path.join(REPO, ".venv-sae", "bin", "python")
SAE_SCRIPT = os.path.join(REPO, "tests", "support", "saelens_reducer.py")
RANDOM = ("tox", "topics", "sae", "jump", "topk", "eleuther")


def _ids(n: int, salt: int) -> list[int]:
    return [(salt * 37 + 11 * i) % (SPEC.vocab_size - 3) + 3 for i in range(n)]


def _saelens_ok() -> bool:
    if not os.path.exists(SAE_PY):
        return False
    return subprocess.run([SAE_PY, "-c", "import sae_lens"], capture_output=True, timeout=300).returncode == 0


@pytest.fixture(scope="module")
def files():
    d = tempfile.mkdtemp(prefix="vt-reducers-")
    refs = {
        "tox": ref.linear_probe(f"{d}/tox.safetensors", H, 3),
        "topics": ref.mlp_probe(f"{d}/topics.safetensors", H, (32, 5), activation="tanh"),
        "sae": ref.saelens_sae(f"{d}/sae", H, 1024, "standard"),
        "jump": ref.saelens_sae(f"{d}/jump", H, 512, "jumprelu", seed=1),
        "topk": ref.saelens_sae(f"{d}/topk", H, 512, "topk", seed=2, k=8),
        "eleuther": ref.sparsify_sae(f"{d}/eleuther", H, 512, 6, seed=3),
    }
    settings = {
        "tox": {"kind": "linear", "layer": 2, "path": f"{d}/tox.safetensors"},
        "topics": {"kind": "mlp", "layer": 3, "path": f"{d}/topics.safetensors", "activation": "tanh"},
        "sae": {"kind": "saelens", "layer": 2, "path": f"{d}/sae", "k": 16},
        "jump": {"kind": "saelens", "layer": 3, "path": f"{d}/jump", "threshold": 1.5, "k": 48},
        "topk": {"kind": "saelens", "layer": 1, "path": f"{d}/topk"},
        "eleuther": {"kind": "sparsify", "layer": 4, "path": f"{d}/eleuther"},
    }
    trained = None
    if _saelens_ok():
        # The model's own layer-2 rows (transformers' forward of the checkpoint the server loads).
        rows = np.concatenate([hf_forward(tiny_model(SPEC), _ids(64, s))[1][2] for s in range(6)]).astype(np.float32)
        np.save(f"{d}/acts.npy", rows)
        trained = {}
        for arch in ("standard", "topk"):
            r = subprocess.run([SAE_PY, SAE_SCRIPT, "train", f"{d}/acts.npy", f"{d}/trained_{arch}", arch],
                               capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stderr[-2000:]
            trained[arch] = json.loads(r.stdout.strip().splitlines()[-1])
        settings["trained_standard"] = {"kind": "saelens", "layer": 2, "path": f"{d}/trained_standard", "k": 24}
        settings["trained_topk"] = {"kind": "saelens", "layer": 2, "path": f"{d}/trained_topk"}
    yield {"dir": d, "refs": refs, "settings": settings, "trained": trained}
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(files):
    with ServerStack("reducers", eager=True, max_num_batched_tokens=64, max_tokens=8, reducers=files["settings"],
                     policy={"share": 1.0, "reducers": ["tox"]}) as s:
        yield s


def _check_reduced(files, cap, names) -> None:
    """Every reducer's output of a capture against the reference from the same capture's layer rows."""
    settings = files["settings"]
    for name in names:
        s = settings[name]
        x = cap.hidden[s["layer"]]
        assert x.dtype == np.float32 and len(x) == len(cap.positions)
        got = cap.reduced[name]
        reference = files["refs"][name]
        if s["kind"] in ("linear", "mlp"):
            assert isinstance(got, np.ndarray) and got.dtype == np.float32
            np.testing.assert_allclose(got, ref.probe_scores(reference, x), rtol=0, atol=1e-4, err_msg=name)
        else:
            assert isinstance(got, Latents) and got.ids.dtype == np.int32 and got.values.dtype == np.float32
            k = s.get("k") or reference.get("k") or reference["cfg"]["k"]
            ref.assert_latents_match(got.ids, got.values, ref.sae_activations(reference, x), k, s.get("threshold", 0.0))


def test_probe_scores_and_sae_latents_equal_a_reference_from_the_same_capture(stack, files):
    """Three requests at once (one in prefill chunks beside the others' decode steps), each asking
    every reducer and the layers they read: fetch, subscribe and watch all give the outputs, equal to
    the reference of the rows the request captured."""
    lengths = (5, 90, 23)
    keys = [f"red-{uuid.uuid4().hex[:8]}" for _ in lengths]
    xargs = {"tap_reducers": list(RANDOM), "tap_layers": [1, 2, 3, 4]}
    streamed: dict[str, list] = {}
    watched: dict[str, object] = {}
    watcher = Client(stack.daemon.endpoint)
    watch = watcher.watch(since=None, tap_key_prefix="red-", whole=True)

    def subscribe(key):
        with Client(stack.daemon.endpoint) as c:
            streamed[key] = list(c.subscribe(key, timeout=120))

    def watch_them():
        for item in watch:
            if getattr(item, "capture", None) is not None and item.begin.tap_key in keys:
                watched[item.begin.tap_key] = item.capture
            if len(watched) == len(keys):
                return

    subs = [threading.Thread(target=subscribe, args=(k,)) for k in keys] + [threading.Thread(target=watch_them)]
    for t in subs:
        t.start()
    deadline = time.monotonic() + 60
    while watch.accepted is None and time.monotonic() < deadline:  # the watch runs before the requests
        time.sleep(0.05)
    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(stack.complete, prompt_text(_ids(n, i)), {**xargs, "tap_key": k})
                for i, (n, k) in enumerate(zip(lengths, keys))]
        responses = [f.result() for f in futs]
    for t in subs:
        t.join(150)
    watch.close()
    watcher.close()
    for n, key, r in zip(lengths, keys, responses):
        cap = stack.client.fetch(key, timeout=30)
        assert cap.complete and len(cap.positions) == n + 8 - 1, (key, cap.missing_positions)
        assert cap.logits is None and cap.topk_ids is None, "with reducers, logits default to none"
        assert sorted(cap.reduced) == sorted(RANDOM)
        _check_reduced(files, cap, RANDOM)
        assert (cap.reduced["jump"].ids == -1).any(), "threshold mode: fewer latents than 48 are above 1.5"
        assert (cap.reduced["jump"].ids >= 0).any()
        for c in (watched[key],):
            assert sorted(c.reduced) == sorted(RANDOM)
            for name in RANDOM:
                a, b = cap.reduced[name], c.reduced[name]
                if isinstance(a, Latents):
                    np.testing.assert_array_equal(a.ids, b.ids)
                    np.testing.assert_array_equal(a.values, b.values)
                else:
                    np.testing.assert_array_equal(a, b)
        records = streamed[key]
        assert [x.position for x in records] == cap.positions.tolist(), "every position once, streamed"
        for j, rec in enumerate(records):
            np.testing.assert_array_equal(rec.reduced["tox"], cap.reduced["tox"][j])
            np.testing.assert_array_equal(rec.reduced["sae"].ids, cap.reduced["sae"].ids[j])


def test_an_sae_trained_by_saelens_outputs_what_saelens_encode_gives(stack, files):
    if files["trained"] is None:
        pytest.skip(f"sae-lens venv not found or broken at {SAE_PY} (./run install creates it)")
    assert np.mean(files["trained"]["standard"]["losses"][-5:]) < np.mean(files["trained"]["standard"]["losses"][:5])
    assert files["trained"]["topk"]["cfg"]["architecture"] == "topk"
    r = stack.complete(prompt_text(_ids(40, 7)), {"tap_reducers": ["trained_standard", "trained_topk"], "tap_layers": [2]})
    cap = stack.client.fetch(r.id, timeout=30)
    assert cap.complete
    x_path, out = os.path.join(files["dir"], "x.npy"), os.path.join(files["dir"], "enc.npy")
    np.save(x_path, cap.hidden[2])
    for name, k in (("trained_standard", 24), ("trained_topk", files["trained"]["topk"]["cfg"]["k"])):
        run = subprocess.run([SAE_PY, SAE_SCRIPT, "encode", files["settings"][name]["path"], x_path, out],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        encoded = np.load(out)
        got = cap.reduced[name]
        ref.assert_latents_match(got.ids, got.values, encoded, k)
        assert (got.ids >= 0).sum() > 0, name


def test_the_policy_names_reducers_for_requests_that_send_nothing(stack, files):
    """share 1 with reducers ["tox"]: a plain request is captured with only the probe's scores, equal
    to the reference of the same prompt's layer-2 rows (another request capturing them)."""
    prompt = prompt_text(_ids(12, 3))
    plain = stack.complete(prompt, None)
    cap = stack.client.fetch(plain.id, timeout=30)
    assert cap.complete and cap.source == "policy"
    assert list(cap.reduced) == ["tox"] and cap.logits is None and not cap.hidden
    with_rows = stack.client.fetch(stack.complete(prompt, {"tap_reducers": ["tox"], "tap_layers": [2]}).id, timeout=30)
    assert with_rows.positions.tolist() == cap.positions.tolist()
    np.testing.assert_allclose(cap.reduced["tox"], ref.probe_scores(files["refs"]["tox"], with_rows.hidden[2]),
                               rtol=0, atol=1e-4)


def test_unknown_reducers_are_http_400_naming_them(stack):
    for value, words in ((["tox", "nope"], "tap_reducers: unknown reducer 'nope'; this server declares 'tox'"),
                         ("tox", "tap_reducers: expected a non-empty list of reducer names")):
        status, body = stack.post({"prompt": "w5 w6", "vllm_xargs": {"tap_reducers": value}})
        assert status == 400 and body["error"]["message"].startswith(words), body
    status, _ = stack.post({"prompt": "w5 w6", "vllm_xargs": {"tap_reducers": ["tox"]}})
    assert status == 200


def _start_failure(reducers: dict) -> tuple[int, list[str]]:
    tmp = tempfile.mkdtemp(prefix="vt-fail-")
    try:
        log = os.path.join(tmp, "server.log")
        server = ServerHandle(tiny_model(SPEC), free_port(), log,
                              cpu_server_args(eager=True) + tap_server_args(f"/dev/shm/vt-red-fail-{os.getpid()}", "x",
                                                                            reducers=reducers))
        with pytest.raises(RuntimeError):
            server.start(timeout=300)
        with open(log) as f:
            return server.proc.returncode, f.read().splitlines()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(f"/dev/shm/vt-red-fail-{os.getpid()}", ignore_errors=True)
        shutil.rmtree(f"/dev/shm/vt-red-fail-{os.getpid()}.arena", ignore_errors=True)


def test_bad_reducer_files_and_layers_stop_start_up_with_one_line(files, tmp_path):
    """A missing file, an SAE for another model (its d_in), a layer the model lacks: the server exits
    before any engine starts, its last line naming the setting."""
    other = ref.saelens_sae(str(tmp_path / "other"), 64, 128)
    assert other["cfg"]["d_in"] == 64
    cases = (
        ({"p": {"kind": "linear", "layer": 2, "path": str(tmp_path / "none.safetensors")}},
         "error: vllm-tap: vllm_tap.reducers.p.path: ", "no such file"),
        ({"s": {"kind": "saelens", "layer": 2, "path": str(tmp_path / "other"), "k": 4}},
         "error: vllm-tap: vllm_tap.reducers.s.path: ", f"d_in 64 does not match the model's hidden size {H}"),
        ({"p": {"kind": "linear", "layer": SPEC.num_layers + 1, "path": files["settings"]["tox"]["path"]}},
         "error: vllm-tap: vllm_tap.reducers.p.layer: ", f"0..{SPEC.num_layers}"),
    )
    for reducers, start, words in cases:
        code, lines = _start_failure(reducers)
        assert code != 0 and lines[-1].startswith(start) and words in lines[-1], lines[-3:]
        text = "\n".join(lines)
        assert "Traceback" not in text and "EngineCore" not in text, "failed before any engine started"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
