"""The dataset format, the recorder's protocol and the readers/exports, without a daemon: captures
come from tests/support/capture_factory.py (deterministic per seq), so every value read back is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from capture_factory import HIDDEN, VOCAB, make_capture
from vllm_tap import dataset_format as df
from vllm_tap.client.datasets import activation_batches, open_dataset
from vllm_tap.client.datasets.recorder import Recorder, RecordOptions
from vllm_tap.client.datasets.recorder_core import AppendRows, RecorderCore, SealShard, WriteManifest
from project_layout import REPO, SUPPORT

SAE_PY = os.path.join(REPO, ".venv-sae", "bin", "python")


def _missing(seq: int) -> tuple[int, ...]:
    return (1, 2) if seq % 7 == 3 else ()


def _cap(seq: int, **kw):
    big = seq == 11  # one capture larger than a shard: it is cut between shards
    return make_capture(seq, missing=_missing(seq), n_prompt=60 if big else None, n_out=20 if big else None, **kw)


def _record(dest: str, seqs, writer: str = "w1", shard_bytes: int = 20_000, **kw) -> Recorder:
    rec = Recorder(dest, RecordOptions(writer=writer, shard_bytes=shard_bytes, **kw)).open()
    for s in seqs:
        b, c = _cap(s)
        rec.feed_capture(s, b, c)
    rec.close()
    return rec


def _check_rows(table: pa.Table, seqs) -> None:
    """Every (seq, position) exactly once, with the values of the capture."""
    keys = list(zip(table.column("seq").to_pylist(), table.column("position").to_pylist()))
    assert len(keys) == len(set(keys)), "a (seq, position) appears twice"
    want = {(s, int(p)) for s in seqs for p in _cap(s)[1].positions}
    assert set(keys) == want
    order = np.lexsort((table.column("position").to_numpy(), table.column("seq").to_numpy()))
    t = table.take(pa.array(order))
    i = 0
    for s in sorted(seqs):
        begin, c = _cap(s)
        n = len(c.positions)
        part = t.slice(i, n)
        i += n
        assert part.column("token_id").to_numpy().tolist() == c.token_ids.tolist()
        for layer, h in c.hidden.items():
            got = np.stack(part.column(df.hook_name(layer)).to_numpy(zero_copy_only=False))
            assert np.array_equal(got, h)
        got = np.stack(part.column("logits").to_numpy(zero_copy_only=False))
        assert np.array_equal(got, c.logits)
        lse = part.column("logsumexp").to_numpy()
        ref = np.log(np.exp(c.logits.astype(np.float64)).sum(1))
        np.testing.assert_allclose(lse, ref, rtol=0, atol=1e-5)
        full = list(begin.prompt_token_ids) + list(c.output_token_ids)
        assert part.column("next_token_id").to_numpy().tolist() == [full[p + 1] for p in c.positions]
        assert set(part.column("phase").to_pylist()) <= {"prompt", "output"}
        assert part.column("source").to_pylist() == ["policy"] * n


# -- names --


def test_hook_names_round_trip() -> None:
    assert df.hook_name(0) == "blocks.0.hook_resid_pre"
    assert df.hook_name(1) == "blocks.0.hook_resid_post"
    assert df.hook_name(16) == "blocks.15.hook_resid_post"
    for layer in range(40):
        assert df.layer_of(df.hook_name(layer)) == layer
    assert df.layer_of("blocks.3.hook_resid_pre") == 3
    with pytest.raises(ValueError):
        df.layer_of("blocks.3.hook_mlp_out")
    with pytest.raises(ValueError):
        df.check_writer_id("../etc")


def test_manifest_refuses_other_versions() -> None:
    m = df.Manifest(df.FORMAT_NAME, df.FORMAT_VERSION, "w", "h", df.PARQUET, df.TensorLayout())
    assert df.decode_manifest(df.encode_manifest(m)).writer == "w"
    bad = json.loads(df.encode_manifest(m))
    bad["format_version"] = 99
    with pytest.raises(df.ManifestError, match="version 99"):
        df.decode_manifest(json.dumps(bad).encode())
    with pytest.raises(df.ManifestError):
        df.decode_manifest(b"{not json")


# -- the protocol, sans I/O: a crash after any action, then a restart --


class _MemStore:
    """What a destination holds: visible shards and the manifest, as the commit protocol makes them."""

    def __init__(self) -> None:
        self.manifest: bytes | None = None
        self.rows: dict[str, pa.Table] = {}
        self.open: dict[int, list[pa.Table]] = {}


def _run_core(store: _MemStore, seqs: list[int], crash_after: int | None, lanes: int = 1) -> bool:
    """Feed seqs > committed into a fresh core (`lanes` shards open at once), carrying out actions on
    `store`; stop dead after `crash_after` effects. True when it ran to the end."""
    m = df.decode_manifest(store.manifest) if store.manifest else None
    # A restart removes files no manifest lists.
    listed = {s.name for s in m.shards} if m else set()
    store.rows = {k: v for k, v in store.rows.items() if k in listed}
    store.open = {}
    core = RecorderCore("w1", m, shard_bytes=20_000, lanes=lanes)
    effects = 0

    def do(actions) -> bool:
        nonlocal effects
        for a in actions:
            if crash_after is not None and effects >= crash_after:
                return False
            effects += 1
            if isinstance(a, AppendRows):
                store.open.setdefault(a.index, []).append(a.table)
            elif isinstance(a, SealShard):
                store.rows[a.name] = pa.concat_tables(store.open.pop(a.index, [])) if a.rows else pa.table({})
                if crash_after is not None and effects >= crash_after:
                    return False  # files visible, manifest not replaced
                mm = core.shard_committed(a, rows_bytes=0, rows_sha256="", captures_bytes=0, captures_sha256="")
                if mm is not None:  # None: other shards of the group are still to be published
                    store.manifest = df.encode_manifest(mm)
                    core.manifest_written(mm)
            elif isinstance(a, WriteManifest):
                store.manifest = df.encode_manifest(a.manifest)
                core.manifest_written(a.manifest)
        return True

    since = core.since
    for s in seqs:
        if since is not None and s <= since:
            continue
        if s in (17, 18):
            ok = do(core.add_lost(s, s, "evicted"))
        else:
            b, c = _cap(s)
            ok = do(core.add_capture(s, b, c))
        if not ok:
            return False
    return do(core.finish()) and do(core.finish_manifest())


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_core_every_row_exactly_once_whatever_the_crash_point(lanes) -> None:
    seqs = list(range(0, 25))
    total = None
    for crash_after in range(0, 80 + 20 * lanes, 3 if lanes == 1 else 1):
        store = _MemStore()
        crashes = 0
        k = crash_after
        while not _run_core(store, seqs, k, lanes):
            crashes += 1
            k = k + 5  # the next run dies a little later, until one gets through
        m = df.decode_manifest(store.manifest)
        table = pa.concat_tables([store.rows[s.name] for s in m.shards if store.rows[s.name].num_rows])
        _check_rows(table, [s for s in seqs if s not in (17, 18)])
        assert [(e.first, e.last) for e in m.lost] == [(17, 17), (18, 18)]
        assert m.committed_seq == 24 and m.resume_seq == -1
        total = table.num_rows
    assert total and total > 100


@pytest.mark.parametrize("lanes", [1, 2])
def test_core_cuts_a_large_capture_and_resumes_inside_it(lanes) -> None:
    core = RecorderCore("w1", None, shard_bytes=6_000, lanes=lanes)
    b, c = _cap(11)
    acts = core.add_capture(11, b, c)
    seals = [a for a in acts if isinstance(a, SealShard)]
    assert len(seals) >= lanes and core.open and core.open[0].rows > 0, "a capture larger than a shard spans several"
    group = [a for a in seals if a.group == seals[0].group]
    assert len(group) == lanes and [a.index for a in group] == list(range(lanes))  # parts in consecutive shards
    for a in group[:-1]:
        assert core.shard_committed(a, rows_bytes=0, rows_sha256="", captures_bytes=0, captures_sha256="") is None
    m = core.shard_committed(group[-1], rows_bytes=0, rows_sha256="", captures_bytes=0, captures_sha256="")
    done = sum(a.rows for a in group)
    assert m.committed_seq == 10 and m.resume_seq == 11 and len(m.shards) == lanes
    assert m.resume_position == int(c.positions[done])
    # after a restart from this manifest, only the rows from resume_position on are written again
    core2 = RecorderCore("w1", df.decode_manifest(df.encode_manifest(m)), shard_bytes=1 << 20, lanes=lanes)
    acts2 = core2.add_capture(11, b, c)
    rows = pa.concat_tables([a.table for a in acts2 if isinstance(a, AppendRows)])
    assert rows.column("position").to_pylist() == [int(p) for p in c.positions[done:]]


def test_core_skips_a_capture_with_another_spec_and_says_why() -> None:
    core = RecorderCore("w1", None)
    b, c = make_capture(0)
    core.add_capture(0, b, c)
    b2, c2 = make_capture(1, layers=(0,))
    assert core.add_capture(1, b2, c2) == []
    acts = core.finish() + core.finish_manifest()
    seal = next(a for a in acts if isinstance(a, SealShard))
    m = core.shard_committed(seal, rows_bytes=0, rows_sha256="", captures_bytes=0, captures_sha256="")
    assert [(e.seq, "blocks.1.hook_resid_post" in e.reason) for e in m.skipped] == [(1, True)]


@pytest.mark.parametrize("tensor_compression", ["lz4", "none", "zstd"])
def test_float_tensor_columns_take_their_own_codec(tmp_path, tensor_compression) -> None:
    """--tensor-compression sets the codec of the float tensor columns only; key columns stay zstd;
    the values read back are the captures' whatever the codec."""
    dest = str(tmp_path / "ds")
    _record(dest, range(6), tensor_compression=tensor_compression)
    ds = open_dataset(dest)
    assert ds.verify() == []
    _check_rows(ds.to_pyarrow().to_table(), range(6))
    md = pq.ParquetFile(os.path.join(dest, "writers/w1/rows", ds.manifests[0].shards[0].name)).metadata
    codecs = {md.row_group(0).column(i).path_in_schema: md.row_group(0).column(i).compression
              for i in range(md.num_columns)}
    want = {"lz4": "LZ4", "none": "UNCOMPRESSED", "zstd": "ZSTD"}[tensor_compression]
    floats = [c for c in codecs if c.endswith(".list.element") and not c.startswith(df.COL_TOPK_IDS)]
    assert floats and all(codecs[c] == want for c in floats), codecs
    assert all(codecs[c] == "ZSTD" for c in codecs if c not in floats), codecs


def test_every_missing_range_keeps_its_reason() -> None:
    """The stream's gap reasons reach the manifest (adjacent ranges with one reason joined); missing
    positions no gap named are listed too, with the "no reason" reason: nothing unaccounted."""
    core = RecorderCore("w1", None, shard_bytes=1 << 20)
    b, c = make_capture(0, missing=(1, 2, 3, 5, 6))
    core.add_capture(0, b, c, [(1, 2, "dropped"), (2, 3, "dropped"), (5, 6, "timeout")])
    acts = core.finish()
    seal = next(a for a in acts if isinstance(a, SealShard))
    assert [(g.start, g.stop, g.reason) for g in seal.gaps] == [
        (1, 3, "dropped"), (3, 4, df.GAP_NO_REASON), (5, 6, "timeout"), (6, 7, df.GAP_NO_REASON)]


# -- the recorder on a directory, and the readers --


def test_recorder_directory_pyarrow_and_hf(tmp_path) -> None:
    dest = str(tmp_path / "ds")
    seqs = list(range(20))
    _record(dest, seqs[:10])
    _record(dest, seqs[10:])  # a second run appends after the committed seq
    ds = open_dataset(dest)
    assert len(ds.shards) > 3
    assert ds.verify() == []
    _check_rows(ds.to_pyarrow().to_table(), seqs)
    gaps = {(g.seq, g.start, g.stop) for g in ds.gaps}
    assert gaps == {(s, 1, 3) for s in seqs if _missing(s)}
    caps = ds.captures().to_table()
    assert sorted(set(caps.column("seq").to_pylist())) == seqs
    # no file outside the manifest is read; a leftover does not show
    pq.write_table(pa.table({"x": [1]}), os.path.join(dest, "writers/w1/rows/w1-999999.parquet"))
    assert open_dataset(dest).num_rows == ds.num_rows
    hf = ds.to_hf(cache_dir=str(tmp_path / "hf"))
    assert hf.num_rows == ds.num_rows
    row = hf[0]
    assert len(row[df.hook_name(2)]) == HIDDEN and len(row["logits"]) == VOCAB
    # the leftover is removed by the next start of that writer
    _record(dest, [])
    assert not os.path.exists(os.path.join(dest, "writers/w1/rows/w1-999999.parquet"))


def _with_reducers(seq: int):
    """A capture with a probe's scores and an SAE's latents (k = 6 slots, some -1: threshold mode)."""
    begin, cap = make_capture(seq, layers=(), logits="none")
    rng = np.random.default_rng(seq)
    T = len(cap.positions)
    from vllm_tap.client.records import Latents

    ids = np.full((T, 6), -1, np.int32)
    values = np.zeros((T, 6), np.float32)
    for t in range(T):
        n = int(rng.integers(0, 7))
        ids[t, :n] = rng.choice(1000, n, replace=False)
        values[t, :n] = np.sort(rng.random(n).astype(np.float32) + 0.5)[::-1]
    cap.reduced = {"tox": rng.standard_normal((T, 3)).astype(np.float32), "sae": Latents(ids, values)}
    begin.spec["reducers"] = ["sae", "tox"]
    return begin, cap


def test_reducer_columns_probe_scores_and_sparse_latents_in_pyarrow_and_hf(tmp_path) -> None:
    """A probe's scores as a fixed-size list column; an SAE's latents as variable-length ids and values
    lists (the -1 slots left out), read back by pyarrow and HF datasets; the manifest says format 2."""
    dest = str(tmp_path / "ds")
    rec = Recorder(dest, RecordOptions(writer="w1", shard_bytes=20_000)).open()
    for s in range(8):
        rec.feed_capture(s, *_with_reducers(s))
    rec.close()
    ds = open_dataset(dest)
    assert ds.layout.reducers == {"tox": df.ReducedLayout("probe", 3), "sae": df.ReducedLayout("latents", 6)}
    assert ds.manifests[0].format_version == 2
    t = ds.to_pyarrow().to_table()
    assert t.schema.field("reduced.tox").type == pa.list_(pa.float32(), 3)
    assert t.schema.field("reduced.sae.ids").type == pa.list_(pa.int32())
    assert t.schema.field("reduced.sae.values").type == pa.list_(pa.float32())
    order = np.lexsort((t.column("position").to_numpy(), t.column("seq").to_numpy()))
    t = t.take(pa.array(order))
    i = 0
    for s in range(8):
        _, cap = _with_reducers(s)
        n = len(cap.positions)
        part = t.slice(i, n)
        i += n
        assert np.array_equal(np.stack(part.column("reduced.tox").to_numpy(zero_copy_only=False)), cap.reduced["tox"])
        lat = cap.reduced["sae"]
        for j, (ids, values) in enumerate(zip(part.column("reduced.sae.ids").to_pylist(),
                                              part.column("reduced.sae.values").to_pylist())):
            keep = lat.ids[j] >= 0
            assert ids == lat.ids[j][keep].tolist() and np.array_equal(np.float32(values), lat.values[j][keep])
    hf = ds.to_hf(cache_dir=str(tmp_path / "hf"))
    assert hf.num_rows == t.num_rows
    lens = [len(r["reduced.sae.ids"]) for r in hf]
    assert 0 in lens and 6 in lens, "rows of every number of active latents"
    assert all(len(r["reduced.tox"]) == 3 for r in hf)
    # A capture without the SAE is skipped, and says why.
    core = RecorderCore("w2", None)
    core.add_capture(1, *_with_reducers(1))
    b, c = _with_reducers(2)
    del c.reduced["sae"]
    core.add_capture(2, b, c)
    assert core.pending_skipped[0].reason.endswith("no reducer sae")
    # Version 1 (no reducers) is still read; another version is refused.
    m = df.Manifest(df.FORMAT_NAME, 1, "w", "h", df.PARQUET, df.TensorLayout())
    assert df.decode_manifest(df.encode_manifest(m)).format_version == 1


def test_arrow_ipc_format_and_two_writers(tmp_path) -> None:
    dest = str(tmp_path / "ds")
    _record(dest, range(0, 6), writer="hostA", file_format="arrow")
    _record(dest, range(0, 4), writer="hostB", file_format="arrow")
    ds = open_dataset(dest)
    t = ds.to_pyarrow().to_table()
    assert sorted(set(t.column("writer").to_pylist())) == ["hostA", "hostB"]
    a = t.filter(pa.compute.equal(t.column("writer"), "hostA"))
    _check_rows(a, range(6))
    assert ds.to_hf(cache_dir=str(tmp_path / "hf")).num_rows == t.num_rows


def test_shuffled_batches_cover_every_row_once_per_epoch(tmp_path) -> None:
    dest = str(tmp_path / "ds")
    _record(dest, range(20))
    ds = open_dataset(dest)
    col = ds.to_pyarrow().to_table(columns=[df.hook_name(2)]).column(0)
    rows = np.stack(col.to_numpy(zero_copy_only=False))
    want = sorted(map(bytes, rows))
    it = activation_batches(dest, 2, 32, shuffle_buffer=100, epochs=2, seed=1)
    got = [b for b in it]
    assert all(b.shape[1] == HIDDEN for b in got)
    flat = np.concatenate(got)
    assert len(flat) == 2 * len(rows)
    first, second = flat[:len(rows)], flat[len(rows):]
    assert sorted(map(bytes, first)) == want and sorted(map(bytes, second)) == want
    assert not np.array_equal(first, rows), "shuffled"
    assert not np.array_equal(first, second), "each epoch in another order"
    torch = pytest.importorskip("torch")
    t = next(iter(activation_batches(dest, "blocks.1.hook_resid_post", 8, torch=True)))
    assert isinstance(t, torch.Tensor) and t.shape == (8, HIDDEN)


# -- exports --


def test_distill_export_alignment_and_exact_logprobs(tmp_path) -> None:
    dest = str(tmp_path / "ds")
    _record(dest, range(8))
    out = str(tmp_path / "kd")
    from vllm_tap.client.datasets.export import export_distill

    res = export_distill(dest, out, top_k=5)
    assert res.rows == 8 and res.info["logprobs"].startswith("exact")
    t = pq.read_table(os.path.join(out, "data-00000.parquet"))
    for r in t.to_pylist():
        begin, c = _cap(r["seq"])
        full = list(begin.prompt_token_ids) + list(c.output_token_ids)
        assert r["input_ids"] == full
        P = c.num_prompt_tokens
        assert r["labels"] == [-100] * P + full[P:]
        lp_ref = c.logits.astype(np.float64) - np.log(np.exp(c.logits.astype(np.float64)).sum(1, keepdims=True))
        row_of = {int(p): i for i, p in enumerate(c.positions)}
        for j in range(len(full)):
            mask = r["target_mask"][j]
            want_on = j in row_of and j + 1 < len(full) and j + 1 >= P
            assert mask == [int(want_on)] * 5, (r["seq"], j)
            if j in row_of and j + 1 < len(full):
                ids = r["target_token_ids"][j]
                assert ids == np.argsort(-c.logits[row_of[j]], kind="stable")[:5].tolist()
                np.testing.assert_allclose(r["target_logprobs"][j], lp_ref[row_of[j], ids], atol=1e-5)


def test_distill_export_from_topk_without_logsumexp_renormalises(tmp_path) -> None:
    dest = str(tmp_path / "ds")
    rec = Recorder(dest, RecordOptions(writer="w1")).open()
    for s in range(3):
        b, c = make_capture(s, logits="topk", topk=4)
        rec.feed_capture(s, b, c)
    rec.close()
    from vllm_tap.client.datasets.export import export_distill

    res = export_distill(dest, str(tmp_path / "kd"))
    assert res.info["top_k"] == 4 and res.info["logprobs"].startswith("renormalised")
    t = pq.read_table(str(tmp_path / "kd" / "data-00000.parquet")).to_pylist()
    for r in t:
        for lp, m in zip(r["target_logprobs"], r["target_mask"]):
            if m[0]:
                assert abs(np.exp(np.asarray(lp, np.float64)).sum() - 1) < 1e-5


def test_topk_captures_with_logsumexp_record_it_and_export_exact_logprobs(tmp_path) -> None:
    """The hook sends each top-k row's logsumexp: the recorder fills the column with it, and the
    distillation export's logprobs are then exact (logit - logsumexp), not renormalised."""
    dest = str(tmp_path / "ds")
    rec = Recorder(dest, RecordOptions(writer="w1")).open()
    caps = [make_capture(s, logits="topk", topk=4, logsumexp=True) for s in range(3)]
    for s, (b, c) in enumerate(caps):
        rec.feed_capture(s, b, c)
    rec.close()
    t = open_dataset(dest).to_pyarrow().to_table()
    for _, c in caps:
        part = t.filter(pa.compute.equal(t.column("request_id"), c.request_id))
        part = part.take(pa.compute.sort_indices(part, [("position", "ascending")]))
        assert part.column("logsumexp").null_count == 0
        np.testing.assert_array_equal(part.column("logsumexp").to_numpy(), c.logsumexp)
    from vllm_tap.client.datasets.export import export_distill

    res = export_distill(dest, str(tmp_path / "kd"))
    assert res.info["logprobs"].startswith("exact")
    rows = {r["request_id"]: r for r in pq.read_table(str(tmp_path / "kd" / "data-00000.parquet")).to_pylist()}
    for _, c in caps:
        r = rows[c.request_id]
        for j, p in enumerate(c.positions.tolist()):
            if r["target_mask"][p][0]:
                np.testing.assert_allclose(r["target_logprobs"][p], c.topk_values[j] - c.logsumexp[j], atol=1e-6)


def test_saelens_export_loads_in_saelens_and_trains(tmp_path) -> None:
    if not os.path.exists(SAE_PY):
        pytest.skip(f"sae-lens venv not found at {SAE_PY} (./run install creates it; see docs/datasets.md)")
    probe = subprocess.run([SAE_PY, "-c", "import sae_lens"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"sae-lens does not import in {SAE_PY}: {probe.stderr.strip().splitlines()[-1:]}")
    # SAELens there but not the project or its dependencies: ./run made the venv wrong, a failure.
    probe = subprocess.run([SAE_PY, "-c", "import zmq, vllm_tap.client.datasets"], capture_output=True, text=True,
                           timeout=120)
    assert probe.returncode == 0, f"{SAE_PY} lacks the project or its dependencies: {probe.stderr[-1000:]}"
    dest = str(tmp_path / "ds")
    _record(dest, range(20))
    out = str(tmp_path / "sae")
    r = subprocess.run([sys.executable, "-m", "vllm_tap.cli", "export", "saelens", dest, out, "--layer", "2",
                        "--context-size", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    ds = open_dataset(dest)
    t = ds.to_pyarrow().to_table(columns=[df.hook_name(2), "token_id"])
    acts = np.stack(t.column(0).to_numpy(zero_copy_only=False))
    n = len(acts) // 8 * 8
    expected = str(tmp_path / "expected.npz")
    np.savez(expected, acts=acts[:n].reshape(-1, 8, HIDDEN),
             tokens=t.column(1).to_numpy()[:n].reshape(-1, 8).astype(np.int32))
    r = subprocess.run([SAE_PY, os.path.join(SUPPORT, "saelens_check.py"), out, df.hook_name(2), str(HIDDEN), "8",
                        expected, dest], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["acts_equal"] and res["tokens_equal"] and res["shape"] == [n // 8, 8, HIDDEN]
    for key in ("losses_store", "losses_iter"):
        losses = res[key]
        assert len(losses) >= 30 and all(np.isfinite(losses))
        assert np.mean(losses[-5:]) < np.mean(losses[:5]), f"{key}: the SAE does not learn"


def test_bench_record_runs_and_reports(tmp_path) -> None:
    """`vllm-tap bench record` at a tiny size: it runs and reports (a smoke test, no timing assertions)."""
    from vllm_tap.tools.bench import record as bench_record

    p = bench_record.RecordParams(dir=str(tmp_path), raw_mib=8, data_mib=8, hidden=256, vocab=2000, repeats=1,
                                  rows_per_capture=64)
    res = bench_record.run(p, lambda m: None)
    assert set(res["summary"]) == {f"{c}/{cfg}" for c in ("hidden", "logits") for cfg in p.configs}
    assert {s["config"].split("/")[0] for s in res["summary"].values()} == {"parquet", "arrow"}
    for s in res["summary"].values():
        assert s["row_mb_s"] > 0 and s["raw_mb_s"] > 0
    e = res["e2e"]
    for mode in bench_record.E2E_MODES:
        assert e[mode]["captures"] + e[mode]["lost"] == e["captures"], mode
    assert "rows in / raw" in bench_record.table(res)


def test_dataset_side_imports_neither_torch_nor_vllm() -> None:
    code = ("import sys; import vllm_tap.client.datasets.recorder, vllm_tap.client.datasets, vllm_tap.client.datasets.export, "
            "vllm_tap.cli.datasets; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_record_cli_errors_are_one_line(tmp_path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vllm_tap.cli", "record", *args], capture_output=True, text=True,
                              timeout=60)

    dest = str(tmp_path / "ds")
    r = run(dest, "--endpoint", f"ipc://{tmp_path}/nothing.sock")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("Error: cannot watch the daemon")
    assert "Traceback" not in r.stderr
    r = run(dest, "--shard-size", "3GB")
    assert r.returncode != 0 and "at most 2000000000 bytes" in r.stderr
    r = run(dest, "--writer", "../x")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("Error: writer id")
    os.makedirs(os.path.join(dest, "writers", "w1"))
    with open(os.path.join(dest, "writers", "w1", "manifest.json"), "w") as f:
        f.write('{"format": "something-else"}')
    r = run(dest, "--writer", "w1")
    assert r.returncode != 0 and "not a vllm-tap manifest" in r.stderr and "Traceback" not in r.stderr
