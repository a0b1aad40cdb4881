"""Reducers (probes and SAE encoders) inside the capture core, at the ring level with torch alone:
their files read and refused as start-up does, their outputs read back from the ring equal a numpy
float32 reference computed from the very rows of the step (≤ 1e-4; ids equal except near ties),
whether the step is the steady one or the general one, whichever publisher, whatever else the record
carries; one tensor-parallel rank computes them; and a steady step with an SAE is a few more torch
calls, the same for every batch size, none waiting for the device.

tests/e2e/test_server_reducers.py runs them in a real server.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch

import reducer_reference as ref
from test_hook_ops import SYNCING, OpLog
from test_step_capture import LAYERS, Step, finish, make_core, read
from vllm_tap.hooks import reducer_files
from vllm_tap.hooks.capture_core import RankPlace
from vllm_tap.hooks.publisher import FIXED_BLOCKS, HostBackend, StagedPublisher
from vllm_tap.hooks.reducer_ops import DeviceReducer
from vllm_tap.hooks.settings import SPEC_EXTRA_ARG, TapConfigError
from vllm_tap.reducers import ReducerDecl, parse_reducers
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import CaptureSpec, LogitsMode, PositionsMode

HIDDEN = 32  # test_step_capture's hidden size
D_SAE = 256


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every kind of reducer file, and its numpy reference."""
    d = tmp_path_factory.mktemp("reducers")
    out = {
        "lin": (ReducerDecl("lin", "linear", 2, str(d / "lin.safetensors")), ref.linear_probe(str(d / "lin.safetensors"), HIDDEN, 3)),
        "torchlin": (ReducerDecl("torchlin", "linear", 5, str(d / "tl.safetensors")),
                     ref.linear_probe(str(d / "tl.safetensors"), HIDDEN, 2, seed=1, torch_layout=True)),
        "mlp": (ReducerDecl("mlp", "mlp", 5, str(d / "mlp.safetensors"), activation="tanh"),
                ref.mlp_probe(str(d / "mlp.safetensors"), HIDDEN, (16, 8, 4), activation="tanh")),
        "std": (ReducerDecl("std", "saelens", 2, str(d / "std"), k=12),
                ref.saelens_sae(str(d / "std"), HIDDEN, D_SAE, "standard")),
        "jump": (ReducerDecl("jump", "saelens", 5, str(d / "jump"), k=10),
                 ref.saelens_sae(str(d / "jump"), HIDDEN, D_SAE, "jumprelu", seed=2)),
        "topk": (ReducerDecl("topk", "saelens", 2, str(d / "topk")),
                 ref.saelens_sae(str(d / "topk"), HIDDEN, D_SAE, "topk", seed=3, k=6)),
        "above": (ReducerDecl("above", "saelens", 2, str(d / "std"), k=64, threshold=1.5), None),
        "sparse": (ReducerDecl("sparse", "sparsify", 5, str(d / "sparse"), k=4),
                   ref.sparsify_sae(str(d / "sparse"), HIDDEN, D_SAE, 5, seed=4)),
    }
    out["above"] = (out["above"][0], out["std"][1])
    return out


def _reducers(files, names, max_rows=4096):
    return {n: DeviceReducer(reducer_files.load(files[n][0], HIDDEN), "cpu", max_rows) for n in names}


def _check(files, name, got_rid, rows_of, decl_k=None):
    """The reducer's output in a request's records against the reference at its rows' positions."""
    decl, reference = files[name]
    slot = rows_of["slots"][name]
    positions = sorted(rows_of["x"])
    x = np.stack([rows_of["x"][p] for p in positions])
    if decl.kind in ("linear", "mlp"):
        got = np.stack([got_rid[f"probe.{slot}"][p] for p in positions])
        np.testing.assert_allclose(got, ref.probe_scores(reference, x), rtol=0, atol=1e-4)
        return
    ids = np.stack([got_rid[f"latent_ids.{slot}"][p] for p in positions])
    values = np.stack([got_rid[f"latent_values.{slot}"][p] for p in positions])
    k = decl.k or reference["cfg"]["k"]
    ref.assert_latents_match(ids, values, ref.sae_activations(reference, x), k, decl.threshold)


def test_every_kind_of_file_loads_with_its_width(files):
    widths = {"lin": 3, "torchlin": 2, "mlp": 4, "std": 12, "jump": 10, "topk": 6, "above": 64, "sparse": 4}
    for name, (decl, _) in files.items():
        described = reducer_files.describe(decl, HIDDEN)
        loaded = reducer_files.load(decl, HIDDEN)
        assert described.width == loaded.width == widths[name], name
        assert not described.layers and loaded.layers, "describe reads no tensor data"


def _refused(decl, hidden=HIDDEN) -> str:
    with pytest.raises(TapConfigError) as e:
        reducer_files.describe(decl, hidden)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"vllm-tap: vllm_tap.reducers.{decl.name}."), msg
    return msg


def test_bad_files_are_refused_in_one_line_naming_the_setting(files, tmp_path):
    lin = files["lin"][0]
    assert "no such file" in _refused(ReducerDecl("a", "linear", 1, str(tmp_path / "missing.safetensors")))
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    assert "not a readable safetensors file" in _refused(ReducerDecl("a", "linear", 1, str(tmp_path / "junk.safetensors")))
    # A probe for another model: its W has the wrong number of rows.
    msg = _refused(lin, hidden=64)
    assert "W has shape [32, 3], expected [64, ?]" in msg
    ref.mlp_probe(str(tmp_path / "mlp.safetensors"), HIDDEN, (8, 2))
    import safetensors.torch as st
    t = st.load_file(str(tmp_path / "mlp.safetensors"))
    t["b2"] = torch.zeros(3)
    st.save_file(t, str(tmp_path / "mlp.safetensors"))
    assert "b2 has shape [3], expected [2]" in _refused(ReducerDecl("m", "mlp", 1, str(tmp_path / "mlp.safetensors")))
    # SAEs: not a directory, no cfg.json, malformed cfg.json, d_in, architecture, normalisation, k.
    sae = tmp_path / "sae"
    ref.saelens_sae(str(sae), HIDDEN, 64)
    assert "no such directory" in _refused(ReducerDecl("s", "saelens", 1, str(tmp_path / "nope"), k=4))
    assert "d_in 32 does not match the model's hidden size 48" in _refused(ReducerDecl("s", "saelens", 1, str(sae), k=4), 48)
    assert "set vllm_tap.reducers.s.k" in _refused(ReducerDecl("s", "saelens", 1, str(sae)))
    assert "more than the SAE's 64 latents" in _refused(ReducerDecl("s", "saelens", 1, str(sae), k=65))
    cfg = (sae / "cfg.json").read_text()
    for broken, why in ((cfg.replace('"standard"', '"gated"'), "architecture 'gated' is not supported"),
                        (cfg.replace('"normalize_activations": "none"', '"normalize_activations": "layer_norm"'),
                         "normalize_activations 'layer_norm' is not supported"),
                        ("{", "not a JSON object")):
        (sae / "cfg.json").write_text(broken)
        assert why in _refused(ReducerDecl("s", "saelens", 1, str(sae), k=4))
    (sae / "cfg.json").write_text(cfg)
    os.remove(sae / "sae_weights.safetensors")
    assert "sae_weights.safetensors: no such file" in _refused(ReducerDecl("s", "saelens", 1, str(sae), k=4))
    assert "k 7 is more than the 6 latents this top-k SAE activates" in _refused(
        ReducerDecl("t", "saelens", 1, files["topk"][0].path, k=7))


def test_settings_are_checked_before_any_file(files):
    """What the settings say is checked as the settings are read (API process), naming the key."""
    from vllm_tap.reducers import ReducerSettingError

    ok = {"p": {"kind": "linear", "layer": 2, "path": "/x.safetensors"}}
    assert parse_reducers(ok, "vllm_tap.reducers", 4)[0] == ReducerDecl("p", "linear", 2, "/x.safetensors")
    for raw, key in (({"p": {"kind": "lin", "layer": 2, "path": "/x"}}, "vllm_tap.reducers.p.kind"),
                     ({"p": {"kind": "linear", "layer": 9, "path": "/x"}}, "vllm_tap.reducers.p.layer"),
                     ({"p": {"kind": "linear", "layer": 1, "path": "x"}}, "vllm_tap.reducers.p.path"),
                     ({"p": {"kind": "linear", "layer": 1, "path": "/x", "k": 3}}, "vllm_tap.reducers.p"),
                     ({"p": {"kind": "saelens", "layer": 1, "path": "/x", "k": 0}}, "vllm_tap.reducers.p.k"),
                     ({"p": {"kind": "saelens", "layer": 1, "path": "/x", "threshold": -1}}, "vllm_tap.reducers.p.threshold"),
                     ({"a.b": {"kind": "linear", "layer": 1, "path": "/x"}}, "vllm_tap.reducers")):
        with pytest.raises(ReducerSettingError) as e:
            parse_reducers(raw, "vllm_tap.reducers", 4)
        assert str(e.value).startswith(key + ":"), e.value


class _Rows:
    """The aux rows a request's positions had (what its reducers read)."""

    def __init__(self):
        self.by = collections.defaultdict(lambda: collections.defaultdict(dict))

    def add(self, st: Step, rid: str, layer: int):
        i = st.req_ids.index(rid)
        c, r0, r1 = int(st.computed[i]), int(st.qsl[i]), int(st.qsl[i + 1])
        a, b = st.specs[i].live_range(int(st.prompt[i]))
        for row in range(r0, r1):
            p = c + row - r0
            if a <= p < b:
                self.by[(rid, layer)][p] = st.aux[LAYERS.index(layer)][row].float().numpy()  # as the reducer converts them


def _run_steps(files, names, spec, staged, n=4, steps=4, prefill_first=True, bf16=False):
    """A prefill chunk step (general path), then decode steps (steady): the reducers' outputs per
    request against the reference over every captured position."""
    import tempfile
    shm = tempfile.mkdtemp(prefix="vt-red-", dir="/dev/shm")
    writer = RingWriter(f"{shm}/i/rank-00000.ring", 8 << 20, wake_daemon=False)
    reducers = _reducers(files, names)
    core = make_core(writer, staged=staged, reducers=reducers,
                     model_dtype=torch.bfloat16 if bf16 else torch.float32)
    rows = _Rows()
    specs = [spec] * n
    try:
        computed = [0] * n if prefill_first else [7] * n
        sched = [5] * n if prefill_first else [1] * n
        got_all = collections.defaultdict(lambda: collections.defaultdict(dict))
        for k in range(steps):
            st = Step(specs, sched, computed, [5] * n, seed=k)
            if bf16:
                st.aux = [a.bfloat16() for a in st.aux]
            if k == 0:
                st.learn(core)
            core.capture(st.view(row_of={rid: i for i, rid in enumerate(st.req_ids)}))
            finish(core)
            for rid in st.req_ids:
                for name in names:
                    rows.add(st, rid, files[name][0].layer)
            computed = [c + s for c, s in zip(computed, sched)]
            sched = [1] * n
            got, _, drops, _ = read(writer.path)
            assert not drops
            for rid, tensors in got.items():
                for t, by_pos in tensors.items():
                    got_all[rid][t].update(by_pos)
        steady = core.steady_steps
    finally:
        core.close()
        writer.close(unlink=True)
        os.rmdir(os.path.dirname(writer.path))
        os.rmdir(shm)
    slots = {name: i for i, name in enumerate(spec.reducers)}
    for rid in got_all:
        for name in names:
            layer = files[name][0].layer
            _check(files, name, got_all[rid], {"slots": slots, "x": rows.by[(rid, layer)]})
    return got_all, steady


@pytest.mark.parametrize("staged", [False, True], ids=["cpu-publisher", "staged-publisher"])
@pytest.mark.parametrize("names", [("lin", "mlp", "torchlin"), ("std", "jump", "topk", "above", "sparse")],
                         ids=["probes", "saes"])
def test_reducers_outputs_equal_the_reference_on_the_general_and_the_steady_path(files, staged, names):
    spec = CaptureSpec(logits=LogitsMode.NONE, layers=(), reducers=tuple(sorted(names)))
    got, steady = _run_steps(files, names, spec, staged)
    assert steady == 3, "the decode steps are steady"
    assert set(got) == {"r0", "r1", "r2", "r3"}
    for rid in got:
        assert sorted(got[rid]["token"]) == list(range(8)), "the prompt chunk and three decode steps"


@pytest.mark.parametrize("staged", [False, True], ids=["cpu-publisher", "staged-publisher"])
def test_a_reducer_beside_the_layers_and_logits_it_reads(files, staged):
    """With the reducer's layer captured too (in float32: the reducer reads the record's rows) and
    logits, in one record per step; and from bfloat16 layers (converted for the reducer)."""
    spec = CaptureSpec(logits=LogitsMode.TOPK, topk=3, layers=LAYERS, reducers=("jump", "lin"))
    got, steady = _run_steps(files, ("jump", "lin"), spec, staged)
    assert steady == 3
    assert {"hidden.2", "hidden.5", "topk_ids", "probe.1", "latent_ids.0", "latent_values.0"} <= set(got["r0"])
    spec = CaptureSpec(logits=LogitsMode.NONE, layers=(2,), reducers=("jump", "std"))
    _run_steps(files, ("jump", "std"), spec, staged, bf16=True)


def test_threshold_mode_pads_with_minus_one_and_zero(files):
    """'Every latent above 1.5, at most 64': fewer than 64 are, so each row ends in -1 slots."""
    spec = CaptureSpec(logits=LogitsMode.NONE, layers=(), reducers=("above",))
    got, _ = _run_steps(files, ("above",), spec, staged=False, steps=2)
    ids = np.stack(list(got["r0"]["latent_ids.0"].values()))
    values = np.stack(list(got["r0"]["latent_values.0"].values()))
    assert (ids == -1).any(axis=1).all() and (ids >= 0).any(), "some latents above, never 64 of 256"
    assert (values[ids == -1] == 0).all() and (values[ids >= 0] > 1.5).all()


def test_more_rows_than_a_pass_holds_are_done_in_passes(files, ring):
    """A reducer's buffers hold `rows` rows; a prefill chunk of more is done pass by pass."""
    writer = ring(8 << 20)
    reducers = _reducers(files, ("std", "lin"), max_rows=3)
    assert reducers["std"].rows == 3
    spec = CaptureSpec(logits=LogitsMode.NONE, layers=(), reducers=("lin", "std"))
    st = Step([spec, spec], [7, 1], [0, 4], [7, 5])
    core = st.learn(make_core(writer, reducers=reducers))
    try:
        core.capture(st.view())
        got, _, drops, _ = read(writer.path)
    finally:
        core.close()
    assert not drops
    rows = _Rows()
    for rid in st.req_ids:
        rows.add(st, rid, 2)
    for rid in st.req_ids:
        for name in ("lin", "std"):
            _check(files, name, got[rid], {"slots": {"lin": 0, "std": 1}, "x": rows.by[(rid, 2)]})


def test_one_tensor_parallel_rank_computes_it(files, ring):
    """Rank 0 of the stage writes the reducer's output and counts it; rank 1 (its hidden states are
    the same) writes none; both count rank 0 among the contributors."""
    writer = ring()
    spec = CaptureSpec(logits=LogitsMode.NONE, layers=(), reducers=("lin",))
    layers = {"lin": 2}
    r0 = make_core(writer, place=RankPlace(0, 2, stage_layers=(LAYERS,)), reducers=_reducers(files, ("lin",)),
                   reducer_layers=layers)
    r1 = make_core(writer, place=RankPlace(1, 2, stage_layers=(LAYERS,)), reducer_layers=layers)
    try:
        assert [p.what for p in r0.parts(spec)] == ["probe"] and r1.parts(spec) == ()
        assert r0.contributors(spec) == r1.contributors(spec) == 1
        both = CaptureSpec(logits=LogitsMode.NONE, layers=(5,), reducers=("lin",))
        assert r0.contributors(both) == r1.contributors(both) == 2
    finally:
        r0.close()
        r1.close()


def test_a_steady_step_with_an_sae_is_a_few_more_calls_whatever_the_batch(files, shm):
    """bf16 layers, token ids on the "device", the staged publisher: an SAE (top-10 of 256, jumprelu)
    adds the same calls at 8, 32 and 128 requests, none waiting for the device."""
    spec = CaptureSpec(logits=LogitsMode.NONE, layers=(2,), reducers=("jump",), positions=PositionsMode.ALL)
    base = CaptureSpec(logits=LogitsMode.NONE, layers=(2,))
    counts = {}
    for n in (8, 32, 128):
        for s in (base, spec):
            counts[(n, s is spec)] = _steady_ops(files, shm, n, s)
    for n in (8, 32, 128):
        assert counts[(n, True)] == counts[(8, True)], counts
        assert not {op for op in counts[(n, True)] if op in SYNCING}
    extra = sum(counts[(8, True)].values()) - sum(counts[(8, False)].values())
    # gather + conversion of the rows, addmm, gt, mul_, topk, le, two masked_fill_, the ids' copy
    assert extra <= 10, (counts[(8, True)] - counts[(8, False)])


def _steady_ops(files, shm, n, spec) -> collections.Counter:
    writer = RingWriter(f"{shm}/ops-{n}-{len(spec.reducers)}/rank-00000.ring", 8 << 20, wake_daemon=False)
    pub = StagedPublisher(writer, HostBackend(), 2 << 20)
    from vllm_tap.hooks.capture_core import CaptureCore, StepView

    core = CaptureCore(writer, RankPlace(stage_layers=(LAYERS,)), pub, model_dtype=torch.bfloat16,
                       reducers=_reducers(files, ("jump",)) if spec.reducers else {})
    rids = [f"r{i}" for i in range(n)]
    for rid in rids:
        core.learn(rid, {SPEC_EXTRA_ARG: spec.to_meta()}, 10)
    g = torch.Generator().manual_seed(n)
    aux = [torch.randn(n, HIDDEN, generator=g).bfloat16() for _ in LAYERS]
    ids = torch.randint(0, 50, (n,), dtype=torch.int32, generator=g)
    qsl = np.arange(n + 1, dtype=np.int32)
    computed = np.full(n, 20, np.int32)
    reader = RingReader(writer.path)
    last = None
    try:
        for k in range(FIXED_BLOCKS + 3):
            view = StepView(rids, qsl, computed, ids, aux[0], aux, None, lambda h: h,
                            row_of={r: i for i, r in enumerate(rids)})
            with OpLog() as log:
                core.capture(view)
            last = log.ops
            pub.drain()
            reader.poll()
            computed += 1
    finally:
        reader.close()
        core.close()
        writer.close(unlink=True)
    assert core.steady_steps >= FIXED_BLOCKS
    return collections.Counter(last)
