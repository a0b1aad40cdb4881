"""The on-storage dataset format written by `vllm-tap record` and read by the dataset readers.

docs/dataset-format.md is the normative description; this module is its one implementation: names,
version, row and capture schemas, the manifest record, shard naming. It imports pyarrow lazily so the
core stays importable without it; msgspec decodes manifests, which are untrusted bytes.

    DEST/                                    a directory or any fsspec URL (s3://bucket/prefix, ...)
      writers/{writer}/manifest.json         what this writer committed (replaced atomically)
      writers/{writer}/rows/{writer}-{index:06d}.parquet       token rows   (or .arrow)
      writers/{writer}/captures/{writer}-{index:06d}.parquet   one row per capture part in the shard

Rules kept here:
- One writer owns `writers/{writer}/`: nothing else writes there, so several hosts never collide and
  the writer may delete files of its own that no manifest lists (leftovers of a crash).
- A file is visible under its final name only when complete; the manifest lists only such files; a
  reader that follows the manifests never sees a partial or orphaned shard.
- `committed_seq` in a manifest: every capture with seq <= it is in a listed shard, reported lost,
  skipped with a reason, or was filtered out. `resume` (seq, position) says that the capture `seq`
  continues in the next shard from `position` (a capture too large for one shard).
- A change to a column's meaning or type bumps FORMAT_VERSION; readers refuse versions they do not know.
"""

from __future__ import annotations

import re
import socket
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

FORMAT_NAME = "vllm-tap-dataset"
FORMAT_VERSION = 2  # 2: reducer columns (the layout's `reducers`)
READABLE_VERSIONS = (1, 2)  # a version-1 dataset is a version-2 one without reducers

MANIFEST_NAME = "manifest.json"
WRITERS_DIR = "writers"
ROWS_DIR = "rows"
CAPTURES_DIR = "captures"

PARQUET = "parquet"
ARROW = "arrow"  # Arrow IPC file format
FILE_FORMATS = (PARQUET, ARROW)

# Shards roll at DEFAULT_SHARD_BYTES and are never larger than MAX_SHARD_BYTES (HF datasets' limit for
# one Arrow file is 2 GB; staying under it keeps every shard loadable as one table).
DEFAULT_SHARD_BYTES = 1 << 30
MAX_SHARD_BYTES = 2_000_000_000

# -- per-row columns, in file order (the tensor columns follow) --
COL_WRITER = "writer"
COL_SEQ = "seq"
COL_REQUEST_ID = "request_id"
COL_INSTANCE = "instance"
COL_MODEL = "model"
COL_SOURCE = "source"
COL_TAP_KEY = "tap_key"
COL_POSITION = "position"
COL_TOKEN_ID = "token_id"
COL_NEXT_TOKEN_ID = "next_token_id"  # the token at position+1 (what the logits here predict); -1 unknown
COL_PHASE = "phase"  # "prompt" (position < prompt length) or "output"
KEY_COLUMNS = (COL_WRITER, COL_SEQ, COL_REQUEST_ID, COL_INSTANCE, COL_MODEL, COL_SOURCE, COL_TAP_KEY, COL_POSITION,
               COL_TOKEN_ID, COL_NEXT_TOKEN_ID, COL_PHASE)

# -- logits columns: one of three forms, plus the row's logsumexp --
COL_LOGITS = "logits"  # full row [V]
COL_TOPK_IDS = "topk_ids"  # [k] int32, by logit descending
COL_TOPK_LOGITS = "topk_logits"  # [k] raw logits at topk_ids
COL_CHOSEN_LOGITS = "chosen_logits"  # [m] raw logits at the dataset's chosen ids (metadata.logits.indices)
COL_LOGSUMEXP = "logsumexp"  # float32: logprob(t) = logit(t) - logsumexp; null when the capture lacks it

# -- reducer columns (vllm_tap.reducers), per reducer NAME, after the logits columns --
REDUCED_PREFIX = "reduced."  # reduced.NAME: a probe's scores [k] float32
# reduced.NAME.ids / reduced.NAME.values: an SAE's active latents, most active first, as variable-length
# lists of int32 ids and float32 activations (the slots the server wrote -1 in are left out)
REDUCED_PROBE = "probe"
REDUCED_LATENTS = "latents"

LOGITS_FULL = "full"
LOGITS_TOPK = "topk"
LOGITS_INDICES = "indices"
LOGITS_NONE = "none"

EMBED_HOOK = "blocks.0.hook_resid_pre"
_HOOK_RE = re.compile(r"^blocks\.(\d+)\.hook_resid_(pre|post)$")
_WRITER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def hook_name(layer: int) -> str:
    """TransformerLens name of vllm-tap layer `layer` (0 = embeddings, i = output of decoder layer i).

    Layer 0 is the residual stream entering block 0 (`blocks.0.hook_resid_pre`, which is `hook_embed`
    for models with rotary positions); layer i >= 1 is `blocks.{i-1}.hook_resid_post`. The last
    layer is, as in TransformerLens, before the final norm.
    """
    if layer < 0:
        raise ValueError(f"layer {layer}: must be >= 0")
    return EMBED_HOOK if layer == 0 else f"blocks.{layer - 1}.hook_resid_post"


def layer_of(name: str) -> int:
    """Inverse of hook_name; also accepts `blocks.{i}.hook_resid_pre` (= layer i)."""
    m = _HOOK_RE.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a residual-stream column (blocks.N.hook_resid_post or blocks.0.hook_resid_pre)")
    i = int(m.group(1))
    return i if m.group(2) == "pre" else i + 1


def check_writer_id(writer: str) -> str:
    if not _WRITER_RE.match(writer):
        raise ValueError(f"writer id {writer!r}: use 1-128 characters from A-Z a-z 0-9 . _ - (not starting with . _ -)")
    return writer


def default_writer_id() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).lstrip("._-") or "host"
    return host[:128]


def shard_name(writer: str, index: int, file_format: str) -> str:
    ext = "parquet" if file_format == PARQUET else "arrow"
    return f"{writer}-{index:06d}.{ext}"


def writer_dir(writer: str) -> str:
    return f"{WRITERS_DIR}/{writer}"


def rows_path(writer: str, name: str) -> str:
    return f"{WRITERS_DIR}/{writer}/{ROWS_DIR}/{name}"


def captures_path(writer: str, name: str) -> str:
    return f"{WRITERS_DIR}/{writer}/{CAPTURES_DIR}/{name}"


def manifest_path(writer: str) -> str:
    return f"{WRITERS_DIR}/{writer}/{MANIFEST_NAME}"


# -- the dataset's tensor layout (fixed when the dataset is created) --


class LogitsLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: str = LOGITS_NONE  # full | topk | indices | none
    width: int = 0  # V for full, k for topk, len(indices) for indices
    indices: list[int] = []  # the chosen token ids (kind == indices)


class ReducedLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: str  # probe | latents
    width: int  # a probe's scores; an SAE's latent slots per token (the most a row's lists hold)


def reduced_columns(name: str, kind: str) -> list[str]:
    base = REDUCED_PREFIX + name
    return [base] if kind == REDUCED_PROBE else [f"{base}.ids", f"{base}.values"]


class TensorLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which tensor columns every row of the dataset has, and their sizes and value type."""

    layers: dict[str, int] = {}  # hook column name -> hidden size
    logits: LogitsLayout = LogitsLayout()
    dtype: str = "float32"  # value type of hidden and logit columns: float32 or float16
    reducers: dict[str, ReducedLayout] = {}  # reducer name -> its output (format 2)

    def layer_numbers(self) -> list[int]:
        return sorted(layer_of(n) for n in self.layers)

    def describe(self) -> str:
        parts = [f"{n}[{h}]" for n, h in sorted(self.layers.items(), key=lambda kv: layer_of(kv[0]))]
        if self.logits.kind != LOGITS_NONE:
            parts.append(f"logits {self.logits.kind}[{self.logits.width}]")
        parts += [f"{REDUCED_PREFIX}{n} {r.kind}[{r.width}]" for n, r in sorted(self.reducers.items())]
        return ", ".join(parts) + f" ({self.dtype})"


def row_schema(layout: TensorLayout) -> "pa.Schema":
    import pyarrow as pa

    value = pa.float16() if layout.dtype == "float16" else pa.float32()
    fields = [
        pa.field(COL_WRITER, pa.string(), nullable=False),
        pa.field(COL_SEQ, pa.int64(), nullable=False),
        pa.field(COL_REQUEST_ID, pa.string(), nullable=False),
        pa.field(COL_INSTANCE, pa.string(), nullable=False),
        pa.field(COL_MODEL, pa.string(), nullable=False),
        pa.field(COL_SOURCE, pa.string(), nullable=False),
        pa.field(COL_TAP_KEY, pa.string(), nullable=False),
        pa.field(COL_POSITION, pa.int32(), nullable=False),
        pa.field(COL_TOKEN_ID, pa.int32(), nullable=False),
        pa.field(COL_NEXT_TOKEN_ID, pa.int32(), nullable=False),
        pa.field(COL_PHASE, pa.string(), nullable=False),
    ]
    for layer in layout.layer_numbers():
        name = hook_name(layer)
        fields.append(pa.field(name, pa.list_(value, layout.layers[name]), nullable=False))
    k, w = layout.logits.kind, layout.logits.width
    if k == LOGITS_FULL:
        fields.append(pa.field(COL_LOGITS, pa.list_(value, w), nullable=False))
    elif k == LOGITS_TOPK:
        fields.append(pa.field(COL_TOPK_IDS, pa.list_(pa.int32(), w), nullable=False))
        fields.append(pa.field(COL_TOPK_LOGITS, pa.list_(value, w), nullable=False))
    elif k == LOGITS_INDICES:
        fields.append(pa.field(COL_CHOSEN_LOGITS, pa.list_(value, w), nullable=False))
    if k != LOGITS_NONE:
        fields.append(pa.field(COL_LOGSUMEXP, pa.float32(), nullable=True))
    for name, r in sorted(layout.reducers.items()):
        cols = reduced_columns(name, r.kind)
        if r.kind == REDUCED_PROBE:
            fields.append(pa.field(cols[0], pa.list_(pa.float32(), r.width), nullable=False))
        else:
            fields.append(pa.field(cols[0], pa.list_(pa.int32()), nullable=False))
            fields.append(pa.field(cols[1], pa.list_(pa.float32()), nullable=False))
    return pa.schema(fields, metadata={b"vllm_tap.format": FORMAT_NAME.encode(),
                                       b"vllm_tap.format_version": str(FORMAT_VERSION).encode()})


def capture_schema() -> "pa.Schema":
    """One row per capture part in a shard (a capture split over shards has one part in each)."""
    import pyarrow as pa

    return pa.schema([
        pa.field(COL_WRITER, pa.string(), nullable=False),
        pa.field(COL_SEQ, pa.int64(), nullable=False),
        pa.field(COL_REQUEST_ID, pa.string(), nullable=False),
        pa.field(COL_INSTANCE, pa.string(), nullable=False),
        pa.field(COL_MODEL, pa.string(), nullable=False),
        pa.field(COL_SOURCE, pa.string(), nullable=False),
        pa.field(COL_TAP_KEY, pa.string(), nullable=False),
        pa.field("response_id", pa.string(), nullable=False),
        pa.field("choice_index", pa.int32(), nullable=False),
        pa.field("num_prompt_tokens", pa.int32(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=True),  # null when the daemon missed it
        pa.field("output_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("expected_start", pa.int32(), nullable=True),  # [start, stop) of positions that should exist
        pa.field("expected_stop", pa.int32(), nullable=True),
        pa.field("missing_positions", pa.list_(pa.int32()), nullable=False),
        pa.field("part_first_position", pa.int32(), nullable=True),  # the rows of this capture in this shard
        pa.field("part_rows", pa.int64(), nullable=False),
        pa.field("last_part", pa.bool_(), nullable=False),
        pa.field("spec", pa.string(), nullable=False),  # the capture spec as JSON
    ], metadata={b"vllm_tap.format": FORMAT_NAME.encode(), b"vllm_tap.format_version": str(FORMAT_VERSION).encode()})


# -- the manifest --


# The reason of a missing range the stream named no reason for (the daemon's END listed the positions
# as missing but no gap message came for them). Every other reason is the daemon's (daemon/reassembly.py:
# "dropped", "incomplete", "timeout", "not captured", ...) or the recorder's own (skipped captures).
GAP_NO_REASON = "missing"


class GapEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Positions of capture `seq` that are not in the dataset, and why."""

    seq: int
    request_id: str
    start: int  # [start, stop)
    stop: int
    reason: str


class LostEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Captures first..last (inclusive) that the daemon no longer had, or that could not be recorded."""

    first: int
    last: int
    reason: str


class ShardEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str  # file name under rows/ and captures/
    rows: int
    bytes: int  # size of the rows file
    sha256: str  # of the rows file
    captures: int  # rows of the captures file (capture parts)
    captures_bytes: int
    captures_sha256: str
    seq_first: int
    seq_last: int
    created: float  # unix time of the commit
    gaps: list[GapEntry] = []


class Manifest(msgspec.Struct, forbid_unknown_fields=False):
    """One writer's committed state. Unknown fields are kept by readers of a newer minor writer."""

    format: str
    format_version: int
    writer: str
    host: str
    file_format: str
    layout: TensorLayout
    generation: int = 0  # +1 per replacement
    committed_seq: int = -1
    resume_seq: int = -1  # >= 0: capture resume_seq continues in the next shard from resume_position
    resume_position: int = 0
    created: float = 0.0
    updated: float = 0.0
    metadata: dict[str, Any] = {}  # model(s), vllm_version, capture spec/policy, filters, daemon, ...
    shards: list[ShardEntry] = []
    lost: list[LostEntry] = []
    skipped: list[GapEntry] = []  # whole captures not recorded, with the reason (e.g. a different spec)
    next_index: int = 0

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes + s.captures_bytes for s in self.shards)


_manifest_decoder = msgspec.json.Decoder(Manifest)


class ManifestError(ValueError):
    """A manifest that cannot be used: malformed, another format, or a version this code does not know."""


def decode_manifest(data: bytes, where: str = "manifest") -> Manifest:
    try:
        m = _manifest_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ManifestError(f"{where}: not a vllm-tap manifest ({e})") from None
    if m.format != FORMAT_NAME:
        raise ManifestError(f"{where}: format {m.format!r} is not {FORMAT_NAME!r}")
    if m.format_version not in READABLE_VERSIONS:
        raise ManifestError(f"{where}: format version {m.format_version}; this vllm-tap reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}")
    if m.file_format not in FILE_FORMATS:
        raise ManifestError(f"{where}: file_format {m.file_format!r} is not one of {', '.join(FILE_FORMATS)}")
    return m


def encode_manifest(m: Manifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(m), indent=1)
