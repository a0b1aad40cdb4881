"""The recorder's protocol, without I/O: captures in, rows and shard/manifest actions out.

`RecorderCore` is fed the watch stream (captures in sequence order, lost ranges, watermarks, clock
ticks) and answers with actions that the I/O side (client/datasets/recorder.py) carries out in order:

    AppendRows(table)          add these rows to the open shard (staged on local disk)
    SealShard(...)             the open shard is complete: close it, make its two files visible
                               under their final names, then call `shard_committed(...)`, which
                               returns the manifest to write
    WriteManifest(manifest)    replace the manifest atomically (progress without a new shard)

Rules (docs/dataset-format.md has the format):
- Captures arrive in seq order; one with seq <= the last seen is a duplicate and is dropped.
- The manifest's `committed_seq` never passes a capture whose rows are not all in committed shards:
  it is `handled - 1` below the open shard's first capture, else everything handled. A capture cut
  between two shards (larger than a shard) commits its first part with `resume` = (seq, position);
  after a restart its rows below `position` are skipped, so every (seq, position) is written once.
- Lost ranges, skipped captures and gaps enter the manifest only once `committed_seq` covers them,
  so a restart (which re-reads everything after committed_seq) cannot report them twice.
- Up to `lanes` shards are open at once (a group), so that the I/O side can encode them on as many
  cores: each capture goes whole to the open shard with the fewest bytes, so every shard stays in
  (seq, position) order while the seq ranges of a group's shards interleave. A group is sealed and
  committed as one: all its shards are published before the one manifest that lists them, so
  `committed_seq` never covers a capture of a shard that a crash could leave unlisted.
- A group is sealed before a capture would push its emptiest shard past `shard_bytes` (uncompressed
  Arrow bytes, an upper bound of the file's size up to a small overhead), when it is older than
  `shard_age_s`, and at the end. A capture larger than what is left starts a fresh group and fills
  its shards in index order, continuing into the next group: its parts are in consecutive shards.
- The dataset's tensor layout (layers, logits form, value type) is fixed by the first capture with
  rows, or given up front; a capture that lacks one of its tensors, or carries float32 values for a
  float16 dataset, is skipped and listed with the reason. Tensors beyond the layout are counted.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import numpy as np
import pyarrow as pa

from vllm_tap import dataset_format as df
from vllm_tap.positions import PositionRanges

from ..records import Capture, CaptureBegin, Latents

log = logging.getLogger(__name__)

MAX_LANES = 8  # shards open at once, at most


@dataclass(frozen=True)
class AppendRows:
    index: int  # the shard the rows belong to
    table: pa.Table
    nbytes: int


@dataclass(frozen=True)
class SealShard:
    name: str
    index: int
    captures: pa.Table
    rows: int
    seq_first: int
    seq_last: int
    gaps: list[df.GapEntry]
    group: int = 0  # the shards of one group are committed by one manifest


@dataclass(frozen=True)
class WriteManifest:
    manifest: df.Manifest


Action = Union[AppendRows, SealShard, WriteManifest]


@dataclass
class Stats:
    captures: int = 0  # captures recorded (whole or in part)
    rows: int = 0
    tensor_bytes: int = 0  # uncompressed bytes of rows appended
    duplicates: int = 0
    skipped: int = 0
    lost: int = 0  # captures reported lost
    missing_positions: int = 0
    extra_tensors: int = 0  # tensors a capture carried beyond the dataset's layout (not recorded)
    shards: int = 0
    last_seq: int = -1


def layout_of(capture: Capture, begin: CaptureBegin | None) -> df.TensorLayout:
    """The tensor layout a capture implies (its hidden layers, logits form, value type)."""
    layers = {df.hook_name(l): int(a.shape[1]) for l, a in sorted(capture.hidden.items())}
    spec = (begin.spec if begin is not None else None) or {}
    if capture.logits is not None:
        logits = df.LogitsLayout(df.LOGITS_FULL, int(capture.logits.shape[1]))
    elif capture.topk_ids is not None:
        logits = df.LogitsLayout(df.LOGITS_TOPK, int(capture.topk_ids.shape[1]))
    elif capture.chosen is not None:
        logits = df.LogitsLayout(df.LOGITS_INDICES, int(capture.chosen.shape[1]), [int(i) for i in spec.get("indices", [])])
    else:
        logits = df.LogitsLayout()
    arrays = [a for a in (capture.logits, capture.topk_values, capture.chosen, *capture.hidden.values()) if a is not None]
    dtype = "float16" if arrays and all(a.dtype == np.float16 for a in arrays) else "float32"
    return df.TensorLayout(layers, logits, dtype, _reduced_layout(capture))


def _reduced_layout(capture: Capture) -> dict[str, df.ReducedLayout]:
    """The capture's named reducers (one whose spec was never seen is keyed "#i": not a column)."""
    out = {}
    for name, r in sorted(getattr(capture, "reduced", {}).items()):
        if not name.startswith("#"):
            latents = isinstance(r, Latents)
            out[name] = df.ReducedLayout(df.REDUCED_LATENTS if latents else df.REDUCED_PROBE,
                                         int((r.ids if latents else r).shape[1]))
    return out


def _latent_lists(values: np.ndarray, keep: np.ndarray, value_type: pa.DataType) -> pa.Array:
    """Each row's kept slots as one variable-length list (row-major: most active first)."""
    offsets = np.zeros(len(keep) + 1, np.int32)
    np.cumsum(keep.sum(axis=1), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values[keep], type=value_type))


def _fsl(values: np.ndarray, width: int, value_type: pa.DataType) -> pa.Array:
    flat = np.ascontiguousarray(values).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=value_type), width)


_LSE_ROWS = 16  # rows per block: a block's exp buffer (16 x V floats) stays in cache


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """Per row, exp summed in float64. Block by block in one reused buffer: 2.5x faster than whole
    arrays for V = 32000 (the recorder's main thread spent ~40 % of the writers' CPU time here)."""
    out = np.empty(len(x), np.float32)
    buf = np.empty((min(_LSE_ROWS, len(x)), x.shape[1]), np.float32)
    for i in range(0, len(x), _LSE_ROWS):
        c = x[i:i + _LSE_ROWS]
        b = buf[:len(c)]
        m = c.max(axis=1, keepdims=True).astype(np.float32)
        np.subtract(c, m, out=b, casting="unsafe")
        np.exp(b, out=b)
        out[i:i + len(c)] = np.log(b.sum(axis=1, dtype=np.float64)) + m[:, 0]
    return out


def _names(begin: CaptureBegin | None) -> tuple[str, str, str]:
    """(source, model, tap_key) of a capture; the source is "client" unless the begin says otherwise."""
    if begin is None:
        return "client", "", ""
    spec = begin.spec or {}
    return (getattr(begin, "source", None) or spec.get("source") or "client", begin.model or "", begin.tap_key or "")


def rows_table(writer: str, seq: int, begin: CaptureBegin | None, cap: Capture, layout: df.TensorLayout,
               schema: pa.Schema, lo: int, hi: int) -> tuple[pa.Table, int]:
    """Rows lo..hi-1 of a capture as a table of `schema`, and how many extra tensors were left out."""
    value = pa.float16() if layout.dtype == "float16" else pa.float32()
    n = hi - lo
    positions = cap.positions[lo:hi].astype(np.int32, copy=False)
    tokens = cap.token_ids[lo:hi].astype(np.int32, copy=False)
    prompt = (begin.prompt_token_ids if begin is not None else None) or cap.prompt_token_ids
    if prompt is not None and len(prompt) == cap.num_prompt_tokens:
        full = np.asarray(list(prompt) + list(cap.output_token_ids), dtype=np.int64)
    else:  # the daemon never saw the prompt: the next token is known where the next position was captured
        full = np.full(int(cap.positions.max()) + 2 if len(cap.positions) else 0, -1, np.int64)
        full[cap.positions] = cap.token_ids
        if cap.output_token_ids and cap.num_prompt_tokens:
            out = np.asarray(cap.output_token_ids, np.int64)
            start = cap.num_prompt_tokens
            full = np.concatenate([full, np.full(max(0, start + len(out) - len(full)), -1, np.int64)])
            full[start:start + len(out)] = out
    nxt_pos = positions.astype(np.int64) + 1
    nxt = np.where(nxt_pos < len(full), full[np.minimum(nxt_pos, max(len(full) - 1, 0))] if len(full) else -1, -1)
    source, model, tap_key = _names(begin)

    def const(v: Any, t: pa.DataType) -> pa.Array:
        return pa.repeat(pa.scalar(v, t), n)

    cols: list[pa.Array] = [
        const(writer, pa.string()), pa.array(np.full(n, seq, np.int64)), const(cap.request_id, pa.string()),
        const(cap.instance, pa.string()), const(model, pa.string()), const(source, pa.string()),
        const(tap_key, pa.string()), pa.array(positions), pa.array(tokens), pa.array(nxt.astype(np.int32)),
        pa.array(np.where(positions < cap.num_prompt_tokens, "prompt", "output"), type=pa.string()),
    ]
    extra = 0
    for layer in layout.layer_numbers():
        cols.append(_fsl(cap.hidden[layer][lo:hi], layout.layers[df.hook_name(layer)], value))
    extra += len(set(cap.hidden) - set(layout.layer_numbers()))
    k = layout.logits.kind
    lse = getattr(cap, "logsumexp", None)
    if k == df.LOGITS_FULL:
        x = cap.logits[lo:hi]  # type: ignore[index]
        cols.append(_fsl(x, layout.logits.width, value))
        cols.append(pa.array(_logsumexp(x) if lse is None else np.asarray(lse[lo:hi], np.float32)))
    elif k == df.LOGITS_TOPK:
        cols.append(_fsl(cap.topk_ids[lo:hi].astype(np.int32, copy=False), layout.logits.width, pa.int32()))  # type: ignore[index]
        cols.append(_fsl(cap.topk_values[lo:hi], layout.logits.width, value))  # type: ignore[index]
        cols.append(pa.array(np.asarray(lse[lo:hi], np.float32)) if lse is not None else pa.nulls(n, pa.float32()))
    elif k == df.LOGITS_INDICES:
        cols.append(_fsl(cap.chosen[lo:hi], layout.logits.width, value))  # type: ignore[index]
        cols.append(pa.array(np.asarray(lse[lo:hi], np.float32)) if lse is not None else pa.nulls(n, pa.float32()))
    if k != df.LOGITS_FULL and cap.logits is not None:
        extra += 1
    reduced = getattr(cap, "reduced", {})
    for name, r in sorted(layout.reducers.items()):
        got = reduced[name]
        if r.kind == df.REDUCED_PROBE:
            cols.append(_fsl(np.asarray(got[lo:hi], np.float32), r.width, pa.float32()))
        else:
            ids, values = got.ids[lo:hi], got.values[lo:hi]
            keep = ids >= 0
            cols += [_latent_lists(ids.astype(np.int32, copy=False), keep, pa.int32()),
                     _latent_lists(values.astype(np.float32, copy=False), keep, pa.float32())]
    extra += len(set(reduced) - set(layout.reducers))
    return pa.Table.from_arrays(cols, schema=schema), extra


def check_fits(layout: df.TensorLayout, cap: Capture, begin: CaptureBegin | None) -> str | None:
    """Why a capture cannot be written with the dataset's layout, or None."""
    have = layout_of(cap, begin)
    for name, size in layout.layers.items():
        l = df.layer_of(name)
        if l not in cap.hidden:
            return f"no {name} (layer {l})"
        if have.layers[name] != size:
            return f"{name} has size {have.layers[name]}, the dataset {size}"
    want = layout.logits
    if want.kind != df.LOGITS_NONE and (have.logits.kind != want.kind or have.logits.width != want.width
                                        or (want.kind == df.LOGITS_INDICES and have.logits.indices != want.indices)):
        return f"logits {have.logits.kind}[{have.logits.width}], the dataset {want.kind}[{want.width}]"
    if layout.dtype == "float16" and have.dtype != "float16":
        return "float32 values in a float16 dataset"
    for name, r in layout.reducers.items():
        got = have.reducers.get(name)
        if got != r:
            return f"no reducer {name}" if got is None else f"reducer {name} {got.kind}[{got.width}], the dataset {r.kind}[{r.width}]"
    return None


def _bytes_per_row(layout: df.TensorLayout) -> int:
    v = 2 if layout.dtype == "float16" else 4
    n = sum(layout.layers.values()) * v + 64  # key columns, roughly
    k = layout.logits.kind
    if k == df.LOGITS_FULL:
        n += layout.logits.width * v + 4
    elif k == df.LOGITS_TOPK:
        n += layout.logits.width * (v + 4) + 4
    elif k == df.LOGITS_INDICES:
        n += layout.logits.width * v + 4
    for r in layout.reducers.values():
        n += r.width * (4 if r.kind == df.REDUCED_PROBE else 8) + 8
    return n


@dataclass
class _OpenShard:
    index: int
    opened: float
    group: int = 0
    bytes: int = 0
    rows: int = 0
    seq_first: int = -1
    seq_last: int = -1
    resume_from: tuple[int, int] | None = None  # starts with the rest of capture seq, from this position
    capture_rows: list[dict[str, Any]] = field(default_factory=list)
    gaps: list[df.GapEntry] = field(default_factory=list)


class RecorderCore:
    def __init__(self, writer: str, manifest: df.Manifest | None, *, file_format: str = df.PARQUET,
                 layout: df.TensorLayout | None = None, shard_bytes: int = df.DEFAULT_SHARD_BYTES,
                 shard_age_s: float | None = None, checkpoint_s: float = 10.0, metadata: dict[str, Any] | None = None,
                 host: str | None = None, clock: Callable[[], float] = time.time, lanes: int = 1) -> None:
        if not 0 < shard_bytes <= df.MAX_SHARD_BYTES:
            raise ValueError(f"shard size {shard_bytes}: must be in 1..{df.MAX_SHARD_BYTES} bytes")
        if not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"{lanes} shards at once: must be in 1..{MAX_LANES}")
        self.lanes = lanes
        self.writer = df.check_writer_id(writer)
        self.clock = clock
        self.shard_bytes = shard_bytes
        self.shard_age_s = shard_age_s
        self.checkpoint_s = checkpoint_s
        now = clock()
        unset = df.TensorLayout()
        if manifest is None:
            manifest = df.Manifest(df.FORMAT_NAME, df.FORMAT_VERSION, writer, host or df.default_writer_id(),
                                   file_format, layout or unset, created=now, updated=now,
                                   metadata=dict(metadata or {}))
        else:
            if manifest.writer != writer:
                raise df.ManifestError(f"the manifest belongs to writer {manifest.writer!r}, not {writer!r}")
            if file_format != manifest.file_format:
                raise df.ManifestError(f"the dataset is written as {manifest.file_format}, not {file_format}")
            if layout is not None:
                if manifest.layout == unset:
                    manifest.layout = layout
                    if layout.reducers:
                        manifest.format_version = max(manifest.format_version, 2)
                elif manifest.layout != layout:
                    raise df.ManifestError(f"the dataset has tensors {manifest.layout.describe()}, not {layout.describe()}")
            for k, v in (metadata or {}).items():
                manifest.metadata.setdefault(k, v)
        self.manifest = manifest
        self.schema = df.row_schema(manifest.layout) if manifest.layout != unset else None
        self.handled = manifest.committed_seq  # every seq <= handled has been seen or accounted for
        self.resume = (manifest.resume_seq, manifest.resume_position) if manifest.resume_seq >= 0 else None
        self.open: list[_OpenShard] = []  # the open group's shards, in index order
        self.inflight: list[_OpenShard] = []  # sealed, not yet reported committed by the I/O side
        self.group = 0
        self._group_entries: list[df.ShardEntry] = []  # committed shards of a group not yet all published
        self.pending_lost: list[df.LostEntry] = []
        self.pending_skipped: list[df.GapEntry] = []
        self.last_manifest = now
        self.stats = Stats(last_seq=self.handled)
        self.models: set[str] = set(manifest.metadata.get("models", []))

    # -- what to ask the daemon for --

    @property
    def since(self) -> int | None:
        """The `since` to pass to watch: the last committed seq (None on a new dataset)."""
        return None if self.manifest.committed_seq < 0 else self.manifest.committed_seq

    def _first_uncommitted(self) -> _OpenShard | None:
        """The uncommitted shard that starts earliest (a capture cut within a group starts in the
        lower index: its part there begins before its part in the next shard)."""
        shards = [sh for sh in (*self.inflight, *self.open) if sh.seq_first >= 0]
        return min(shards, key=lambda sh: (sh.seq_first, sh.index)) if shards else None

    @property
    def committed_seq(self) -> int:
        """The highest seq that is safe to record as committed once the sealed shards are."""
        sh = self._first_uncommitted()
        return self.handled if sh is None else sh.seq_first - 1

    # -- the stream --

    def add_capture(self, seq: int, begin: CaptureBegin | None, cap: Capture,
                    gaps: list[tuple[int, int, str]] | None = None) -> list[Action]:
        """A whole capture, with the reasons of its missing positions when the stream gave them."""
        if seq <= self.handled:
            self.stats.duplicates += 1
            return []
        self.handled = seq
        self.stats.last_seq = seq
        acts: list[Action] = []
        n = len(cap.positions)
        row = 0
        resumed = None
        if self.resume is not None and self.resume[0] == seq:
            row = int(np.searchsorted(cap.positions, self.resume[1]))
            resumed = self.resume
        self.resume = None
        if begin is not None and begin.model:
            self.models.add(begin.model)
        if n and self.schema is None:
            self._fix_layout(cap, begin)
        if n:
            why = check_fits(self.manifest.layout, cap, begin)
            if why is not None:
                self.stats.skipped += 1
                self.pending_skipped.append(df.GapEntry(seq, cap.request_id, int(cap.positions[0]),
                                                        int(cap.positions[-1]) + 1, f"spec differs from the dataset's: {why}"))
                return acts
        per_row = _bytes_per_row(self.manifest.layout)
        first_part = True
        cont = False  # the capture continues into a fresh shard of the open group
        while True:
            sh = self._new_shard() if cont else self._emptiest()
            room = max(0, (self.shard_bytes - (sh.bytes if sh is not None else 0)) // per_row)
            left = n - row
            if not cont and left > room and any(s.rows for s in self.open):
                acts += self._seal()  # start this capture (or its next part) in a fresh group
                continue
            if sh is None:
                sh = self._new_shard()
            cont = False
            take = min(left, max(room, 1))
            if sh.seq_first < 0:
                sh.seq_first = seq
                if resumed is not None or not first_part:
                    sh.resume_from = (seq, int(cap.positions[row]) if row < n else resumed[1])  # type: ignore[index]
            sh.seq_last = seq
            if take:
                table, extra = rows_table(self.writer, seq, begin, cap, self.manifest.layout, self.schema,  # type: ignore[arg-type]
                                          row, row + take)
                if first_part:
                    self.stats.extra_tensors += extra
                sh.bytes += take * per_row
                sh.rows += take
                self.stats.rows += take
                self.stats.tensor_bytes += table.nbytes
                acts.append(AppendRows(sh.index, table, table.nbytes))
            row += take
            last = row >= n
            sh.capture_rows.append(self._capture_row(seq, begin, cap, row - take, take, last))
            if first_part:
                self.stats.captures += 1
            first_part = False
            if last:
                for a, b, reason in self._gaps(cap, gaps):
                    sh.gaps.append(df.GapEntry(seq, cap.request_id, a, b, reason))
                    self.stats.missing_positions += b - a
                break
            if len(self.open) < self.lanes:
                cont = True
            else:
                acts += self._seal()
        if len(self.open) == self.lanes and min(s.bytes for s in self.open) >= self.shard_bytes:
            acts += self._seal()
        return acts

    def add_lost(self, first: int, last: int, reason: str) -> list[Action]:
        if last <= self.handled:
            return []
        first = max(first, self.handled + 1)
        self.pending_lost.append(df.LostEntry(first, last, reason))
        self.stats.lost += last - first + 1
        self.handled = self.stats.last_seq = last
        return []

    def advance(self, last_seq: int) -> list[Action]:
        """Nothing up to last_seq is for us (filtered out): progress without rows."""
        if last_seq > self.handled:
            self.handled = self.stats.last_seq = last_seq
        return []

    def tick(self) -> list[Action]:
        now = self.clock()
        if self.open and self.shard_age_s is not None and now - self.open[0].opened >= self.shard_age_s:
            return self._seal()
        # A new dataset commits its starting point at once: a restart then resumes from it
        # instead of from "now".
        first = self.manifest.generation == 0 and self.committed_seq >= 0
        if not self.inflight and self._progress_unwritten() and (first or now - self.last_manifest >= self.checkpoint_s):
            return [WriteManifest(self._next_manifest())]
        return []

    def finish(self) -> list[Action]:
        """At a clean stop: seal the open shard, and write what progress no shard carries."""
        return self._seal() if self.open else []

    def finish_manifest(self) -> list[Action]:
        """After the sealed shards are committed: a last manifest if progress is still unwritten."""
        return [WriteManifest(self._next_manifest())] if self._progress_unwritten() else []

    # -- the I/O side reports back --

    def shard_committed(self, seal: SealShard, *, rows_bytes: int, rows_sha256: str, captures_bytes: int,
                        captures_sha256: str) -> df.Manifest | None:
        """Both files of `seal` are visible under their final names: the manifest to write next, or
        None while other shards of its group are still to be published (one manifest per group)."""
        sh = self.inflight.pop(0)
        assert sh.index == seal.index, "shards are committed in the order they were sealed"
        entry = df.ShardEntry(seal.name, seal.rows, rows_bytes, rows_sha256, seal.captures.num_rows, captures_bytes,
                              captures_sha256, seal.seq_first, seal.seq_last, self.clock(), seal.gaps)
        self.manifest.next_index = max(self.manifest.next_index, seal.index + 1)
        self.stats.shards += 1
        self._group_entries.append(entry)
        if self.inflight and self.inflight[0].group == sh.group:
            return None
        self.manifest.shards += self._group_entries
        self._group_entries = []
        return self._next_manifest()

    def manifest_written(self, m: df.Manifest) -> None:
        self.last_manifest = self.clock()

    # -- internals --

    def _emptiest(self) -> _OpenShard | None:
        """The open shard with the fewest bytes, or None where a fresh one should be opened (the
        group has room for another and every open one has rows)."""
        if len(self.open) < self.lanes and all(s.bytes for s in self.open):
            return None
        return min(self.open, key=lambda s: (s.bytes, s.index))

    def _new_shard(self) -> _OpenShard:
        used = [s.index for s in (*self.inflight, *self.open)]
        index = max([self.manifest.next_index - 1, *used]) + 1
        sh = _OpenShard(index, self.open[0].opened if self.open else self.clock(), self.group)
        self.open.append(sh)
        return sh

    def _progress_unwritten(self) -> bool:
        c = self.committed_seq
        return c > self.manifest.committed_seq or any(e.last <= c for e in self.pending_lost) or any(
            e.seq <= c for e in self.pending_skipped)

    def _fix_layout(self, cap: Capture, begin: CaptureBegin | None) -> None:
        self.manifest.layout = layout_of(cap, begin)
        if self.manifest.layout.reducers:  # reducer columns: readers of version 1 must refuse the dataset
            self.manifest.format_version = max(self.manifest.format_version, 2)
        self.schema = df.row_schema(self.manifest.layout)
        if begin is not None and begin.spec:
            self.manifest.metadata.setdefault("capture_spec", begin.spec)
        log.info("dataset tensors: %s", self.manifest.layout.describe())

    def _seal(self) -> list[Action]:
        """Seal the open group: one SealShard per shard, in index order."""
        acts: list[Action] = []
        for sh in self.open:
            self.inflight.append(sh)
            name = df.shard_name(self.writer, sh.index, self.manifest.file_format)
            captures = pa.Table.from_pylist(sh.capture_rows, schema=df.capture_schema())
            acts.append(SealShard(name, sh.index, captures, sh.rows, sh.seq_first, sh.seq_last, sh.gaps, sh.group))
        self.open = []
        self.group += 1
        return acts

    def _next_manifest(self) -> df.Manifest:
        m = self.manifest
        sh = self._first_uncommitted()
        committed = self.committed_seq
        if sh is not None and sh.resume_from is not None:
            m.resume_seq, m.resume_position = sh.resume_from
        else:
            m.resume_seq, m.resume_position = -1, 0
        m.committed_seq = max(m.committed_seq, committed)
        m.lost = m.lost + [e for e in self.pending_lost if e.last <= m.committed_seq]
        self.pending_lost = [e for e in self.pending_lost if e.last > m.committed_seq]
        m.skipped = m.skipped + [e for e in self.pending_skipped if e.seq <= m.committed_seq]
        self.pending_skipped = [e for e in self.pending_skipped if e.seq > m.committed_seq]
        m.generation += 1
        m.updated = self.clock()
        if self.models:
            m.metadata["models"] = sorted(self.models)
        return m

    @staticmethod
    def _gaps(cap: Capture, gaps: list[tuple[int, int, str]] | None) -> list[tuple[int, int, str]]:
        """Every missing range of the capture with its reason: the stream's gaps (adjacent ones with
        one reason joined), and NO_REASON for missing positions no gap named (nothing unaccounted)."""
        out: list[list[Any]] = []
        for a, b, r in sorted((int(a), int(b), str(r)) for a, b, r in (gaps or ())):
            if out and out[-1][1] == a and out[-1][2] == r:
                out[-1][1] = b
            else:
                out.append([a, b, r])
        missing = cap.missing_positions
        mr = missing.ranges if isinstance(missing, PositionRanges) else PositionRanges.of(missing).ranges
        named = PositionRanges((a, b) for a, b, _ in out)
        for a, b in mr:
            lo = a
            for c, d in named.clip(a, b).ranges:
                if c > lo:
                    out.append([lo, c, df.GAP_NO_REASON])
                lo = max(lo, d)
            if lo < b:
                out.append([lo, b, df.GAP_NO_REASON])
        return [(a, b, r) for a, b, r in sorted(out, key=lambda g: g[0])]

    def _capture_row(self, seq: int, begin: CaptureBegin | None, cap: Capture, row: int, take: int, last: bool) -> dict[str, Any]:
        source, model, tap_key = _names(begin)
        spec = (begin.spec if begin is not None else None) or {}
        return {
            df.COL_WRITER: self.writer, df.COL_SEQ: seq, df.COL_REQUEST_ID: cap.request_id,
            df.COL_INSTANCE: cap.instance, df.COL_MODEL: model, df.COL_SOURCE: source, df.COL_TAP_KEY: tap_key,
            "response_id": cap.response_id or "", "choice_index": int(cap.choice_index),
            "num_prompt_tokens": int(cap.num_prompt_tokens),
            "prompt_token_ids": None if cap.prompt_token_ids is None else [int(t) for t in cap.prompt_token_ids],
            "output_token_ids": [int(t) for t in cap.output_token_ids],
            "finish_reason": cap.finish_reason or "",
            "expected_start": None if cap.expected is None else int(cap.expected[0]),
            "expected_stop": None if cap.expected is None else int(cap.expected[1]),
            "missing_positions": [int(p) for p in cap.missing_positions] if last else [],
            "part_first_position": int(cap.positions[row]) if take else None,
            "part_rows": take, "last_part": last, "spec": json.dumps(spec, sort_keys=True, default=str),
        }
