"""Reading datasets written by `vllm-tap record`: numpy and pyarrow only (torch when asked for).

    from . import open_dataset, activation_batches
    ds = open_dataset("s3://bucket/run1")          # every writer's manifest; only committed shards
    ds.to_pyarrow().to_table(columns=["seq", "position", "blocks.7.hook_resid_post"])
    ds.to_hf()                                      # a datasets.Dataset (Arrow, memory-mapped)
    for x in activation_batches("s3://bucket/run1", layer=8, batch_size=4096, torch=True):
        ...                                         # [4096, H], shuffled; every row once per epoch

A reader follows the manifests: a file that no manifest lists (a crash's leftover, an upload still
running) is never read. docs/dataset-format.md describes the format.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads

from vllm_tap import dataset_format as df

from .store import DatasetStore, StoreError

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """The dataset cannot be read as asked (no manifest, writers disagree, no such column)."""


def _pa_format(file_format: str) -> str:
    return "parquet" if file_format == df.PARQUET else "ipc"


@dataclass(frozen=True)
class ShardRef:
    writer: str
    file_format: str
    entry: df.ShardEntry
    rows_path: str  # filesystem paths (without protocol)
    captures_path: str


class TapDataset:
    """All writers' committed shards under DEST, as one dataset."""

    def __init__(self, dest: str, storage_options: dict[str, Any] | None = None) -> None:
        self.dest = dest
        self.storage_options = dict(storage_options or {})
        try:
            self.store = DatasetStore(dest, storage_options)
            writers = sorted(self.store.list_dirs(df.WRITERS_DIR))
            manifests = []
            for w in writers:
                raw = self.store.read_bytes(df.manifest_path(w))
                if raw is not None:
                    manifests.append(df.decode_manifest(raw, self.store.url(df.manifest_path(w))))
        except (StoreError, df.ManifestError) as e:
            raise DatasetError(str(e)) from None
        if not manifests:
            raise DatasetError(f"{dest}: no vllm-tap dataset here (no {df.WRITERS_DIR}/*/{df.MANIFEST_NAME})")
        import msgspec

        layouts = {msgspec.json.encode(m.layout): m.layout for m in manifests if m.layout != df.TensorLayout()}
        if len(layouts) > 1:
            a, b = list(layouts.values())[:2]
            raise DatasetError(f"{dest}: writers recorded different tensors ({a.describe()} vs {b.describe()}); "
                               f"open each writer's directory on its own")
        self.manifests: list[df.Manifest] = manifests
        self.layout = next(iter(layouts.values())) if layouts else df.TensorLayout()
        self.shards = [ShardRef(m.writer, m.file_format, s, self.store.path(df.rows_path(m.writer, s.name)),
                                self.store.path(df.captures_path(m.writer, s.name)))
                       for m in manifests for s in m.shards]

    # -- what is in it --

    @property
    def num_rows(self) -> int:
        return sum(s.entry.rows for s in self.shards)

    @property
    def columns(self) -> list[str]:
        return self.schema.names

    @property
    def schema(self) -> pa.Schema:
        return df.row_schema(self.layout)

    @property
    def gaps(self) -> list[df.GapEntry]:
        return [g for s in self.shards for g in s.entry.gaps]

    @property
    def lost(self) -> list[tuple[str, df.LostEntry]]:
        return [(m.writer, e) for m in self.manifests for e in m.lost]

    @property
    def skipped(self) -> list[tuple[str, df.GapEntry]]:
        return [(m.writer, e) for m in self.manifests for e in m.skipped]

    def column_for(self, layer: int | str) -> str:
        name = df.hook_name(layer) if isinstance(layer, int) else layer
        if name not in self.layout.layers:
            have = ", ".join(sorted(self.layout.layers, key=df.layer_of)) or "none"
            raise DatasetError(f"layer {layer}: not in this dataset (its layers: {have})")
        return name

    # -- as pyarrow / HF datasets --

    def _dataset(self, which: str) -> pads.Dataset:
        parts = []
        for fmt in sorted({s.file_format for s in self.shards}):
            paths = [getattr(s, which) for s in self.shards if s.file_format == fmt]
            schema = self.schema if which == "rows_path" else df.capture_schema()
            parts.append(pads.dataset(paths, schema=schema, format=_pa_format(fmt), filesystem=self.store.fs))
        if not parts:
            schema = self.schema if which == "rows_path" else df.capture_schema()
            return pads.dataset(pa.table({n: pa.array([], type=schema.field(n).type) for n in schema.names}, schema=schema))
        return parts[0] if len(parts) == 1 else pads.dataset(parts)

    def to_pyarrow(self) -> pads.Dataset:
        """The token rows as a pyarrow dataset (lazy: filter and project before reading)."""
        return self._dataset("rows_path")

    def captures(self) -> pads.Dataset:
        """One row per capture part: names, prompt and output token ids, finish reason, missing positions."""
        return self._dataset("captures_path")

    def to_hf(self, cache_dir: str | None = None, columns: list[str] | None = None) -> Any:
        """The token rows as a `datasets.Dataset` (HF datasets builds its Arrow cache from the shards)."""
        import datasets

        if not self.shards:
            return datasets.Dataset(self.to_pyarrow().to_table(columns=columns))
        fmts = {s.file_format for s in self.shards}
        if len(fmts) > 1:
            raise DatasetError("writers used different file formats; read with to_pyarrow()")
        files = [self.store.fs.unstrip_protocol(s.rows_path) if not self.store.local else s.rows_path for s in self.shards]
        builder = "parquet" if fmts == {df.PARQUET} else "arrow"
        kw: dict[str, Any] = {"split": "train", "cache_dir": cache_dir}
        if not self.store.local and self.storage_options:
            kw["storage_options"] = self.storage_options
        if builder == "parquet" and columns is not None:
            kw["columns"] = columns
        ds = datasets.load_dataset(builder, data_files=files, **kw)
        if columns is not None and builder != "parquet":
            ds = ds.select_columns(columns)
        return ds

    def verify(self) -> list[str]:
        """Re-hash every listed file: a list of problems (empty when every byte is as committed)."""
        import hashlib

        problems = []
        for s in self.shards:
            for path, size, sha in ((s.rows_path, s.entry.bytes, s.entry.sha256),
                                    (s.captures_path, s.entry.captures_bytes, s.entry.captures_sha256)):
                h = hashlib.sha256()
                n = 0
                try:
                    with self.store.fs.open(path, "rb") as f:
                        while chunk := f.read(8 << 20):
                            h.update(chunk)
                            n += len(chunk)
                except FileNotFoundError:
                    problems.append(f"{path}: missing")
                    continue
                if n != size or h.hexdigest() != sha:
                    problems.append(f"{path}: {n} bytes, sha256 {h.hexdigest()[:12]}; the manifest says {size}, {sha[:12]}")
        return problems


def open_dataset(dest: str, storage_options: dict[str, Any] | None = None) -> TapDataset:
    return TapDataset(dest, storage_options)


# -- shuffled activation batches --


class _ShuffleBuffer:
    """Rows in, shuffled batches out; every row comes out exactly once.

    When it holds `capacity` rows it shuffles and gives out all but capacity/2 of them, so a row
    waits at most one refill and is mixed with rows from other shards and captures."""

    def __init__(self, capacity: int, dim: int, dtype: np.dtype, rng: np.random.Generator) -> None:
        self.capacity = max(capacity, 1)
        self.pool = np.empty((0, dim), dtype)
        self.fill = 0
        self.rng = rng

    def add(self, rows: np.ndarray) -> None:
        need = self.fill + len(rows)
        if need > len(self.pool):
            grown = np.empty((max(need, min(2 * len(self.pool), self.capacity + len(rows)), 1), self.pool.shape[1]),
                             self.pool.dtype)
            grown[:self.fill] = self.pool[:self.fill]
            self.pool = grown
        self.pool[self.fill:need] = rows
        self.fill = need

    def take(self, batch: int, drain: bool) -> Iterator[np.ndarray]:
        if not drain and self.fill < self.capacity:
            return
        keep = 0 if drain else self.capacity // 2
        perm = self.rng.permutation(self.fill)
        self.pool[:self.fill] = self.pool[perm]
        out = self.fill - keep
        if not drain:
            out -= out % batch
        # the rows given out are the tail; the kept rows stay at the front
        start = self.fill - out
        for i in range(start, self.fill, batch):
            yield self.pool[i:min(i + batch, self.fill)].copy()
        self.fill = start


class ActivationBatches:
    """Shuffled [batch, H] batches of one layer's rows, from a dataset or a live daemon.

    Use it as SAELens's data provider (an iterator of torch tensors) with torch=True:
        SAETrainer(cfg, sae, data_provider=activation_batches(dest, "blocks.7.hook_resid_post", 4096, torch=True, epochs=None))
    """

    def __init__(self, source: Any, layer: int | str, batch_size: int = 4096, *, shuffle_buffer: int = 1 << 16,
                 seed: int = 0, epochs: int | None = 1, drop_last: bool = False, torch: bool = False,
                 device: str | None = None, dtype: str | None = None, storage_options: dict[str, Any] | None = None,
                 filters: dict[str, Any] | None = None, since: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.layer = layer
        self.batch_size = batch_size
        self.shuffle_buffer = shuffle_buffer
        self.rng = np.random.default_rng(seed)
        self.epochs = epochs
        self.drop_last = drop_last
        self.torch = torch
        self.device = device
        self.dtype = dtype
        self.filters = dict(filters or {})
        self.since = since
        self.live = not isinstance(source, str) or source.startswith(("ipc://", "tcp://"))
        self.source = source
        if not self.live:
            self.dataset = open_dataset(source, storage_options)
            self.column = self.dataset.column_for(layer)
            self.dim = self.dataset.layout.layers[self.column]
        else:
            self.dataset = None
            self.column = df.hook_name(layer) if isinstance(layer, int) else layer
            self.dim = 0
        self.epoch = 0
        self._it = self._batches()

    def __iter__(self) -> "ActivationBatches":
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def _out(self, x: np.ndarray) -> Any:
        if self.dtype is not None:
            x = x.astype(self.dtype, copy=False)
        if not self.torch:
            return x
        import torch

        t = torch.from_numpy(x)
        return t.to(self.device) if self.device is not None else t

    def _rows_from_dataset(self) -> Iterator[np.ndarray]:
        assert self.dataset is not None
        order = self.rng.permutation(len(self.dataset.shards))
        for i in order:
            s = self.dataset.shards[i]
            d = pads.dataset(s.rows_path, format=_pa_format(s.file_format), filesystem=self.dataset.store.fs,
                             schema=self.dataset.schema)
            for b in d.to_batches(columns=[self.column], batch_size=1 << 14):
                col = b.column(0)
                if len(col):
                    yield col.values.to_numpy(zero_copy_only=False).reshape(len(col), self.dim)

    def _rows_live(self) -> Iterator[np.ndarray]:
        from .. import Client

        client = self.source if not isinstance(self.source, str) else Client(self.source)
        layer = self.layer if isinstance(self.layer, int) else df.layer_of(self.layer)
        watch = client.watch(self.since, **self.filters)
        try:
            for item in watch:
                cap = getattr(item, "capture", None)
                if cap is None:
                    continue
                h = cap.hidden.get(layer)
                if h is not None and len(h):
                    yield h
        finally:
            close = getattr(watch, "close", None)
            if close is not None:
                close()

    def _batches(self) -> Iterator[Any]:
        buf: _ShuffleBuffer | None = None
        while self.epochs is None or self.epoch < self.epochs:
            rows = self._rows_live() if self.live else self._rows_from_dataset()
            for r in rows:
                if buf is None:
                    buf = _ShuffleBuffer(self.shuffle_buffer, r.shape[1], r.dtype, self.rng)
                buf.add(r)
                for b in buf.take(self.batch_size, drain=False):
                    yield self._out(b)
            self.epoch += 1
            if buf is not None:
                last_epoch = self.epochs is not None and self.epoch >= self.epochs
                if last_epoch or self.drop_last is False:
                    for b in buf.take(self.batch_size, drain=True):
                        if len(b) < self.batch_size and self.drop_last:
                            continue
                        yield self._out(b)
            if self.live:
                return


def activation_batches(source: Any, layer: int | str, batch_size: int = 4096, **kw: Any) -> ActivationBatches:
    """Shuffled batches of `layer` (a vllm-tap layer number or its hook name) from a dataset at
    `source` (a path or URL) or a live daemon (a Client or an ipc:// / tcp:// endpoint)."""
    return ActivationBatches(source, layer, batch_size, **kw)
