"""What to capture: the server-wide settings (with the capture policy) and the per-request spec.

Per-request options arrive as `SamplingParams.extra_args` (the OpenAI API's `vllm_xargs`), whose
values are only str, int, float or lists of those: vLLM turns JSON `true`/`false` into 1/0 before
the tap sees them, and refuses null and objects itself. Rules this module keeps:
  - every key whose lower-case form starts with `tap` belongs to the tap; a request opts in by
    carrying any of them, and one the tap does not know is an error naming it (a misspelled
    `tapkey` must not be ignored);
  - every option accepts exactly the types documented in OPTIONS: no bools (offline callers can
    send real ones), no floats for ints, lists where a list is meant (a bare int is refused where
    JSON `true` would arrive as one, as for tap_layers);
  - every error is a CaptureOptionError whose message starts with the option's name;
  - keys starting with `vllm_tap` are the tap's own (RESERVED_PREFIX): the API process writes the
    normalised spec there, and refuses requests that bring their own.
Parsing is pure so the API process (validation, HTTP 400), the workers (selection) and the daemon
(expected positions) agree. `CaptureSpec.from_meta` decodes the internal spec strictly (msgspec),
because whatever carries it (extra_args, ring records) may have been written by someone else.
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import msgspec

from vllm_tap.defaults import DEFAULT_SHM_DIR
from vllm_tap.reducers import MAX_REDUCERS, ReducerDecl, ReducerSettingError, check_name, parse_reducers
from vllm_tap.ring_format import MAX_SPEC_BYTES
from vllm_tap.windows import UNBOUNDED, SYNTAX_HELP, Window, shown


class CaptureOptionError(ValueError):
    """A capture option is invalid; the message names the option and what is allowed."""


class LogitsMode(str, enum.Enum):
    FULL = "full"
    NONE = "none"
    TOPK = "topk"
    INDICES = "indices"


class PositionsMode(str, enum.Enum):
    """The named windows (vllm_tap.windows has the general form)."""

    ALL = "all"
    PROMPT = "prompt"  # positions 0 .. P-1
    OUTPUT = "output"  # positions P-1 .. end: those whose logits predict a generated token
    LAST_PROMPT = "last_prompt"  # position P-1
    LAST_OUTPUT = "last_output"  # the last computed position (predicts the last generated token)


class DTypeMode(str, enum.Enum):
    AUTO = "auto"  # as the model computed it (bf16 on most GPUs)
    FLOAT32 = "float32"


SOURCE_CLIENT = "client"  # the request opted in with tap* options
SOURCE_POLICY = "policy"  # the server's capture policy chose it
SOURCES = (SOURCE_CLIENT, SOURCE_POLICY)

SERVER_CONFIG_KEY = "vllm_tap"  # --additional-config '{"vllm_tap": {...}}'
DEFAULT_RING_BYTES = 256 << 20  # when ring_bytes is not set and the model's size is unknown
DEFAULT_STEPS_PER_S = 100.0  # decode steps a second a ring is sized for when the operator does not say
DEFAULT_SHED_AT = 0.5  # a worker sheds new captures while more than this share of its ring is unread
RESERVED_PREFIX = "vllm_tap"  # extra_args keys only the tap itself may write
MAX_KEY_CHARS = 256
# A spec travels in every BEGIN and END record, where a reader takes at most MAX_SPEC_BYTES of it
# (ring_schema). A token id takes at most 5 bytes of msgpack, so this many leave room for the rest;
# parse_options also measures the whole spec, so whatever the API process accepts the daemon takes.
MAX_INDICES = 8192
assert 5 * MAX_INDICES + 8 * MAX_KEY_CHARS < MAX_SPEC_BYTES
_MAX_ID = 1 << 31  # token ids and positions travel as int32
_MAX_LAYER = 1 << 15  # layers travel as int16


def _is_int(v: Any) -> bool:
    return type(v) is int or (isinstance(v, int) and not isinstance(v, bool))


@dataclass(frozen=True)
class CaptureSpec:
    """One request's capture options, normalised. `positions` is a Window; a PositionsMode or a
    window's text is accepted too and normalised."""

    logits: LogitsMode = LogitsMode.FULL
    topk: int = 0
    indices: tuple[int, ...] = ()
    layers: tuple[int, ...] = ()
    positions: Window = field(default_factory=Window)
    dtype: DTypeMode = DTypeMode.AUTO
    key: str = ""
    source: str = SOURCE_CLIENT  # SOURCE_CLIENT: the request opted in; SOURCE_POLICY: the server's policy chose it
    # Names of the server's reducers to run (vllm_tap.reducers), sorted: reducer i's output travels as
    # the capture's reducer tensors of index i.
    reducers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.positions, Window):
            try:
                object.__setattr__(self, "positions", Window.parse(self.positions))
            except ValueError as e:
                raise CaptureOptionError(f"positions: {e}") from None

    # -- which positions (see vllm_tap.windows) --

    @property
    def tail(self) -> int:
        """N > 0 when the capture is the last N computed positions of its segment: its start is
        known only at the end, so workers capture the whole live range and the daemon keeps the
        last N. 0 otherwise."""
        return self.positions.tail

    def first_position(self, num_prompt: int) -> int | None:
        """The first expected position when it is known before the request ends, else None."""
        return self.positions.first_position(num_prompt)

    def position_range(self, num_prompt: int, end: int) -> tuple[int, int]:
        """[start, stop) of captured positions for a request whose computed positions are [0, end)."""
        return self.positions.position_range(num_prompt, end)

    def live_range(self, num_prompt: int) -> tuple[int, int]:
        """[start, stop) of positions a worker captures while the request runs (stop may be the
        unbounded 1 << 62: the end is not known yet)."""
        return self.positions.live_range(num_prompt)

    def reads_prompt(self, num_prompt: int) -> bool:
        """Whether a prefix-cache hit would skip positions this capture wants."""
        return self.positions.reads_prompt(num_prompt)

    @property
    def wants_prompt_rows(self) -> bool:
        """reads_prompt() for some prompt length: whether positions before P-1 may be captured."""
        return self.positions.may_read_prompt

    # -- serialisation into extra_args and BEGIN/END records --

    def to_meta(self) -> dict[str, Any]:
        meta = {
            "logits": self.logits.value, "topk": self.topk, "indices": list(self.indices),
            "layers": list(self.layers), "positions": str(self.positions), "dtype": self.dtype.value,
            "key": self.key, "source": self.source,
        }
        if self.reducers:  # absent otherwise: the spec of a capture without reducers reads as before them
            meta["reducers"] = list(self.reducers)
        return meta

    @classmethod
    def from_meta(cls, m: Any) -> "CaptureSpec":
        """The spec `to_meta` wrote; CaptureOptionError (a ValueError) for anything else."""
        try:
            raw = msgspec.convert(m, _SpecMeta, strict=True)
        except msgspec.ValidationError as e:
            raise CaptureOptionError(f"capture spec: {e}") from None
        try:
            logits, dtype = LogitsMode(raw.logits), DTypeMode(raw.dtype)
            window = Window.parse(raw.positions)
        except ValueError as e:
            raise CaptureOptionError(f"capture spec: {e}") from None
        if (logits == LogitsMode.TOPK) != (raw.topk > 0) or not 0 <= raw.topk < _MAX_ID:
            raise CaptureOptionError(f"capture spec: topk {raw.topk} with logits {logits.value!r}")
        if (logits == LogitsMode.INDICES) != bool(raw.indices) or not all(0 <= i < _MAX_ID for i in raw.indices):
            raise CaptureOptionError(f"capture spec: indices {raw.indices[:8]} with logits {logits.value!r}")
        if not all(0 <= x < _MAX_LAYER for x in raw.layers):
            raise CaptureOptionError(f"capture spec: layers {raw.layers[:8]}")
        if len(raw.key) > MAX_KEY_CHARS or "\x00" in raw.key:
            raise CaptureOptionError("capture spec: key too long or with a NUL")
        if raw.source not in SOURCES:
            raise CaptureOptionError(f"capture spec: source {raw.source[:32]!r}")
        if len(raw.reducers) > MAX_REDUCERS or not all(check_name(r) for r in raw.reducers) \
                or list(raw.reducers) != sorted(set(raw.reducers)):
            raise CaptureOptionError(f"capture spec: reducers {raw.reducers[:4]}")
        return cls(logits, raw.topk, tuple(raw.indices), tuple(sorted(set(raw.layers))), window, dtype,
                   raw.key, raw.source, tuple(raw.reducers))


class _SpecMeta(msgspec.Struct):
    """The schema of CaptureSpec.to_meta() (unknown fields are ignored: a newer writer may add some)."""

    logits: str
    topk: int
    indices: list[int]
    layers: list[int]
    positions: str
    dtype: str
    key: str = ""
    source: str = SOURCE_CLIENT
    reducers: list[str] = []


# -- options: per request (tap_*) and in the server's policy (vllm_tap.policy.*) --

OPTION_PREFIX = "tap"
OPTIONS = {
    "tap": "1 (JSON true) to capture with the defaults, 0 (false) alone to not capture; any other tap_* option also opts in",
    "tap_logits": "'full' | 'none' | 'topk' | 'indices'",
    "tap_topk": "k for tap_logits='topk' (an integer, 1..vocab size)",
    "tap_indices": f"a list of at most {MAX_INDICES} token ids for tap_logits='indices'",
    "tap_layers": "'all' | 'none' | a list of layer numbers the server exposes",
    "tap_positions": SYNTAX_HELP,
    "tap_dtype": "'auto' | 'float32'",
    "tap_key": f"a string of your choosing to subscribe by (at most {MAX_KEY_CHARS} characters)",
    "tap_reducers": "a list of names of reducers the server declares (probes, SAE encoders); with it, tap_logits "
                    "and tap_layers default to 'none'",
}
SPEC_FIELDS = ("logits", "topk", "indices", "layers", "positions", "dtype", "key", "reducers")


def is_option_key(key: Any) -> bool:
    return isinstance(key, str) and key[:3].lower() == OPTION_PREFIX


def is_reserved_key(key: Any) -> bool:
    return isinstance(key, str) and key[: len(RESERVED_PREFIX)].lower() == RESERVED_PREFIX


def wants_capture(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether the request carries any tap* key (valid or not: a bad one must be reported)."""
    return bool(extra_args) and any(is_option_key(k) for k in extra_args)


def _enum(name: str, value: Any, enum_cls: type[enum.Enum]) -> Any:
    allowed = [e.value for e in enum_cls]
    if not isinstance(value, str) or value not in allowed:
        raise CaptureOptionError(f"{name}: got {shown(value)}; allowed: {', '.join(repr(a) for a in allowed)}")
    return enum_cls(value)


def _int(name: str, value: Any, what: str = "an integer") -> int:
    if not _is_int(value):
        raise CaptureOptionError(f"{name}: expected {what}, got {shown(value)}")
    return int(value)


def _int_list(name: str, value: Any, what: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise CaptureOptionError(f"{name}: expected a list of {what}, got {shown(value)}")
    return [_int(name, v, f"a list of {what}") for v in value]


def _reducers(name: str, value: Any, server_reducers: tuple[str, ...]) -> tuple[str, ...]:
    declared = f"this server declares {', '.join(repr(r) for r in server_reducers)}" if server_reducers else \
        "this server declares none"
    if not isinstance(value, (list, tuple)) or not value:
        raise CaptureOptionError(f"{name}: expected a non-empty list of reducer names, got {shown(value)}; {declared}")
    for r in value:
        if r not in server_reducers:
            raise CaptureOptionError(f"{name}: unknown reducer {shown(r)}; {declared}")
    return tuple(sorted(set(value)))


def parse_options(
    opts: Mapping[str, Any], server_layers: tuple[int, ...], vocab_size: int | None,
    name: Callable[[str], str], source: str = SOURCE_CLIENT, server_reducers: tuple[str, ...] = (),
) -> CaptureSpec:
    """A spec from options keyed by SPEC_FIELDS (absent ones take their defaults). `name(field)`
    is how errors name an option ('tap_layers', 'vllm_tap.policy.layers'). With reducers, logits and
    layers default to none: a capture of a probe's scores is only them unless it asks for more."""
    reducers = _reducers(name("reducers"), opts["reducers"], server_reducers) if "reducers" in opts else ()
    logits = _enum(name("logits"), opts.get("logits", "none" if reducers else "full"), LogitsMode)
    topk = 0
    indices: tuple[int, ...] = ()
    if logits == LogitsMode.TOPK:
        if "topk" not in opts:
            raise CaptureOptionError(f"{name('topk')}: required with {name('logits')}='topk' (an integer k >= 1)")
        topk = _int(name("topk"), opts["topk"])
        hi = vocab_size or _MAX_ID - 1
        if not 1 <= topk <= hi:
            raise CaptureOptionError(f"{name('topk')}: {shown(topk)} outside 1..{hi} (the vocabulary size)")
    elif "topk" in opts:
        raise CaptureOptionError(f"{name('topk')}: only allowed with {name('logits')}='topk'")
    if logits == LogitsMode.INDICES:
        if "indices" not in opts:
            raise CaptureOptionError(f"{name('indices')}: required with {name('logits')}='indices' (a list of token ids)")
        raw_idx = opts["indices"]
        if isinstance(raw_idx, (list, tuple)) and len(raw_idx) > MAX_INDICES:
            raise CaptureOptionError(f"{name('indices')}: {len(raw_idx)} token ids; at most {MAX_INDICES} per capture")
        idx = _int_list(name("indices"), raw_idx, "token ids")
        if not idx:
            raise CaptureOptionError(f"{name('indices')}: must name at least one token id")
        hi = vocab_size or _MAX_ID
        bad = [i for i in idx if not 0 <= i < hi]
        if bad:
            raise CaptureOptionError(f"{name('indices')}: token id {shown(bad[0])} outside 0..{hi - 1} (the vocabulary)")
        indices = tuple(idx)
    elif "indices" in opts:
        raise CaptureOptionError(f"{name('indices')}: only allowed with {name('logits')}='indices'")
    layers_raw = opts.get("layers", "none" if reducers else "all")
    exposed = f"'all', 'none' or a list of the layer numbers this server exposes {list(server_layers)}"
    if isinstance(layers_raw, str):
        if layers_raw not in ("all", "none"):
            raise CaptureOptionError(f"{name('layers')}: got {shown(layers_raw)}; allowed: {exposed}")
        layers = server_layers if layers_raw == "all" else ()
    else:
        if not isinstance(layers_raw, (list, tuple)):
            raise CaptureOptionError(f"{name('layers')}: got {shown(layers_raw)}; allowed: {exposed}")
        listed = _int_list(name("layers"), layers_raw, "layer numbers")
        if not listed:
            raise CaptureOptionError(f"{name('layers')}: an empty list; allowed: {exposed}")
        layers = tuple(sorted(set(listed)))
        bad = [x for x in layers if x not in server_layers]
        if bad:
            raise CaptureOptionError(f"{name('layers')}: layer {shown(bad[0])} is not exposed by this server; allowed: {exposed}")
    try:
        positions = Window.parse(opts.get("positions", "all"))
    except ValueError as e:
        raise CaptureOptionError(f"{name('positions')}: {e}") from None
    dtype = _enum(name("dtype"), opts.get("dtype", "auto"), DTypeMode)
    key = opts.get("key", "")
    if not isinstance(key, str) or len(key) > MAX_KEY_CHARS or "\x00" in key:
        raise CaptureOptionError(f"{name('key')}: expected a string of at most {MAX_KEY_CHARS} characters, got {shown(key)}")
    if logits == LogitsMode.NONE and not layers and not reducers:
        raise CaptureOptionError(f"{name('logits')}: 'none' with no layers captures nothing; ask for logits or {name('layers')}")
    spec = CaptureSpec(logits, topk, indices, layers, positions, dtype, key, source, reducers)
    size = len(msgspec.msgpack.encode(spec.to_meta()))
    if size > MAX_SPEC_BYTES:  # the bounds above keep it far below; a reader would refuse the capture
        raise CaptureOptionError(f"{name('indices' if indices else 'layers')}: the capture spec would take {size} "
                                 f"bytes; at most {MAX_SPEC_BYTES}")
    return spec


def _unknown_option(key: str) -> CaptureOptionError:
    near = difflib.get_close_matches(key.lower(), list(OPTIONS), n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return CaptureOptionError(f"{shown(key)[1:-1]}: unknown capture option{hint}; allowed: {', '.join(OPTIONS)}")


def client_options(extra_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The request's tap* options by key, after checking every key is one the tap knows."""
    if not extra_args:
        return {}
    opts = {k: v for k, v in extra_args.items() if is_option_key(k)}
    for k in sorted(opts):
        if k not in OPTIONS:
            raise _unknown_option(k)
    return opts


def opts_out(opts: Mapping[str, Any]) -> bool:
    """`{"tap": 0}` alone: the request asks not to be captured (policy included). Callers have
    validated opts with parse_capture_spec or client_options."""
    return set(opts) == {"tap"} and opts["tap"] == 0


def parse_capture_spec(
    extra_args: Mapping[str, Any] | None, server: "ServerCaptureConfig", vocab_size: int | None
) -> CaptureSpec | None:
    """The request's own spec; None if it did not opt in (or sent tap: 0 alone). CaptureOptionError
    for any bad option."""
    opts = client_options(extra_args)
    if not opts:
        return None
    if "tap" in opts:
        on = opts["tap"]
        if not _is_int(on) and not isinstance(on, bool) or on not in (0, 1):
            raise CaptureOptionError(f"tap: got {shown(on)}; allowed: 1 (or true) to capture, 0 (or false) alone to not")
        if on == 0:
            if len(opts) > 1:
                raise CaptureOptionError(f"tap: 0 (do not capture) together with {sorted(opts)[1]}; send one or the other")
            return None
    return parse_options({k[4:]: v for k, v in opts.items() if k != "tap"}, server.layers, vocab_size,
                         lambda f: f"tap_{f}", SOURCE_CLIENT, server.reducer_names)


# -- server settings --

CLIENT_PRECEDENCE = {
    "wins": "a request's own tap* options override the policy for it, and tap: 0 keeps it out",
    "loses": "a request the policy selects is captured with the policy's spec whatever it sends",
    "refused": "requests may not send tap* options (HTTP 400); only the policy captures",
}


@dataclass(frozen=True)
class CapturePolicy:
    """Capture a share of all requests, chosen by a hash of the request id (vllm_tap.policy)."""

    share: float
    spec: CaptureSpec  # source "policy"
    client: str = "wins"  # CLIENT_PRECEDENCE


@dataclass(frozen=True)
class ServerCaptureConfig:
    """Server-wide tap settings from `--additional-config '{"vllm_tap": {...}}'`."""

    layers: tuple[int, ...] = ()  # hidden-state layers made available (0 = embeddings)
    instance: str = "default"
    shm_dir: str = DEFAULT_SHM_DIR
    ring_bytes: int = DEFAULT_RING_BYTES
    group: str | None = None
    block_timeout_s: float = 0.0  # >0: wait up to this long for ring space instead of dropping
    policy: CapturePolicy | None = None
    # ring_bytes was not set: the API process sizes the rings from what it can capture (hooks/ring_size.py)
    # and writes the size back into the settings, so every process opens rings of one size.
    ring_auto: bool = False
    steps_per_s: float = DEFAULT_STEPS_PER_S  # decode steps a second the operator expects (ring sizing)
    shed_at: float = DEFAULT_SHED_AT  # share of a worker's ring unread above which new captures are shed
    reducers: tuple[ReducerDecl, ...] = ()  # probes and SAE encoders requests may name (vllm_tap.reducers)

    @property
    def reducer_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.reducers)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The layers whose hidden states the workers compute as extra outputs: those requests may
        capture, and those a reducer reads."""
        return tuple(sorted(set(self.layers) | {r.layer for r in self.reducers}))

    @classmethod
    def from_additional_config(
        cls, additional: dict[str, Any] | None, num_layers: int | None = None, vocab_size: int | None = None,
    ) -> "ServerCaptureConfig | None":
        """None when the tap is not enabled; raises CaptureOptionError on bad settings."""
        if not additional or SERVER_CONFIG_KEY not in additional:
            return None
        raw = additional[SERVER_CONFIG_KEY]
        if raw is None or raw is False:
            return None
        if raw is True:
            raw = {}
        if not isinstance(raw, dict):
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}: expected an object of settings, got {shown(raw)}")
        known = {"layers", "instance", "shm_dir", "ring_bytes", "group", "block_timeout_s", "policy", "steps_per_s",
                 "shed_at", "reducers"}
        unknown = sorted(set(raw) - known, key=str)
        if unknown:
            raise CaptureOptionError(
                f"{SERVER_CONFIG_KEY}: unknown setting {shown(unknown[0])}; allowed: {', '.join(sorted(known))}"
            )
        layers_raw = raw.get("layers", "all")
        if layers_raw == "all":
            if num_layers is None:
                layers: tuple[int, ...] = ()
            else:
                layers = tuple(range(num_layers + 1))
        elif layers_raw in ("none", None):
            layers = ()
        elif isinstance(layers_raw, list) and all(_is_int(x) for x in layers_raw):
            layers = tuple(sorted(set(layers_raw)))
        else:
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.layers: expected 'all', 'none' or a list of ints, got {shown(layers_raw)}")
        if num_layers is not None:
            bad = [x for x in layers if not 0 <= x <= num_layers]
            if bad:
                raise CaptureOptionError(
                    f"{SERVER_CONFIG_KEY}.layers: layer {bad[0]} out of range 0..{num_layers} "
                    f"(0 = embeddings, i = output of decoder layer i)"
                )
        instance = raw.get("instance", "default")
        if not isinstance(instance, str) or not instance or "/" in instance or instance.startswith("."):
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.instance: expected a plain name, got {shown(instance)}")
        ring_auto = raw.get("ring_bytes") is None
        ring_bytes = DEFAULT_RING_BYTES if ring_auto else raw["ring_bytes"]
        if not _is_int(ring_bytes) or ring_bytes < 1 << 16:
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.ring_bytes: expected an int >= 65536, got {shown(ring_bytes)}")
        ring_bytes -= ring_bytes % 64
        shm_dir = raw.get("shm_dir", DEFAULT_SHM_DIR)
        if not isinstance(shm_dir, str) or not shm_dir.startswith("/"):
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.shm_dir: expected an absolute path, got {shown(shm_dir)}")
        group = raw.get("group")
        if group is not None and not isinstance(group, str):
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.group: expected a group name, got {shown(group)}")
        block = raw.get("block_timeout_s", 0.0)
        if not isinstance(block, (int, float)) or isinstance(block, bool) or block < 0:
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.block_timeout_s: expected seconds >= 0, got {shown(block)}")
        try:
            reducers = parse_reducers(raw.get("reducers"), f"{SERVER_CONFIG_KEY}.reducers", num_layers)
        except ReducerSettingError as e:
            raise CaptureOptionError(str(e)) from None
        policy = _parse_policy(raw["policy"], layers, vocab_size, tuple(r.name for r in reducers)) \
            if raw.get("policy") is not None else None
        steps = raw.get("steps_per_s", DEFAULT_STEPS_PER_S)
        if not isinstance(steps, (int, float)) or isinstance(steps, bool) or not 1 <= steps <= 1e6:
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.steps_per_s: expected decode steps a second from 1 to 1e6, "
                                     f"got {shown(steps)}")
        shed_at = raw.get("shed_at", DEFAULT_SHED_AT)
        if not isinstance(shed_at, (int, float)) or isinstance(shed_at, bool) or not 0 < shed_at <= 1:
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.shed_at: expected a share of the ring above 0 and at most 1, "
                                     f"got {shown(shed_at)}")
        return cls(layers, instance, shm_dir, ring_bytes, group, float(block), policy, ring_auto, float(steps),
                   float(shed_at), reducers)


def _parse_policy(raw: Any, layers: tuple[int, ...], vocab_size: int | None,
                  reducers: tuple[str, ...] = ()) -> CapturePolicy:
    where = f"{SERVER_CONFIG_KEY}.policy"
    if not isinstance(raw, dict):
        raise CaptureOptionError(f"{where}: expected an object of settings (share, client, {', '.join(SPEC_FIELDS)}), got {shown(raw)}")
    known = ("share", "client", *SPEC_FIELDS)
    unknown = sorted(set(raw) - set(known), key=str)
    if unknown:
        raise CaptureOptionError(f"{where}: unknown setting {shown(unknown[0])}; allowed: {', '.join(known)}")
    if "share" not in raw:
        raise CaptureOptionError(f"{where}.share: required (the share of requests to capture, 0..1)")
    share = raw["share"]
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise CaptureOptionError(f"{where}.share: expected a number from 0 to 1, got {shown(share)}")
    client = raw.get("client", "wins")
    if client not in CLIENT_PRECEDENCE:
        raise CaptureOptionError(f"{where}.client: got {shown(client)}; allowed: {', '.join(repr(c) for c in CLIENT_PRECEDENCE)}")
    spec = parse_options({k: v for k, v in raw.items() if k in SPEC_FIELDS}, layers, vocab_size,
                         lambda f: f"{where}.{f}", SOURCE_POLICY, reducers)
    return CapturePolicy(float(share), spec, client)


__all__ = [
    "CaptureOptionError", "CapturePolicy", "CaptureSpec", "DTypeMode", "LogitsMode", "OPTIONS", "PositionsMode",
    "ServerCaptureConfig", "SOURCE_CLIENT", "SOURCE_POLICY", "UNBOUNDED", "Window", "parse_capture_spec",
    "wants_capture",
]
