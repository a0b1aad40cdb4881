"""What to capture: the server-wide settings and the per-request capture spec.

Per-request options arrive as `SamplingParams.extra_args` (the OpenAI API's `vllm_xargs`), whose
values are only str, int, float or lists of those (JSON `true` arrives as 1). Every option key
starts with `tap`; a request opts in by carrying any of them. Parsing is pure so the API process
(validation, HTTP 400), the worker (selection) and the daemon (expected positions) agree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable

from vllm_tap.ring import DEFAULT_SHM_DIR


class CaptureOptionError(ValueError):
    """A capture option is invalid; the message names the option and what is allowed."""


class LogitsMode(str, enum.Enum):
    FULL = "full"
    NONE = "none"
    TOPK = "topk"
    INDICES = "indices"


class PositionsMode(str, enum.Enum):
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

SERVER_CONFIG_KEY = "vllm_tap"  # --additional-config '{"vllm_tap": {...}}'
DEFAULT_RING_BYTES = 256 << 20


@dataclass(frozen=True)
class ServerCaptureConfig:
    """Server-wide tap settings from `--additional-config '{"vllm_tap": {...}}'`."""

    layers: tuple[int, ...] = ()  # hidden-state layers made available (0 = embeddings)
    instance: str = "default"
    shm_dir: str = DEFAULT_SHM_DIR
    ring_bytes: int = DEFAULT_RING_BYTES
    group: str | None = None
    block_timeout_s: float = 0.0  # >0: wait up to this long for ring space instead of dropping

    @classmethod
    def from_additional_config(cls, additional: dict[str, Any] | None, num_layers: int | None = None) -> "ServerCaptureConfig | None":
        """None when the tap is not enabled; raises CaptureOptionError on bad settings."""
        if not additional or SERVER_CONFIG_KEY not in additional:
            return None
        raw = additional[SERVER_CONFIG_KEY]
        if raw is None or raw is False:
            return None
        if raw is True:
            raw = {}
        if not isinstance(raw, dict):
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}: expected an object of settings, got {raw!r}")
        known = {"layers", "instance", "shm_dir", "ring_bytes", "group", "block_timeout_s"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise CaptureOptionError(
                f"{SERVER_CONFIG_KEY}: unknown setting {unknown[0]!r}; allowed: {', '.join(sorted(known))}"
            )
        layers_raw = raw.get("layers", "all")
        if layers_raw == "all":
            if num_layers is None:
                layers: tuple[int, ...] = ()
            else:
                layers = tuple(range(num_layers + 1))
        elif layers_raw in ("none", None):
            layers = ()
        elif isinstance(layers_raw, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in layers_raw):
            layers = tuple(sorted(set(layers_raw)))
        else:
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.layers: expected 'all', 'none' or a list of ints, got {layers_raw!r}")
        if num_layers is not None:
            bad = [x for x in layers if not 0 <= x <= num_layers]
            if bad:
                raise CaptureOptionError(
                    f"{SERVER_CONFIG_KEY}.layers: layer {bad[0]} out of range 0..{num_layers} "
                    f"(0 = embeddings, i = output of decoder layer i)"
                )
        instance = raw.get("instance", "default")
        if not isinstance(instance, str) or not instance or "/" in instance or instance.startswith("."):
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.instance: expected a plain name, got {instance!r}")
        ring_bytes = raw.get("ring_bytes", DEFAULT_RING_BYTES)
        if not isinstance(ring_bytes, int) or ring_bytes < 1 << 16:
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.ring_bytes: expected an int >= 65536, got {ring_bytes!r}")
        ring_bytes -= ring_bytes % 64
        shm_dir = raw.get("shm_dir", DEFAULT_SHM_DIR)
        if not isinstance(shm_dir, str) or not shm_dir.startswith("/"):
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.shm_dir: expected an absolute path, got {shm_dir!r}")
        group = raw.get("group")
        if group is not None and not isinstance(group, str):
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.group: expected a group name, got {group!r}")
        block = raw.get("block_timeout_s", 0.0)
        if not isinstance(block, (int, float)) or isinstance(block, bool) or block < 0:
            raise CaptureOptionError(f"{SERVER_CONFIG_KEY}.block_timeout_s: expected seconds >= 0, got {block!r}")
        return cls(layers, instance, shm_dir, ring_bytes, group, float(block))


@dataclass(frozen=True)
class CaptureSpec:
    """One request's capture options, normalised."""

    logits: LogitsMode = LogitsMode.FULL
    topk: int = 0
    indices: tuple[int, ...] = ()
    layers: tuple[int, ...] = ()
    positions: PositionsMode = PositionsMode.ALL
    dtype: DTypeMode = DTypeMode.AUTO
    key: str = ""
    source: str = "client"  # SOURCE_CLIENT: the request opted in; SOURCE_POLICY: the server's policy chose it

    # -- which positions --

    @property
    def tail(self) -> int:
        """N > 0 when the capture is the last N computed positions: its start is known only at the
        end, so workers capture more and the daemon keeps the last N. 0 otherwise."""
        return 1 if self.positions == PositionsMode.LAST_OUTPUT else 0

    def first_position(self, num_prompt: int) -> int | None:
        """The first expected position when it is known before the request ends, else None."""
        if self.tail:
            return None
        return self.position_range(num_prompt, 1 << 62)[0]

    def position_range(self, num_prompt: int, end: int) -> tuple[int, int]:
        """[start, stop) of captured positions for a request whose computed positions are [0, end)."""
        p = self.positions
        if p == PositionsMode.ALL:
            return 0, end
        if p == PositionsMode.PROMPT:
            return 0, min(num_prompt, end)
        if p == PositionsMode.OUTPUT:
            return max(num_prompt - 1, 0), end
        if p == PositionsMode.LAST_PROMPT:
            return max(num_prompt - 1, 0), min(num_prompt, end)
        return max(end - 1, 0), end  # LAST_OUTPUT

    def live_range(self, num_prompt: int) -> tuple[int, int]:
        """[start, stop) of positions a worker captures while the request runs.

        The end of a request is unknown while it runs, so LAST_OUTPUT captures every output
        position and the daemon keeps only the last one once the END says which it is.
        """
        unbounded = 1 << 62
        p = self.positions
        if p == PositionsMode.ALL:
            return 0, unbounded
        if p == PositionsMode.PROMPT:
            return 0, num_prompt
        if p == PositionsMode.LAST_PROMPT:
            return max(num_prompt - 1, 0), num_prompt
        return max(num_prompt - 1, 0), unbounded

    @property
    def wants_prompt_rows(self) -> bool:
        """Whether positions before P-1 are captured (needs the prefix cache bypassed)."""
        return self.positions in (PositionsMode.ALL, PositionsMode.PROMPT)

    # -- serialisation into BEGIN records --

    def to_meta(self) -> dict[str, Any]:
        return {
            "logits": self.logits.value, "topk": self.topk, "indices": list(self.indices),
            "layers": list(self.layers), "positions": self.positions.value, "dtype": self.dtype.value,
            "key": self.key, "source": self.source,
        }

    @classmethod
    def from_meta(cls, m: dict[str, Any]) -> "CaptureSpec":
        return cls(
            LogitsMode(m["logits"]), int(m["topk"]), tuple(m["indices"]), tuple(m["layers"]),
            PositionsMode(m["positions"]), DTypeMode(m["dtype"]), m.get("key", ""), m.get("source", SOURCE_CLIENT),
        )


OPTION_PREFIX = "tap"
OPTIONS = {
    "tap": "1 to capture with the defaults (any other tap_* option also opts in)",
    "tap_logits": "'full' | 'none' | 'topk' | 'indices'",
    "tap_topk": "k for tap_logits='topk' (1..vocab size)",
    "tap_indices": "list of token ids for tap_logits='indices'",
    "tap_layers": "'all' | 'none' | a layer number | a list of layer numbers the server exposes",
    "tap_positions": "'all' | 'prompt' | 'output' | 'last_prompt' | 'last_output'",
    "tap_dtype": "'auto' | 'float32'",
    "tap_key": "a string of your choosing to subscribe by",
}


def _enum(name: str, value: Any, enum_cls: type[enum.Enum]) -> Any:
    allowed = [e.value for e in enum_cls]
    if not isinstance(value, str) or value not in allowed:
        raise CaptureOptionError(f"{name}: got {value!r}; allowed: {', '.join(allowed)}")
    return enum_cls(value)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise CaptureOptionError(f"{name}: expected an integer, got {value!r}")
    return value


def _int_list(name: str, value: Any) -> list[int]:
    items: Iterable[Any] = value if isinstance(value, list) else [value]
    return [_int(name, v) for v in items]


def wants_capture(extra_args: dict[str, Any] | None) -> bool:
    return bool(extra_args) and any(k == OPTION_PREFIX or k.startswith(OPTION_PREFIX + "_") for k in extra_args)


def parse_capture_spec(
    extra_args: dict[str, Any] | None, server: ServerCaptureConfig, vocab_size: int | None
) -> CaptureSpec | None:
    """The request's spec, None if it did not opt in; CaptureOptionError for any bad option."""
    if not wants_capture(extra_args):
        return None
    assert extra_args is not None
    opts = {k: v for k, v in extra_args.items() if k == OPTION_PREFIX or k.startswith(OPTION_PREFIX + "_")}
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise CaptureOptionError(f"{unknown[0]}: unknown capture option; allowed: {', '.join(OPTIONS)}")
    if "tap" in opts:
        on = opts["tap"]
        if on in (0, "0", "false", False) and len(opts) == 1:
            return None
        if on not in (1, "1", "true", True, 0, "0", "false", False):
            raise CaptureOptionError(f"tap: got {on!r}; allowed: 1 (or true) to capture, 0 to not")
    logits = _enum("tap_logits", opts.get("tap_logits", "full"), LogitsMode)
    topk = 0
    indices: tuple[int, ...] = ()
    if logits == LogitsMode.TOPK:
        if "tap_topk" not in opts:
            raise CaptureOptionError("tap_topk: required with tap_logits='topk' (an integer k >= 1)")
        topk = _int("tap_topk", opts["tap_topk"])
        hi = vocab_size if vocab_size else topk
        if not 1 <= topk <= hi:
            raise CaptureOptionError(f"tap_topk: {topk} outside 1..{hi} (the vocabulary size)")
    elif "tap_topk" in opts:
        raise CaptureOptionError("tap_topk: only allowed with tap_logits='topk'")
    if logits == LogitsMode.INDICES:
        if "tap_indices" not in opts:
            raise CaptureOptionError("tap_indices: required with tap_logits='indices' (a list of token ids)")
        idx = _int_list("tap_indices", opts["tap_indices"])
        if not idx:
            raise CaptureOptionError("tap_indices: must name at least one token id")
        if vocab_size:
            bad = [i for i in idx if not 0 <= i < vocab_size]
            if bad:
                raise CaptureOptionError(f"tap_indices: token id {bad[0]} outside 0..{vocab_size - 1} (the vocabulary)")
        indices = tuple(idx)
    elif "tap_indices" in opts:
        raise CaptureOptionError("tap_indices: only allowed with tap_logits='indices'")
    layers_raw = opts.get("tap_layers", "all")
    if layers_raw == "all":
        layers = server.layers
    elif layers_raw == "none":
        layers = ()
    else:
        if isinstance(layers_raw, str):
            raise CaptureOptionError(f"tap_layers: got {layers_raw!r}; allowed: 'all', 'none' or layer numbers {list(server.layers)}")
        layers = tuple(sorted(set(_int_list("tap_layers", layers_raw))))
        bad = [x for x in layers if x not in server.layers]
        if bad:
            raise CaptureOptionError(
                f"tap_layers: layer {bad[0]} is not exposed by this server; allowed: {list(server.layers)}"
            )
    positions = _enum("tap_positions", opts.get("tap_positions", "all"), PositionsMode)
    dtype = _enum("tap_dtype", opts.get("tap_dtype", "auto"), DTypeMode)
    key = opts.get("tap_key", "")
    if not isinstance(key, str) or len(key) > 256 or "\x00" in key:
        raise CaptureOptionError(f"tap_key: expected a string of at most 256 characters, got {key!r}")
    if logits == LogitsMode.NONE and not layers:
        raise CaptureOptionError("tap_logits: 'none' with no layers captures nothing; ask for logits or tap_layers")
    return CaptureSpec(logits, topk, indices, layers, positions, dtype, key)
