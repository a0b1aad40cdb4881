"""vllm_tap.ring_schema: every record is decoded against a typed schema with every size bounded.

Unit tests name each check; hypothesis throws arbitrary metas, tables, header fields and bytes at
the decoder (and at a real ring file read by RingReader): the only outcomes allowed are records
of the declared types or a `Rejected` saying why."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ring_forge import RingForge, control, data, entry, pack
from vllm_tap import ring_format as rf
from vllm_tap.ring_records import Record, per_tensor
from vllm_tap.ring_reader import RingBroken, RingReader
from vllm_tap.ring_schema import (
    MAX_POSITION, BeginMeta, DropMeta, EndMeta, LiveMeta, Rejected, decode_record,
)
from vllm_tap.spec import CaptureSpec

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = [rf.RecordKind.BEGIN, rf.RecordKind.END, rf.RecordKind.DROP, rf.RecordKind.LIVE]
TYPED = {rf.RecordKind.BEGIN: BeginMeta, rf.RecordKind.END: EndMeta, rf.RecordKind.DROP: DropMeta,
         rf.RecordKind.LIVE: LiveMeta}

# msgpack values of every shape, nested a little.
leaves = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=True),
                   st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                      st.dictionaries(st.text(max_size=12), inner, max_size=6)),
                      max_leaves=30)
field_names = st.sampled_from(["spec", "num_prompt_tokens", "prompt_token_ids", "n", "model", "reason",
                               "num_output_tokens", "output_token_ids", "end_position", "source", "tensor",
                               "layer", "positions", "requests", "x"])
metas = st.one_of(values, st.dictionaries(field_names, values, max_size=8))


def _good_data(**over) -> bytes:
    kw = dict(table=[entry("r", num_prompt_tokens=2)], slots=[0, 0], positions=[0, 1], token_ids=[5, 6],
              payload=np.arange(8, dtype=np.float32).reshape(2, 4))
    kw.update(over)
    return data(kw.pop("table"), kw.pop("slots"), kw.pop("positions"), kw.pop("token_ids"), kw.pop("payload"), **kw)


def _with_header(rec: bytes, **fields) -> bytes:
    names = ["magic", "total", "kind", "tensor", "dtype", "flags", "layer", "rank", "n_rows", "n_requests", "key_len",
             "pad", "meta_len", "step", "slice_start", "slice_stop", "full_dim", "payload_offset"]
    vals = dict(zip(names, rf.RECORD_HEADER.unpack_from(rec, 0)))
    vals.update(fields)
    buf = bytearray(rec)
    rf.RECORD_HEADER.pack_into(buf, 0, *[vals[n] for n in names])
    return bytes(buf)


def _check(recs: list[Record]) -> None:
    """What a decoded record promises its readers."""
    for r in per_tensor(recs):
        assert isinstance(r.request_id, str) and isinstance(r.tap_key, str)
        if r.kind == rf.RecordKind.DATA:
            n = len(r.positions)
            assert r.data.shape == (n, r.slice_stop - r.slice_start) and len(r.token_ids) == n
            assert n == 0 or (int(r.positions.min()) >= 0 and int(r.positions.max()) <= MAX_POSITION)
            assert 1 <= r.expected_ranks and 1 <= r.rank_parts and r.start >= -1 and r.tail >= 0
        else:
            assert isinstance(r.control, TYPED[r.kind]) and isinstance(r.meta, dict)
            assert r.spec is None or isinstance(r.spec, CaptureSpec)


# -- what is accepted --


def test_a_good_data_record_decodes_with_its_table():
    (r,) = per_tensor(decode_record(_good_data()))
    assert r.request_id == "r" and r.num_prompt_tokens == 2 and r.start == 0 and r.tail == 0 and r.source == "client"
    assert r.positions.tolist() == [0, 1] and r.data.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_reducer_output_decodes_as_its_numbered_tensor():
    (r,) = per_tensor(decode_record(_good_data(tensor=int(rf.TensorKind.PROBE), layer=3)))
    assert r.tensor.name == "probe.3" and r.data.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    (i,) = per_tensor(decode_record(_good_data(tensor=int(rf.TensorKind.LATENT_IDS), layer=0, dtype=int(rf.DType.INT32),
                                    payload=np.array([[3, -1], [4, 5]], np.int32))))
    assert i.tensor.name == "latent_ids.0" and i.data.tolist() == [[3, -1], [4, 5]]


def test_control_records_decode_to_their_typed_meta_and_spec():
    spec = CaptureSpec(key="k", source="policy")
    (b,) = decode_record(control(rf.RecordKind.BEGIN, "r", {"spec": spec.to_meta(), "num_prompt_tokens": 3,
                                                            "prompt_token_ids": [1, 2, 3], "future": {"x": 1}}, "k"))
    assert isinstance(b.control, BeginMeta) and b.spec == spec and b.source == "policy" and b.tap_key == "k"
    assert b.meta["prompt_token_ids"] == [1, 2, 3] and "future" not in b.meta  # unknown fields: ignored
    (e,) = decode_record(control(rf.RecordKind.END, "r", {"reason": "stop", "end_position": 9, "source": "policy"}))
    assert e.control.end_position == 9 and e.spec is None and e.source == "policy"
    (live,) = decode_record(control(rf.RecordKind.LIVE, "", {"requests": ["a", "b"]}))
    assert live.request_id == "" and live.control.requests == ["a", "b"]


# -- what is refused, and which captures it names --


@pytest.mark.parametrize("fields, words", [
    ({"tensor": 99}, "tensor kind"),
    ({"dtype": 42}, "dtype"),
    ({"n_requests": 0}, "requests in one record"),
    ({"n_requests": rf.MAX_REQUESTS_PER_RECORD + 1}, "requests in one record"),
    ({"key_len": 3}, "key section"),
    ({"slice_start": 3, "slice_stop": 2}, "slice"),
    ({"slice_stop": 5, "full_dim": 4}, "slice"),
    ({"tensor": int(rf.TensorKind.HIDDEN), "layer": -5}, "hidden layer"),
    ({"tensor": int(rf.TensorKind.PROBE), "layer": -1}, "probe of reducer index -1"),
    ({"tensor": int(rf.TensorKind.LATENT_VALUES), "layer": 256}, "latent_values of reducer index 256"),
    ({"tensor": int(rf.TensorKind.LATENT_IDS), "layer": 0}, "latent_ids of dtype code 1"),
    ({"n_rows": 1 << 30}, "cannot fit"),
    ({"payload_offset": 64}, "payload"),
    ({"meta_len": 1 << 30}, "request table of"),
    ({"n_requests": 2}, "holds 1 entries"),
    ({"magic": b"XXXX"}, "magic"),
    ({"kind": 77}, "unknown record kind"),
])
def test_header_fields_are_bounds_checked(fields, words):
    with pytest.raises(Rejected, match=words):
        decode_record(_with_header(_good_data(), **fields))


@pytest.mark.parametrize("rec, words, ids", [
    (_good_data(slots=[0, 3]), "outside the table", ("r",)),
    (_good_data(positions=[0, -1]), "negative position", ("r",)),
    (_good_data(table=[entry("r", expected_ranks="1")]), "expected_ranks", ("r",)),
    (_good_data(table=[entry(["r"])]), "request_id", ()),
    (_good_data(table=[entry(5)]), "request_id", ()),
    (_good_data(table=[entry("r", tap_key=["k"])]), "tap_key", ("r",)),
    (_good_data(table=[entry("r", start=-2)]), "start", ("r",)),
    (_good_data(table=[entry("r")[:5]]), "length", ("r",)),
    (control(rf.RecordKind.BEGIN, "r", [1, 2, 3]), "BEGIN meta", ("r",)),
    (control(rf.RecordKind.BEGIN, "r", {"prompt_token_ids": 5}), "prompt_token_ids", ("r",)),
    (control(rf.RecordKind.BEGIN, "r", {"spec": "x"}), "capture spec", ("r",)),
    (control(rf.RecordKind.BEGIN, "r", {"spec": {"logits": "full"}}), "capture spec unreadable", ("r",)),
    (control(rf.RecordKind.BEGIN, "r", {"spec": {"pad": "x" * (70 << 10)}}), "capture spec of", ("r",)),
    (control(rf.RecordKind.END, "r", {"end_position": "12"}), "end_position", ("r",)),
    (control(rf.RecordKind.END, "r", {"end_position": 1 << 31}), "end_position", ("r",)),
    (control(rf.RecordKind.END, "r", {"end_position": True}), "end_position", ("r",)),
    (control(rf.RecordKind.DROP, "r", {"positions": [1, -1]}), "positions", ("r",)),
    (control(rf.RecordKind.LIVE, "", {"requests": [1]}), "requests", ()),
    (control(rf.RecordKind.BEGIN, "", {}), "empty request id", ()),
    (control(rf.RecordKind.BEGIN, b"\xff\xfe", {}), "UTF-8", ()),
])
def test_records_that_do_not_fit_are_rejected_naming_their_captures(rec, words, ids):
    with pytest.raises(Rejected, match=words) as e:
        decode_record(rec)
    assert e.value.request_ids == ids


def test_a_control_meta_overrunning_its_record_is_rejected():
    rec = control(rf.RecordKind.BEGIN, "r", {})
    with pytest.raises(Rejected, match="overrun"):
        decode_record(_with_header(rec, meta_len=len(rec)))


# -- fuzz --


@SETTINGS
@given(kind=st.sampled_from(KINDS), meta=metas, rid=st.text(max_size=8))
def test_any_control_meta_decodes_to_its_schema_or_is_rejected(kind, meta, rid):
    try:
        _check(decode_record(control(kind, rid, meta)))
    except Rejected:
        pass


@SETTINGS
@given(entries=st.lists(st.one_of(st.lists(values, max_size=10), values), min_size=1, max_size=4))
def test_any_request_table_decodes_to_its_schema_or_is_rejected(entries):
    n = len(entries)
    try:
        _check(decode_record(_good_data(table=entries, slots=list(range(n)) * 1, positions=list(range(n)),
                                        token_ids=[0] * n, payload=np.zeros((n, 4), np.float32))))
    except Rejected:
        pass


@SETTINGS
@given(fields=st.fixed_dictionaries({}, optional={
    "tensor": st.integers(0, 255), "dtype": st.integers(0, 255), "layer": st.integers(-(1 << 15), (1 << 15) - 1),
    "n_rows": st.integers(0, (1 << 32) - 1), "n_requests": st.integers(0, (1 << 32) - 1),
    "key_len": st.integers(0, (1 << 16) - 1), "meta_len": st.integers(0, (1 << 32) - 1),
    "slice_start": st.integers(0, (1 << 32) - 1), "slice_stop": st.integers(0, (1 << 32) - 1),
    "full_dim": st.integers(0, (1 << 32) - 1), "payload_offset": st.integers(0, (1 << 32) - 1),
    "kind": st.integers(0, 255)}))
def test_any_header_decodes_consistently_or_is_rejected(fields):
    try:
        _check(decode_record(_with_header(_good_data(), **fields)))
    except Rejected:
        pass


@SETTINGS
@given(blob=st.binary(min_size=0, max_size=512))
def test_any_bytes_are_rejected(blob):
    rec = blob + b"\x00" * (-len(blob) % rf.ALIGN)
    try:
        _check(decode_record(rec))
    except Rejected:
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=8, max_size=4096), cursor=st.integers(0, 1 << 20))
def test_a_reader_survives_any_ring_contents(shm_dir, garbage, cursor):
    f = RingForge(shm_dir, "fuzz", 0, capacity=1 << 16)
    try:
        f.append(control(rf.RecordKind.BEGIN, "ok", {}))
        w = f.write_cursor
        f._mm[rf.HEADER_SIZE + w : rf.HEADER_SIZE + w + len(garbage)] = garbage
        f.set_write_cursor(w + cursor)
        r = RingReader(f.path)
        try:
            recs = r.poll()
            _check(recs)
            if cursor <= f.capacity - w:
                assert recs[0].request_id == "ok"
            assert recs or r.corrupt  # a write cursor past a whole lap: everything skipped, counted
            assert r.poll() == []  # whatever it was, it was skipped past
        except RingBroken:
            pass
        r.close()
    finally:
        f.close()
        os.unlink(f.path)


def test_the_table_of_a_step_is_decoded_once_for_all_its_records(shm_dir):
    f = RingForge(shm_dir, "t", 0)
    table = [entry(f"r{i}", num_prompt_tokens=1) for i in range(3)]
    payload = np.zeros((3, 4), np.float32)
    f.append(*[_good_data(table=table, slots=[0, 1, 2], positions=[0, 0, 0], token_ids=[1, 2, 3], payload=payload,
                          tensor=int(rf.TensorKind.HIDDEN), layer=layer) for layer in range(4)])
    r = RingReader(f.path)
    recs = r.poll()
    assert len(recs) == 4 and len(per_tensor(recs)) == 12 and r._table_cache.entries[2].request_id == "r2"
    f.close()


def test_msgpack_of_the_writer_and_the_schema_agree():
    """RequestRef.packed() (the writer's) decodes to the reader's RequestEntry."""
    from vllm_tap.ring_records import RequestRef, RequestTable

    ref = RequestRef("req", "key", 7, 2, 3, start=6, tail=0, source="policy")
    (r,) = per_tensor(decode_record(_good_data(table=RequestTable([ref]).blob, n_requests=1)))
    assert (r.request_id, r.tap_key, r.num_prompt_tokens, r.expected_ranks, r.rank_parts, r.start, r.tail, r.source) == (
        "req", "key", 7, 2, 3, 6, 0, "policy")
    assert msgpack.unpackb(pack([1])) == [1]


@pytest.mark.parametrize("extra", [5, 63, 8])
def test_a_write_cursor_no_writer_makes_is_skipped_not_looped_on(shm_dir, extra):
    """Found by the fuzz test above: an unaligned cursor left less than a record header to read,
    and the reader went round without moving (a hung daemon)."""
    f = RingForge(shm_dir, "fuzz", 0, capacity=1 << 16)
    f.append(control(rf.RecordKind.BEGIN, "ok", {}))
    f.set_write_cursor(f.write_cursor + extra)
    r = RingReader(f.path)
    (ok,) = r.poll()  # what lies before the nonsense still reads
    assert ok.request_id == "ok" and r.corrupt == (extra % rf.ALIGN != 0)
    assert r.poll() == []
    r.close()
    f.close()


def test_control_records_are_written_from_the_structs_they_are_decoded_with(shm_dir):
    """What a writer gives write_control (a meta Struct) is what the reader hands back, kind and all;
    fields at their default travel as nothing and come back as that default."""
    from vllm_tap.ring_records import RequestRef, RequestTable, TensorId
    from vllm_tap.ring_schema import ShedMeta, drop_metas, spec_field
    from vllm_tap.ring_writer import RingWriter

    spec = CaptureSpec(key="k")
    metas = [
        BeginMeta(spec=spec_field(spec), num_prompt_tokens=3, prompt_token_ids=[1, 2, 3], n=2, model="m",
                  async_scheduling=False, source="client"),
        EndMeta(reason="stop", num_prompt_tokens=3, num_output_tokens=2, output_token_ids=[4, 5], end_position=4,
                spec=spec_field(spec), source="client"),
        EndMeta(),
        LiveMeta(["a", "b"]),
        ShedMeta(num_prompt_tokens=3, spec=spec_field(spec), source="policy", unread_bytes=7, capacity=9),
    ]
    table = RequestTable([RequestRef("x", "t"), RequestRef("y")])
    drops = list(drop_metas(table, np.array([1, 0, 1]), np.array([7, 8, 9]), TensorId.of(rf.TensorKind.HIDDEN, 2)))
    assert [(ref.request_id, m) for ref, m in drops] == [("x", DropMeta(int(rf.TensorKind.HIDDEN), 2, [8])),
                                                          ("y", DropMeta(int(rf.TensorKind.HIDDEN), 2, [7, 9]))]
    w = RingWriter(os.path.join(shm_dir, "engine.ring"), 1 << 16, rank=rf.ENGINE_RANK)
    r = RingReader(os.path.join(shm_dir, "engine.ring"))
    for m in metas:
        assert w.write_control("r", m, tap_key="k")
    for ref, m in drops:
        assert w.write_control(ref.request_id, m, tap_key=ref.tap_key)
    got = r.poll()
    kinds = [rf.RecordKind.BEGIN, rf.RecordKind.END, rf.RecordKind.END, rf.RecordKind.LIVE, rf.RecordKind.SHED,
             rf.RecordKind.DROP, rf.RecordKind.DROP]
    assert [g.kind for g in got] == kinds
    assert [g.control for g in got] == metas + [m for _, m in drops]
    assert got[0].spec == spec and got[-2].request_id == "x" and got[-2].tap_key == "t"
    w.close()
    r.close()
