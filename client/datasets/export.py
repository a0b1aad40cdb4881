"""Exports of a recorded dataset into the layouts training tools read.

- `export_saelens`: SAELens's cached-activation dataset (what its CacheActivationsRunner writes and
  its ActivationsStore loads with `cached_activations_path`): an HF `datasets` directory
  (`save_to_disk`) whose rows are `context_size` consecutive tokens, with the hook-named column
  `Array2D((context_size, d_in))` and `token_ids` `Sequence(int32, length=context_size)`.
  Rows follow each other in (writer, seq, position) order; a window may span two captures, as
  SAELens's own token batches span documents; the tail that does not fill a window is left out
  (counted in the result).
- `export_distill`: one row per captured sequence in the field layout of axolotl's
  knowledge-distillation trainer (its KD collator's fields, its "target alignment" rule):
      input_ids, attention_mask, labels            [L]   prompt + output tokens; labels -100 on the prompt
      target_token_ids, target_logprobs, target_mask [L][K]
  where row j is the teacher's distribution over input_ids[j+1] (vllm-tap's logits at position j),
  rows without one (the last row, positions not captured, prompt rows when labels are -100) have
  mask 0, ids 0..K-1 and logprob -1e9. Logprobs are exact (logit - logsumexp of the full row) when
  the dataset has the row's logsumexp; otherwise they are renormalised over the top-k and the export
  says so in vllm_tap_export.json.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vllm_tap import dataset_format as df

from .reader import DatasetError, TapDataset, open_dataset
from .store import DatasetStore

log = logging.getLogger(__name__)

PAD_LOGPROB = -1e9
EXPORT_INFO = "vllm_tap_export.json"


@dataclass
class ExportResult:
    dest: str
    rows: int = 0  # rows written (windows for SAELens, sequences for distillation)
    tokens: int = 0
    dropped_tokens: int = 0
    skipped: list[str] = field(default_factory=list)
    files: int = 0
    info: dict[str, Any] = field(default_factory=dict)


def _rows_in_order(ds: TapDataset, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """Row batches shard by shard (each shard is in seq, position order; shards in commit order)."""
    import pyarrow.dataset as pads

    for s in ds.shards:
        d = pads.dataset(s.rows_path, format="parquet" if s.file_format == df.PARQUET else "ipc",
                         filesystem=ds.store.fs, schema=ds.schema)
        yield from d.to_batches(columns=columns, batch_size=1 << 14)


def export_saelens(src: str | TapDataset, dest: str, layer: int | str, context_size: int, *,
                   dtype: str = "float32", max_shard_size: str | int = "1GB", storage_options: dict[str, Any] | None = None,
                   cache_dir: str | None = None) -> ExportResult:
    import datasets

    if context_size < 1:
        raise ValueError("--context-size must be >= 1")
    ds = src if isinstance(src, TapDataset) else open_dataset(src, storage_options)
    col = ds.column_for(layer)
    d_in = ds.layout.layers[col]
    res = ExportResult(dest)
    np_dtype = np.dtype(dtype)

    def windows() -> Iterator[dict[str, Any]]:
        acts = np.empty((context_size, d_in), np_dtype)
        toks = np.empty(context_size, np.int32)
        fill = 0
        for b in _rows_in_order(ds, [col, df.COL_TOKEN_ID]):
            a = b.column(0).values.to_numpy(zero_copy_only=False).reshape(b.num_rows, d_in)
            t = b.column(1).to_numpy(zero_copy_only=False)
            i = 0
            while i < b.num_rows:
                take = min(context_size - fill, b.num_rows - i)
                acts[fill:fill + take] = a[i:i + take]
                toks[fill:fill + take] = t[i:i + take]
                fill += take
                i += take
                if fill == context_size:
                    res.rows += 1
                    res.tokens += context_size
                    yield {col: acts.copy(), "token_ids": toks.copy()}
                    fill = 0
        res.dropped_tokens = fill

    features = datasets.Features({
        col: datasets.Array2D(shape=(context_size, d_in), dtype=dtype),
        "token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size),
    })
    with tempfile.TemporaryDirectory(prefix="vllm-tap-export-") as tmp:
        import uuid

        # A fingerprint of our own: HF would otherwise hash the generator by pickling its closure.
        out = datasets.Dataset.from_generator(windows, features=features, cache_dir=cache_dir or tmp,
                                              fingerprint=uuid.uuid4().hex)
        if res.rows == 0:
            raise DatasetError(f"layer {col}: fewer than --context-size {context_size} rows in the dataset "
                               f"({res.dropped_tokens} rows)")
        out.save_to_disk(dest, max_shard_size=max_shard_size, storage_options=storage_options)
    res.info = {"format": "saelens-cached-activations", "hook_name": col, "d_in": d_in, "context_size": context_size,
                "dtype": dtype, "rows": res.rows, "tokens": res.tokens, "dropped_tokens": res.dropped_tokens,
                "source": ds.dest, "model": sorted({m for mf in ds.manifests for m in mf.metadata.get("models", [])})}
    DatasetStore(dest, storage_options).replace_small(EXPORT_INFO, json.dumps(res.info, indent=1).encode())
    return res


def _logprobs(ids: np.ndarray, vals: np.ndarray, lse: np.ndarray | None) -> tuple[np.ndarray, bool]:
    """Top-k logprobs: exact with the row's logsumexp, else renormalised over the k (False)."""
    v = vals.astype(np.float64)
    if lse is not None and not np.isnan(lse).any():
        return (v - lse[:, None]).astype(np.float32), True
    m = v.max(axis=1, keepdims=True)
    return (v - m - np.log(np.exp(v - m).sum(axis=1, keepdims=True))).astype(np.float32), False


def export_distill(src: str | TapDataset, dest: str, *, top_k: int | None = None, train_on_prompt: bool = False,
                   max_shard_bytes: int = df.DEFAULT_SHARD_BYTES, storage_options: dict[str, Any] | None = None) -> ExportResult:
    ds = src if isinstance(src, TapDataset) else open_dataset(src, storage_options)
    kind = ds.layout.logits.kind
    if kind == df.LOGITS_FULL:
        if top_k is None:
            raise DatasetError("the dataset has full logits: give --top-k K for the targets")
        if not 1 <= top_k <= ds.layout.logits.width:
            raise DatasetError(f"--top-k {top_k}: must be in 1..{ds.layout.logits.width}")
        K = top_k
        cols = [df.COL_LOGITS, df.COL_LOGSUMEXP]
    elif kind == df.LOGITS_TOPK:
        K = top_k or ds.layout.logits.width
        if not 1 <= K <= ds.layout.logits.width:
            raise DatasetError(f"--top-k {K}: the dataset has top-{ds.layout.logits.width}")
        cols = [df.COL_TOPK_IDS, df.COL_TOPK_LOGITS, df.COL_LOGSUMEXP]
    else:
        raise DatasetError(f"a distillation export needs full or top-k logits; the dataset has {kind!r}")
    store = DatasetStore(dest, storage_options)
    res = ExportResult(dest)
    exact_all = True
    caps = ds.captures().to_table()
    # The capture part that carries a capture's end holds its token ids; rows come from all parts.
    caps = caps.filter(pc.field("last_part"))
    by_key = {(w, s): i for i, (w, s) in enumerate(zip(caps.column(df.COL_WRITER).to_pylist(), caps.column(df.COL_SEQ).to_pylist()))}
    cap_rows = caps.to_pylist()

    schema = pa.schema([
        ("writer", pa.string()), ("seq", pa.int64()), ("request_id", pa.string()), ("model", pa.string()),
        ("input_ids", pa.list_(pa.int32())), ("attention_mask", pa.list_(pa.int8())), ("labels", pa.list_(pa.int32())),
        ("target_token_ids", pa.list_(pa.list_(pa.int32(), K))), ("target_logprobs", pa.list_(pa.list_(pa.float32(), K))),
        ("target_mask", pa.list_(pa.list_(pa.int8(), K))),
    ])
    pending: list[dict[str, Any]] = []
    pending_bytes = 0
    shard = 0

    def flush() -> None:
        nonlocal pending, pending_bytes, shard
        if not pending:
            return
        t = pa.Table.from_pylist(pending, schema=schema)
        with tempfile.NamedTemporaryFile(suffix=".parquet", delete=False) as f:
            tmp = f.name
        pq.write_table(t, tmp, compression="zstd")
        store.publish(tmp, f"data-{shard:05d}.parquet")
        shard += 1
        res.files += 1
        pending, pending_bytes = [], 0

    # Gather each capture's rows (they are contiguous per writer and seq, in position order).
    def sequences() -> Iterator[tuple[tuple[str, int], np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]:
        cur_key = None
        parts: list[pa.RecordBatch] = []
        for b in _rows_in_order(ds, [df.COL_WRITER, df.COL_SEQ, df.COL_POSITION, *cols]):
            w = b.column(0).to_pylist()
            s = b.column(1).to_numpy()
            start = 0
            for i in range(1, b.num_rows + 1):
                if i == b.num_rows or s[i] != s[start] or w[i] != w[start]:
                    key = (w[start], int(s[start]))
                    if key != cur_key and parts:
                        yield cur_key, *_stack(parts)  # type: ignore[misc]
                        parts = []
                    cur_key = key
                    parts.append(b.slice(start, i - start))
                    start = i
        if parts:
            yield cur_key, *_stack(parts)  # type: ignore[misc]

    def _stack(parts: list[pa.RecordBatch]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        t = pa.Table.from_batches(parts)
        pos = t.column(df.COL_POSITION).to_numpy()
        if kind == df.LOGITS_FULL:
            x = t.column(df.COL_LOGITS).combine_chunks().values.to_numpy(zero_copy_only=False).reshape(len(pos), -1)
            lse = t.column(df.COL_LOGSUMEXP).to_numpy(zero_copy_only=False).astype(np.float64)
            ids = np.argpartition(-x, K - 1, axis=1)[:, :K]
            vals = np.take_along_axis(x, ids, 1)
            order = np.argsort(-vals, axis=1, kind="stable")
            return pos, np.take_along_axis(ids, order, 1).astype(np.int32), np.take_along_axis(vals, order, 1), lse
        width = ds.layout.logits.width
        ids = t.column(df.COL_TOPK_IDS).combine_chunks().values.to_numpy(zero_copy_only=False).reshape(len(pos), width)[:, :K]
        vals = t.column(df.COL_TOPK_LOGITS).combine_chunks().values.to_numpy(zero_copy_only=False).reshape(len(pos), width)[:, :K]
        lse_col = t.column(df.COL_LOGSUMEXP)
        lse = None if lse_col.null_count else lse_col.to_numpy(zero_copy_only=False).astype(np.float64)
        return pos, ids.astype(np.int32), vals, lse

    for key, pos, ids, vals, lse in sequences():
        i = by_key.get(key)
        if i is None:
            res.skipped.append(f"{key[0]} seq {key[1]}: no capture record")
            continue
        c = cap_rows[i]
        if c["prompt_token_ids"] is None:
            res.skipped.append(f"{key[0]} seq {key[1]} ({c['request_id']}): prompt token ids unknown")
            continue
        input_ids = np.asarray(list(c["prompt_token_ids"]) + list(c["output_token_ids"]), np.int32)
        L = len(input_ids)
        P = int(c["num_prompt_tokens"])
        labels = input_ids.copy()
        if not train_on_prompt:
            labels[:P] = -100
        tids = np.tile(np.arange(K, dtype=np.int32), (L, 1))
        tlp = np.full((L, K), PAD_LOGPROB, np.float32)
        tmask = np.zeros((L, K), np.int8)
        lp, exact = _logprobs(ids, vals, lse)
        exact_all &= exact
        ok = (pos >= 0) & (pos < L - 1)
        p = pos[ok]
        tids[p] = ids[ok]
        tlp[p] = lp[ok]
        use = labels[p + 1] != -100
        tmask[p[use]] = 1
        row = {"writer": key[0], "seq": key[1], "request_id": c["request_id"], "model": c["model"],
               "input_ids": input_ids.tolist(), "attention_mask": [1] * L, "labels": labels.tolist(),
               "target_token_ids": tids.tolist(), "target_logprobs": tlp.tolist(), "target_mask": tmask.tolist()}
        pending.append(row)
        res.rows += 1
        res.tokens += L
        pending_bytes += L * K * 9 + L * 9
        if pending_bytes >= max_shard_bytes:
            flush()
    flush()
    res.info = {
        "format": "axolotl-kd", "top_k": K, "alignment": "target row j is the distribution over input_ids[j+1]",
        "logprobs": "exact (logit - logsumexp of the full row)" if exact_all else "renormalised over the top-k (no logsumexp recorded)",
        "temperature": 1.0, "labels": "prompt positions -100" if not train_on_prompt else "all positions",
        "rows": res.rows, "tokens": res.tokens, "skipped": res.skipped, "source": ds.dest,
        "files": [f"data-{i:05d}.parquet" for i in range(shard)],
    }
    store.replace_small(EXPORT_INFO, json.dumps(res.info, indent=1).encode())
    if res.skipped:
        log.warning("distillation export skipped %d sequences: %s", len(res.skipped), "; ".join(res.skipped[:3]))
    return res
