"""The pure capture-option parser, position windows, the capture policy and the internal spec's
strict decoding: property-based (hypothesis) over the whole option space, plus the exact tables the
docs promise. No vLLM here; tests/e2e/test_server_policy.py sends a sample of the same through HTTP."""

from __future__ import annotations

import hashlib
import string

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bad_options import BAD, NEEDS, VOCAB
from vllm_tap.policy import choose_spec, selects
from vllm_tap.ring_schema import MAX_SPEC_BYTES
from vllm_tap.spec import (
    MAX_INDICES, MAX_KEY_CHARS, OPTIONS, CaptureOptionError, CaptureSpec, LogitsMode, PositionsMode, ServerCaptureConfig,
    is_option_key,
    parse_capture_spec,
)
from vllm_tap.windows import UNBOUNDED, Window

SERVER = ServerCaptureConfig(layers=(0, 1, 2, 3, 4))

# What vllm_xargs can carry after vLLM's own request model (JSON true arrives as 1), and what an
# offline caller can put in extra_args besides.
scalars = st.one_of(st.text(max_size=12), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.booleans())
wire_values = st.one_of(scalars, st.lists(scalars, max_size=4))
python_values = st.one_of(wire_values, st.none(), st.dictionaries(st.text(max_size=3), scalars, max_size=2),
                          st.tuples(scalars, scalars))
option_keys = st.one_of(
    st.sampled_from(sorted(OPTIONS)),
    st.sampled_from(["tapkey", "tap_Key", "TAP", "tap_layer", "tap_position", "Tap_logits", "tap_", "tapestry"]),
    st.text(alphabet=string.ascii_letters + "_", max_size=8).map(lambda s: "tap" + s),
)
other_keys = st.sampled_from(["session_id", "kv_transfer_params", "x", "top"])
good_values = {
    "tap": st.sampled_from([1, True]),
    "tap_logits": st.sampled_from(["full", "none"]),
    "tap_layers": st.one_of(st.sampled_from(["all", "none"]), st.lists(st.integers(0, 4), min_size=1, max_size=5)),
    "tap_positions": st.one_of(
        st.sampled_from([m.value for m in PositionsMode]),
        st.builds(lambda lo, n: [lo, lo + n], st.integers(0, 100), st.integers(1, 100)),
        st.builds(lambda seg, n: f"{seg}[-{n}:]", st.sampled_from(["all", "prompt", "output"]), st.integers(1, 64)),
        st.builds(lambda seg, n: f"{seg}[:{n}]", st.sampled_from(["all", "prompt", "output"]), st.integers(1, 64)),
    ),
    "tap_dtype": st.sampled_from(["auto", "float32"]),
    "tap_key": st.text(alphabet=string.printable.replace("\x00", ""), max_size=40),
}


def _named(err: CaptureOptionError, keys) -> str:
    name = str(err).split(":", 1)[0]
    assert name in keys, f"error does not start with an option it was given: {err}"
    return name


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.one_of(option_keys, other_keys), python_values, max_size=5))
def test_any_options_parse_to_a_valid_spec_or_an_error_naming_one_of_them(extra):
    try:
        spec = parse_capture_spec(extra, SERVER, VOCAB)
    except CaptureOptionError as e:
        _named(e, [k for k in extra if is_option_key(k)])
        return
    if spec is None:
        assert not any(is_option_key(k) for k in extra) or extra.get("tap") == 0
        return
    assert set(extra) & set(OPTIONS), "a spec only from options the tap knows"
    assert all(k in OPTIONS for k in extra if is_option_key(k))
    assert set(spec.layers) <= set(SERVER.layers)
    assert CaptureSpec.from_meta(spec.to_meta()) == spec
    assert spec.source == "client"


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({}, optional=good_values))
def test_well_formed_options_are_accepted(opts):
    assume(opts)
    assume(not (opts.get("tap_logits") == "none" and opts.get("tap_layers") == "none"))
    spec = parse_capture_spec(opts, SERVER, VOCAB)
    assert spec is not None and CaptureSpec.from_meta(spec.to_meta()) == spec




@pytest.mark.parametrize("option, value", [(o, v) for o, vs in BAD.items() for v in vs])
def test_every_option_refuses_every_wrong_type_naming_itself(option, value):
    extra = {**NEEDS.get(option, {}), option: value}
    with pytest.raises(CaptureOptionError) as e:
        parse_capture_spec(extra, SERVER, VOCAB)
    assert str(e.value).startswith(f"{option}:"), str(e.value)


@pytest.mark.parametrize("value", [None, {"a": 1}, True, False])
def test_offline_python_values_are_refused_too(value):
    for option in ("tap_logits", "tap_layers", "tap_positions", "tap_dtype", "tap_key"):
        with pytest.raises(CaptureOptionError, match=f"^{option}:"):
            parse_capture_spec({option: value}, SERVER, VOCAB)


def test_every_spec_the_options_accept_fits_what_a_ring_reader_takes():
    # The longest indices list of the largest ids a vocabulary can hold, the longest key (4-byte
    # characters), the most layers: its BEGIN's spec is still under the reader's bound.
    big = ServerCaptureConfig(layers=tuple(range(1024)))
    spec = parse_capture_spec({"tap_logits": "indices", "tap_indices": [(1 << 31) - 1] * MAX_INDICES,
                               "tap_key": "\U0001f600" * MAX_KEY_CHARS, "tap_positions": "output[-1000000:]"}, big, None)
    meta = spec.to_meta()
    assert len(msgspec.msgpack.encode(meta)) <= MAX_SPEC_BYTES and CaptureSpec.from_meta(meta) == spec
    with pytest.raises(CaptureOptionError, match=f"^tap_indices: {MAX_INDICES + 1} token ids; at most {MAX_INDICES}"):
        parse_capture_spec({"tap_logits": "indices", "tap_indices": [1] * (MAX_INDICES + 1)}, SERVER, VOCAB)


@pytest.mark.parametrize("window", ["output[-\u0661\u0666:]", "all[\uff11:\uff13]", "output[-16:]\n", "all\n",
                                    "prompt[\u0967:]", "all[1:3] ", "all[00000000001:]", "all[1" + "0" * 40 + ":]"])
def test_windows_take_ascii_digits_only_and_nothing_after(window):
    with pytest.raises(CaptureOptionError, match="^tap_positions:"):
        parse_capture_spec({"tap_positions": window}, SERVER, VOCAB)


@pytest.mark.parametrize("option, value", [("tap_positions", "x" * (1 << 20)), ("tap_key", "k" * (1 << 20)),
                                           ("tap_layers", list(range(1 << 17))), ("tap_dtype", "f" * (1 << 20)),
                                           ("tap_indices", ["1"] * (1 << 10)), ("tap" + "x" * (1 << 20), 1),
                                           ("tap_logits", "n" * (1 << 20)), ("tap", "1" * (1 << 20))],
                         ids=["positions", "key", "layers", "dtype", "indices", "unknown-option", "logits", "tap"])
def test_an_error_echoes_a_huge_value_cut_short(option, value):
    extra = {**NEEDS.get(option, {}), option: value}
    with pytest.raises(CaptureOptionError) as e:
        parse_capture_spec(extra, SERVER, VOCAB)
    assert len(str(e.value)) < 1024, len(str(e.value))
    assert str(e.value).startswith(option[:20])


def test_misspelled_option_is_named_with_a_suggestion():
    with pytest.raises(CaptureOptionError, match=r"^tapkey: unknown capture option \(did you mean 'tap_key'\?\)"):
        parse_capture_spec({"tapkey": "job-1"}, SERVER, VOCAB)


def test_tap_zero_alone_opts_out_and_with_other_options_is_an_error():
    assert parse_capture_spec({"tap": 0}, SERVER, VOCAB) is None
    assert parse_capture_spec({"tap": False}, SERVER, VOCAB) is None
    with pytest.raises(CaptureOptionError, match="^tap:"):
        parse_capture_spec({"tap": 0, "tap_layers": [1]}, SERVER, VOCAB)


# -- windows --

def _segment(seg: str, P: int, end: int) -> list[int]:
    return {"all": list(range(end)), "prompt": list(range(P)), "output": list(range(P - 1, end))}[seg]


@settings(max_examples=800, deadline=None)
@given(
    st.sampled_from(["all", "prompt", "output"]), st.one_of(st.none(), st.integers(-40, 40)),
    st.one_of(st.none(), st.integers(-40, 40)), st.integers(1, 30), st.integers(0, 30),
)
def test_a_window_holds_exactly_the_positions_python_slicing_gives(seg, lo, hi, P, G):
    text = seg if lo is None and hi is None else f"{seg}[{'' if lo is None else lo}:{'' if hi is None else hi}]"
    try:
        w = Window.parse(text)
    except ValueError:
        # Refused only for the documented reasons.
        open_end = seg != "prompt"
        assert (open_end and hi is not None and hi < 0) or (open_end and lo is not None and lo < 0 and hi is not None) \
            or (lo is not None and hi is not None and (lo >= 0) == (hi >= 0) and hi <= lo)
        return
    end = P + G - 1 if G else P  # an aborted request may end mid-prompt: covered by the next test
    want = [p for p in _segment(seg, P, end)[slice(lo, hi)] if p < end]
    start, stop = w.position_range(P, end)
    assert list(range(start, stop)) == want
    a, b = w.live_range(P)
    assert a <= start and stop <= b or not want, "workers capture at least the window"
    if w.tail:
        assert w.first_position(P) is None and b == UNBOUNDED
    else:
        assert w.first_position(P) == start and (a, b) == (start, b)
    assert w.reads_prompt(P) == any(p < P - 1 for p in range(a, min(b, P)))
    assert Window.parse(str(w)) == w


def test_window_forms_the_docs_list():
    P, G = 20, 10
    end = P + G - 1  # 29 computed positions
    table = {
        "all": range(0, 29), "prompt": range(0, 20), "output": range(19, 29),
        "last_prompt": range(19, 20), "last_output": range(28, 29),
        "prompt[-16:]": range(4, 20), "output[:4]": range(19, 23), "output[-3:]": range(26, 29),
        "all[5:9]": range(5, 9), (5, 9): range(5, 9), "all[-2:]": range(27, 29), "prompt[:-18]": range(0, 2),
        "output[2:4]": range(21, 23),
    }
    for form, rng in table.items():
        w = Window.parse(list(form) if isinstance(form, tuple) else form)
        assert w.position_range(P, end) == (rng.start, rng.stop), form
    # An aborted request that computed only part of its prompt.
    assert Window.parse("output[-3:]").position_range(P, 12) == (19, 19)
    assert Window.parse("prompt").position_range(P, 12) == (0, 12)
    # Only windows reaching before P-1 skip the prefix cache.
    assert [f for f in table if Window.parse(list(f) if isinstance(f, tuple) else f).reads_prompt(P)] == [
        "all", "prompt", "prompt[-16:]", "all[5:9]", (5, 9), "all[-2:]", "prompt[:-18]"]
    assert not Window.parse([30, 40]).reads_prompt(P) and Window.parse([10, 40]).reads_prompt(P)


def test_named_modes_are_windows_with_their_old_meaning():
    for mode, text in [(PositionsMode.LAST_OUTPUT, "output[-1:]"), (PositionsMode.LAST_PROMPT, "prompt[-1:]"),
                       (PositionsMode.OUTPUT, "output")]:
        spec = CaptureSpec(positions=mode)
        assert str(spec.positions) == text and spec.to_meta()["positions"] == text
    assert CaptureSpec(positions=PositionsMode.LAST_OUTPUT).tail == 1
    assert CaptureSpec(positions="output[-16:]").tail == 16 and CaptureSpec().tail == 0


# -- the internal spec: strict decoding --

@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(st.one_of(st.none(), scalars), lambda c: st.one_of(st.lists(c, max_size=3),
                    st.dictionaries(st.sampled_from(["logits", "topk", "indices", "layers", "positions", "dtype",
                                                     "key", "source", "x"]), c, max_size=8)), max_leaves=12))
def test_from_meta_raises_only_capture_option_error(m):
    try:
        spec = CaptureSpec.from_meta(m)
    except CaptureOptionError:
        return
    assert CaptureSpec.from_meta(spec.to_meta()) == spec


@pytest.mark.parametrize("change", [
    {"logits": "all"}, {"topk": "3"}, {"topk": True}, {"topk": 3}, {"indices": [1]}, {"layers": "all"},
    {"layers": [-1]}, {"positions": "middle"}, {"positions": 3}, {"dtype": None}, {"key": 5}, {"source": "evil"},
])
def test_from_meta_refuses_each_malformed_field(change):
    with pytest.raises(CaptureOptionError):
        CaptureSpec.from_meta({**CaptureSpec().to_meta(), **change})


@pytest.mark.parametrize("m", ["x", 1, None, [], {}, {"logits": "full"}])
def test_from_meta_refuses_what_is_not_a_spec(m):
    with pytest.raises(CaptureOptionError):
        CaptureSpec.from_meta(m)


# -- the policy --

def test_policy_selection_is_the_documented_hash():
    ids = [f"cmpl-{i:05d}-0" for i in range(4000)]
    for share in (0.0, 0.05, 0.5, 1.0):
        got = [selects(r, share) for r in ids]
        want = [int.from_bytes(hashlib.sha256(r.encode()).digest()[:8], "big") < share * 2**64 for r in ids]
        assert got == want
        assert abs(sum(got) / len(ids) - share) < 0.03


def _server(**policy) -> ServerCaptureConfig:
    return ServerCaptureConfig.from_additional_config({"vllm_tap": {"policy": policy}}, 4, VOCAB)


def test_how_the_policy_meets_a_request_s_own_options():
    rid_in = next(f"r{i}" for i in range(100) if selects(f"r{i}", 0.5))
    rid_out = next(f"r{i}" for i in range(100) if not selects(f"r{i}", 0.5))
    own = {"tap_layers": [2], "tap_positions": "output"}
    wins = _server(share=0.5, positions="output[-4:]", logits="topk", topk=5)
    assert choose_spec(rid_in, None, wins, VOCAB).source == "policy"
    assert choose_spec(rid_out, None, wins, VOCAB) is None
    assert choose_spec(rid_in, own, wins, VOCAB).layers == (2,)
    assert choose_spec(rid_in, own, wins, VOCAB).source == "client"
    assert choose_spec(rid_in, {"tap": 0}, wins, VOCAB) is None
    loses = _server(share=0.5, client="loses")
    assert choose_spec(rid_in, own, loses, VOCAB).source == "policy"
    assert choose_spec(rid_in, {"tap": 0}, loses, VOCAB).source == "policy"
    assert choose_spec(rid_out, own, loses, VOCAB).source == "client"
    refused = _server(share=0.5, client="refused")
    with pytest.raises(CaptureOptionError, match="^tap_layers:"):
        choose_spec(rid_out, own, refused, VOCAB)
    assert choose_spec(rid_in, {"top_k": 3}, refused, VOCAB).source == "policy"
    for server in (wins, loses):  # a bad option is an error whatever the policy would do
        with pytest.raises(CaptureOptionError, match="^tap_layers:"):
            choose_spec(rid_in, {"tap_layers": []}, server, VOCAB)


@pytest.mark.parametrize("policy, needle", [
    ("all", "vllm_tap.policy:"), ({}, "vllm_tap.policy.share: required"), ({"share": 1.5}, "vllm_tap.policy.share:"),
    ({"share": True}, "vllm_tap.policy.share:"), ({"share": "0.5"}, "vllm_tap.policy.share:"),
    ({"share": 0.1, "client": "maybe"}, "vllm_tap.policy.client:"),
    ({"share": 0.1, "layers": [9]}, "vllm_tap.policy.layers:"),
    ({"share": 0.1, "positions": "output[:-2]"}, "vllm_tap.policy.positions:"),
    ({"share": 0.1, "logits": "topk"}, "vllm_tap.policy.topk:"),
    ({"share": 0.1, "logits": "topk", "topk": VOCAB + 1}, "vllm_tap.policy.topk:"),
    ({"share": 0.1, "tap_layers": [1]}, "vllm_tap.policy: unknown setting 'tap_layers'"),
])
def test_bad_policy_settings_name_the_key(policy, needle):
    with pytest.raises(CaptureOptionError) as e:
        ServerCaptureConfig.from_additional_config({"vllm_tap": {"policy": policy}}, 4, VOCAB)
    assert str(e.value).startswith(needle) and "\n" not in str(e.value), str(e.value)


def test_policy_spec_takes_the_same_choices_as_a_request():
    s = _server(share=0.25, logits="indices", indices=[3, 5], layers=[1, 3], positions="prompt[-8:]", dtype="float32",
                key="traffic")
    spec = s.policy.spec
    assert (spec.logits, spec.indices, spec.layers, str(spec.positions), spec.dtype.value, spec.key, spec.source) == (
        LogitsMode.INDICES, (3, 5), (1, 3), "prompt[-8:]", "float32", "traffic", "policy")


# -- reducers (vllm_tap.reducers): named by requests and by the policy --

_REDUCERS = {"tox": {"kind": "linear", "layer": 2, "path": "/p/tox.safetensors"},
             "sae": {"kind": "saelens", "layer": 3, "path": "/p/sae", "k": 32}}


def test_tap_reducers_names_declared_reducers_and_alone_captures_only_them():
    server = ServerCaptureConfig.from_additional_config({"vllm_tap": {"layers": [1, 2], "reducers": _REDUCERS}}, 4, VOCAB)
    assert server.reducer_names == ("tox", "sae") and server.aux_layers == (1, 2, 3)
    spec = parse_capture_spec({"tap_reducers": ["tox", "sae", "tox"]}, server, VOCAB)
    assert spec.reducers == ("sae", "tox"), "sorted and unique: index i of the spec numbers reducer i's tensors"
    assert spec.logits == LogitsMode.NONE and spec.layers == (), "logits and layers default to none with reducers"
    both = parse_capture_spec({"tap_reducers": ["tox"], "tap_layers": "all", "tap_logits": "full"}, server, VOCAB)
    assert both.layers == (1, 2) and both.logits == LogitsMode.FULL
    assert CaptureSpec.from_meta(spec.to_meta()) == spec
    assert "reducers" not in CaptureSpec().to_meta(), "a spec without reducers reads as before them"
    for value, words in ((["nope"], "unknown reducer 'nope'; this server declares 'tox', 'sae'"),
                         ("tox", "expected a non-empty list"), ([], "expected a non-empty list")):
        with pytest.raises(CaptureOptionError) as e:
            parse_capture_spec({"tap_reducers": value}, server, VOCAB)
        assert str(e.value).startswith("tap_reducers: ") and words in str(e.value), e.value
    with pytest.raises(CaptureOptionError, match="^tap_reducers: unknown reducer 'tox'; this server declares none"):
        parse_capture_spec({"tap_reducers": ["tox"]}, SERVER, VOCAB)


def test_the_policy_may_name_reducers_and_bad_ones_stop_start_up_naming_the_key():
    cfg = ServerCaptureConfig.from_additional_config(
        {"vllm_tap": {"reducers": _REDUCERS, "policy": {"share": 0.5, "reducers": ["sae"]}}}, 4, VOCAB)
    assert cfg.policy.spec.reducers == ("sae",) and cfg.policy.spec.layers == ()
    for settings, key in (({"reducers": _REDUCERS, "policy": {"share": 1, "reducers": ["x"]}}, "vllm_tap.policy.reducers"),
                          ({"reducers": {"tox": {**_REDUCERS["tox"], "layer": 5}}}, "vllm_tap.reducers.tox.layer"),
                          ({"reducers": ["tox"]}, "vllm_tap.reducers")):
        with pytest.raises(CaptureOptionError) as e:
            ServerCaptureConfig.from_additional_config({"vllm_tap": settings}, 4, VOCAB)
        assert str(e.value).startswith(key + ":"), e.value


@pytest.mark.parametrize("reducers", [["b", "a"], ["a", "a"], ["a.b"], ["x" * 65], list("abcdefghijklmnopqrstuvwxyzABCDEFGH"), [1]])
def test_a_spec_whose_reducers_are_not_sorted_names_is_refused(reducers):
    meta = {**CaptureSpec(logits=LogitsMode.NONE, layers=()).to_meta(), "reducers": reducers}
    with pytest.raises(CaptureOptionError):
        CaptureSpec.from_meta(meta)
