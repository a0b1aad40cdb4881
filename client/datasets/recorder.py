"""`vllm-tap record DEST`: the watch stream to rolling Parquet / Arrow IPC shards, exactly once.

The protocol lives in recorder_core (no I/O); the destination in store; this module drives
them: it feeds the stream to the core, encodes rows into the staged shards, each on a writer thread
of its own (so encoding and compression overlap receiving and converting, and the shards of a group
are encoded on as many cores: pyarrow encodes one file on one core), publishes sealed shards,
replaces the manifest, and reports progress.

Crash safety follows from the order of effects, for every group of shards (recorder_core):
    rows staged (invisible) -> for each shard: rows file published, captures file published
    -> manifest replaced (listing the whole group)
A crash before the manifest replacement leaves at most files no manifest lists; the next start
deletes them and resumes the watch after the manifest's committed_seq, so every (seq, position) is
in exactly one listed shard.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from vllm_tap import dataset_format as df

from .recorder_core import MAX_LANES, AppendRows, RecorderCore, SealShard, WriteManifest
from .store import DatasetStore, StoreError, describe_error, failpoint

log = logging.getLogger(__name__)

ROW_GROUP_BYTES = 64 << 20  # rows are buffered into row groups / record batches of about this size
COMPRESSIONS = ("zstd", "lz4", "none")
TENSOR_COMPRESSION = "zstd"  # the default for float tensor columns in Parquet (--tensor-compression)
PARALLEL_SHARDS = 2  # shards encoded at once (--parallel-shards), each on a thread (a core) of its own


class RecorderError(RuntimeError):
    """The recorder had to stop: one line for the user; everything committed is intact."""


# -- one shard file on local disk, written by a thread --


class _HashingFile:
    """A write-only file that hashes and counts what passes through it (sha256 without a re-read)."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "wb")
        self.h = hashlib.sha256()
        self.n = 0
        self.closed = False

    def write(self, b: Any) -> int:
        self.h.update(b)
        n = self.f.write(b)
        self.n += n
        return n

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        self.f.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        if not self.closed:
            self.f.close()
            self.closed = True


def _parquet_options(schema: pa.Schema, compression: str, tensor_compression: str = TENSOR_COMPRESSION) -> dict[str, Any]:
    # Tensor columns: fixed-size lists, and the variable-length lists of an SAE reducer's latents.
    tensors = [f.name for f in schema if pa.types.is_fixed_size_list(f.type) or pa.types.is_list(f.type)]
    floats = [f"{f.name}.list.element" for f in schema  # the leaf column of a list
              if f.name in tensors and pa.types.is_floating(f.type.value_type)]
    keys = [f.name for f in schema if f.name not in tensors]
    leaves = [f"{f.name}.list.element" if f.name in tensors else f.name for f in schema]
    return {
        # Per leaf column: float tensors (nearly all the bytes) take `tensor_compression`, the rest
        # `compression`. Encoding a float tensor column is the recorder's bottleneck (one core, see
        # docs/benchmarks.md); zstd on it costs CPU for what byte-stream-split leaves compressible.
        "compression": {c: tensor_compression if c in floats else compression for c in leaves},
        # Dictionaries and statistics pay off for the key columns only; byte-stream-split makes
        # float tensors compress (bf16 widened to float32 has two zero bytes per value).
        "use_dictionary": [k for k in keys if k not in (df.COL_SEQ, df.COL_POSITION, df.COL_TOKEN_ID, df.COL_NEXT_TOKEN_ID)],
        "write_statistics": [df.COL_WRITER, df.COL_SEQ, df.COL_REQUEST_ID, df.COL_POSITION],
        "column_encoding": {c: "BYTE_STREAM_SPLIT" for c in floats},
        # Levels of a fixed-size list are computed per write batch: large batches cost less CPU
        # (about +30 % encoding throughput for 4096-wide rows, measured on this project's machines).
        "write_batch_size": 1 << 16,
    }


class ShardFile:
    """Rows of one shard into a local file, on a writer thread; sha256 and size as it goes."""

    def __init__(self, path: str, schema: pa.Schema, file_format: str, compression: str,
                 tensor_compression: str = TENSOR_COMPRESSION) -> None:
        self.path = path
        self.schema = schema
        self.file_format = file_format
        self.compression = compression
        self.tensor_compression = tensor_compression
        self._q: queue.Queue = queue.Queue(maxsize=2)  # row groups waiting; per shard, and shards are encoded at once
        self._err: BaseException | None = None
        self._buf: list[pa.Table] = []
        self._buf_bytes = 0
        self._file = _HashingFile(path)
        self._thread = threading.Thread(target=self._run, name="vllm-tap-shard-writer", daemon=True)
        self._thread.start()

    def _open(self) -> Any:
        sink = pa.PythonFile(self._file, mode="w")
        if self.file_format == df.PARQUET:
            return pq.ParquetWriter(sink, self.schema, **_parquet_options(self.schema, self.compression,
                                                                          self.tensor_compression))
        opts = pa.ipc.IpcWriteOptions(compression=None if self.compression == "none" else self.compression)
        return pa.ipc.new_file(sink, self.schema, options=opts)

    def _run(self) -> None:
        writer = None
        try:
            while True:
                item = self._q.get()
                if item is None:
                    break
                if writer is None:
                    writer = self._open()
                if self.file_format == df.PARQUET:
                    writer.write_table(item, row_group_size=item.num_rows)
                else:
                    writer.write_table(item, max_chunksize=item.num_rows)
            if writer is None:
                writer = self._open()
            writer.close()
            self._file.flush()
        except BaseException as e:  # reported to the caller on the next append/close
            self._err = e
            while True:  # drain so the producer never blocks on a dead thread
                try:
                    if self._q.get_nowait() is None:
                        break
                except queue.Empty:
                    time.sleep(0.01)
        finally:
            self._file.close()

    def _check(self) -> None:
        if self._err is not None:
            raise self._err

    def append(self, table: pa.Table, nbytes: int) -> None:
        self._check()
        self._buf.append(table)
        self._buf_bytes += nbytes
        if self._buf_bytes >= ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._buf:
            t = pa.concat_tables(self._buf) if len(self._buf) > 1 else self._buf[0]
            self._buf, self._buf_bytes = [], 0
            while True:
                self._check()
                try:
                    self._q.put(t, timeout=0.5)
                    break
                except queue.Full:
                    continue

    def close(self) -> tuple[int, str]:
        """Finish the file: (bytes, sha256)."""
        self._flush()
        self._q.put(None)
        self._thread.join()
        self._check()
        return self._file.n, self._file.h.hexdigest()

    def abandon(self) -> None:
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=5)
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _write_captures(path: str, table: pa.Table, file_format: str, compression: str) -> tuple[int, str]:
    f = _HashingFile(path)
    try:
        sink = pa.PythonFile(f, mode="w")
        if file_format == df.PARQUET:
            pq.write_table(table, sink, compression=None if compression == "none" else compression)
        else:
            with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(
                    compression=None if compression == "none" else compression)) as w:
                w.write_table(table)
        f.flush()
    finally:
        f.close()
    return f.n, f.h.hexdigest()


# -- the recorder --


@dataclass
class Limits:
    max_bytes: int | None = None  # uncompressed row bytes
    max_captures: int | None = None
    duration_s: float | None = None


@dataclass
class RecordOptions:
    writer: str = field(default_factory=df.default_writer_id)
    file_format: str = df.PARQUET
    compression: str = "zstd"
    tensor_compression: str = TENSOR_COMPRESSION  # Parquet float tensor columns; Arrow IPC uses `compression`
    parallel_shards: int = PARALLEL_SHARDS
    shard_bytes: int = df.DEFAULT_SHARD_BYTES
    shard_age_s: float | None = None
    checkpoint_s: float = 10.0
    staging: str | None = None
    layout: df.TensorLayout | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    storage_options: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """One writer's recorder on DEST. `open()` recovers after a crash; `feed_*` drive it;
    `close()` commits what is open. Every method raises RecorderError with one line on failure."""

    def __init__(self, dest: str, opts: RecordOptions) -> None:
        if opts.file_format not in df.FILE_FORMATS:
            raise RecorderError(f"--format {opts.file_format}: use one of {', '.join(df.FILE_FORMATS)}")
        if opts.compression not in COMPRESSIONS:
            raise RecorderError(f"--compression {opts.compression}: use one of {', '.join(COMPRESSIONS)}")
        if opts.tensor_compression not in COMPRESSIONS:
            raise RecorderError(f"--tensor-compression {opts.tensor_compression}: use one of {', '.join(COMPRESSIONS)}")
        try:
            df.check_writer_id(opts.writer)
        except ValueError as e:
            raise RecorderError(str(e)) from None
        self.dest = dest
        self.opts = opts
        try:
            self.store = DatasetStore(dest, opts.storage_options)
        except StoreError as e:
            raise RecorderError(str(e)) from None
        if not 1 <= opts.parallel_shards <= MAX_LANES:
            raise RecorderError(f"--parallel-shards {opts.parallel_shards}: use 1..{MAX_LANES}")
        self.core: RecorderCore | None = None
        self._shards: dict[int, ShardFile] = {}  # the open group's staged shards, by index
        self._lock_fd: int | None = None
        self.staging = ""
        self.committed_bytes = 0

    # -- start: lock, read the manifest, remove what a crash left behind --

    def open(self) -> "Recorder":
        w = self.opts.writer
        try:
            self.staging = self.store.staging_dir(w, self.opts.staging)
            fd = os.open(os.path.join(self.staging, ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            raise RecorderError(f"cannot create the staging directory: {describe_error(e)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RecorderError(f"another recorder is writing {self.dest} as writer {w!r} on this host "
                                f"(use --writer to give this one another name)") from None
        self._lock_fd = fd
        try:
            raw = self.store.read_bytes(df.manifest_path(w))
            manifest = df.decode_manifest(raw, self.store.url(df.manifest_path(w))) if raw is not None else None
            self._remove_leftovers(manifest)
            self.core = RecorderCore(
                w, manifest, file_format=self.opts.file_format, layout=self.opts.layout,
                shard_bytes=self.opts.shard_bytes, shard_age_s=self.opts.shard_age_s,
                checkpoint_s=self.opts.checkpoint_s, metadata=self.opts.metadata, lanes=self.opts.parallel_shards)
        except (StoreError, df.ManifestError, ValueError) as e:
            self._unlock()
            raise RecorderError(str(e)) from None
        if manifest is not None:
            self.committed_bytes = manifest.bytes
            log.info("resuming %s as writer %s after seq %d (%d shards, %d rows committed)", self.dest, w,
                     manifest.committed_seq, len(manifest.shards), manifest.rows)
        return self

    def _remove_leftovers(self, manifest: df.Manifest | None) -> None:
        listed = {s.name for s in manifest.shards} if manifest is not None else set()
        w = self.opts.writer
        for sub in (df.ROWS_DIR, df.CAPTURES_DIR):
            for name in self.store.list_files(f"{df.writer_dir(w)}/{sub}"):
                if name not in listed:
                    log.info("removing %s/%s left by an interrupted run (no manifest lists it)", sub, name)
                    self.store.delete(f"{df.writer_dir(w)}/{sub}/{name}")
        for name in self.store.list_files(df.writer_dir(w)):
            if name.startswith(".tmp-"):
                self.store.delete(f"{df.writer_dir(w)}/{name}")
        for name in os.listdir(self.staging):
            if name != ".lock":
                try:
                    os.unlink(os.path.join(self.staging, name))
                except OSError:
                    pass

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def since(self) -> int | None:
        assert self.core is not None
        return self.core.since

    # -- the stream --

    def feed_capture(self, seq: int, begin: Any, capture: Any, gaps: list[tuple[int, int, str]] | None = None) -> None:
        assert self.core is not None
        self._do(self.core.add_capture(seq, begin, capture, gaps))

    def feed_lost(self, first: int, last: int, reason: str) -> None:
        assert self.core is not None
        self._do(self.core.add_lost(first, last, reason))

    def feed_watermark(self, last_seq: int) -> None:
        assert self.core is not None
        self._do(self.core.advance(last_seq))

    def tick(self) -> None:
        assert self.core is not None
        self._do(self.core.tick())

    def commit(self) -> None:
        """Seal and commit the open shards and write the manifest now; recording goes on in new ones."""
        if self.core is not None:
            self._do(self.core.finish())
            self._do(self.core.finish_manifest())

    def close(self) -> None:
        """Seal and commit the open shard, write the last manifest, release the lock."""
        try:
            self.commit()
        finally:
            self._unlock()

    def abort(self) -> None:
        """Stop without committing the open shard (it is re-recorded after the next start)."""
        for shard in self._shards.values():
            shard.abandon()
        self._shards = {}
        self._unlock()

    # -- carrying out the core's actions --

    def _do(self, actions: list) -> None:
        assert self.core is not None
        for a in actions:
            try:
                if isinstance(a, AppendRows):
                    shard = self._shards.get(a.index)
                    if shard is None:
                        shard = self._shards[a.index] = ShardFile(
                            os.path.join(self.staging, f"rows-{a.index:06d}"), self.core.schema, self.opts.file_format,
                            self.opts.compression, self.opts.tensor_compression)
                    shard.append(a.table, a.nbytes)
                    failpoint("mid-shard")
                elif isinstance(a, SealShard):
                    self._commit_shard(a)
                elif isinstance(a, WriteManifest):
                    self._write_manifest(a.manifest)
            except StoreError as e:
                self.abort()
                raise RecorderError(str(e)) from None
            except OSError as e:
                self.abort()
                raise RecorderError(f"cannot write the shard in {self.staging}: {describe_error(e)}") from None

    def _commit_shard(self, seal: SealShard) -> None:
        assert self.core is not None
        w = self.opts.writer
        shard = self._shards.pop(seal.index, None)
        staged_rows = os.path.join(self.staging, f"rows-{seal.index:06d}")
        if shard is None:  # a shard of captures without rows: an empty rows file keeps the pair
            shard = ShardFile(staged_rows, self.core.schema or df.row_schema(self.core.manifest.layout),
                              self.opts.file_format, self.opts.compression, self.opts.tensor_compression)
        rows_bytes, rows_sha = shard.close()
        staged_caps = os.path.join(self.staging, f"captures-{seal.index:06d}")
        caps_bytes, caps_sha = _write_captures(staged_caps, seal.captures, self.opts.file_format, self.opts.compression)
        failpoint("before-upload")
        self.store.publish(staged_rows, df.rows_path(w, seal.name),
                           on_progress=lambda n: failpoint("mid-upload") if n < rows_bytes else None)
        failpoint("after-rows-upload")
        self.store.publish(staged_caps, df.captures_path(w, seal.name))
        failpoint("after-upload")
        m = self.core.shard_committed(seal, rows_bytes=rows_bytes, rows_sha256=rows_sha, captures_bytes=caps_bytes,
                                      captures_sha256=caps_sha)
        if m is not None:  # the group's last shard: one manifest lists them all
            self._write_manifest(m)
        self.committed_bytes += rows_bytes + caps_bytes
        log.debug("committed shard %s: %d rows, %d bytes, seq %d..%d", seal.name, seal.rows, rows_bytes,
                  seal.seq_first, seal.seq_last)

    def _write_manifest(self, m: df.Manifest) -> None:
        assert self.core is not None
        self.store.replace_small(df.manifest_path(self.opts.writer), df.encode_manifest(m))
        failpoint("after-manifest")
        self.core.manifest_written(m)


# -- driving a recorder from a watch stream --


def _item_kind(item: Any) -> str:
    if hasattr(item, "first") and hasattr(item, "last") and hasattr(item, "reason"):
        return "lost"
    if hasattr(item, "seq") and hasattr(item, "capture"):
        return "capture"
    if type(item).__name__ == "DaemonStopping":
        return "daemon stopping"
    if type(item).__name__ == "Watermark":
        return "watermark"
    return "other"


class StreamFailed(Exception):
    """The watch stream raised `cause`; what the recorder held was committed first."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _gaps_of(item: Any) -> list[tuple[int, int, str]] | None:
    gaps = getattr(item, "gaps", None)
    if not gaps:
        return None
    out = []
    for g in gaps:
        r = g.positions
        out.append((r.start, r.stop, g.reason))
    return out


class Progress:
    """A progress line on a terminal (tqdm), a log line every `every_s` otherwise."""

    def __init__(self, stream: Any = None, every_s: float = 10.0, tty: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s
        self.t0 = time.monotonic()
        self.last = 0.0
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(file=self.stream, bar_format="{desc}", leave=True)

    def line(self, rec: Recorder, head_seq: int | None) -> str:
        assert rec.core is not None
        s = rec.core.stats
        dt = max(time.monotonic() - self.t0, 1e-9)
        lag = f"{max(0, head_seq - s.last_seq)}" if head_seq is not None and s.last_seq >= 0 else "-"
        return (f"{s.captures} captures ({s.captures / dt:.1f}/s)  {s.rows} rows ({s.rows / dt:.0f}/s)  "
                f"{s.tensor_bytes / dt / 1e6:.1f} MB/s  shards {s.shards} ({rec.committed_bytes / 1e9:.2f} GB)  "
                f"seq {s.last_seq}  lag {lag}  lost {s.lost}  missing {s.missing_positions}  skipped {s.skipped}")

    def update(self, rec: Recorder, head_seq: int | None = None, force: bool = False) -> None:
        now = time.monotonic()
        if self.bar is not None:
            if force or now - self.last >= 0.5:
                self.bar.set_description_str(self.line(rec, head_seq))
                self.last = now
        elif force or now - self.last >= self.every_s:
            log.info("record: %s", self.line(rec, head_seq))
            self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_recorder(rec: Recorder, items: Iterable[Any], limits: Limits, *, progress: Progress | None = None,
                 head_seq: Callable[[], int | None] = lambda: None, stop: threading.Event | None = None) -> str:
    """Feed a watch stream into `rec` until a limit, `stop`, or the end of `items`; commit what is
    open and return why it stopped. `items` may yield None when idle (lets ticks and stop run).
    A DaemonStopping item commits what is held and goes on; an error from `items` commits what is
    held and raises StreamFailed.
    Watermarks must come in the stream (watch(..., watermarks=True)), in order with the captures:
    a watermark read from the side could pass captures still queued."""
    assert rec.core is not None
    t0 = time.monotonic()
    stop = stop or threading.Event()
    why = "the stream ended"
    stopping = False
    stream = iter(items)
    try:
        while True:
            try:
                item = next(stream)
            except StopIteration:
                break
            except Exception as e:
                # The stream broke (no daemon answered for the watch's timeout, say): everything
                # fed so far is whole and in order, so it is committed rather than re-recorded from
                # a daemon that may no longer hold it.
                rec.close()
                raise StreamFailed(e) from e
            if item is None and stopping:
                break  # what was already received is in; commit it
            if item is not None:
                kind = _item_kind(item)
                if kind == "capture":
                    rec.feed_capture(item.seq, getattr(item, "begin", None), item.capture, _gaps_of(item))
                elif kind == "lost":
                    rec.feed_lost(item.first, item.last, item.reason)
                elif kind == "watermark":
                    rec.feed_watermark(item.seq)
                elif kind == "daemon stopping":
                    # The captures the stopping daemon retains go with it: a recorder restarted
                    # later could not record them again, so what is held is committed now.
                    rec.feed_watermark(item.seq)
                    rec.commit()
                    log.info("the daemon is stopping (%s): committed up to seq %d; waiting for the next daemon",
                             item.reason, rec.core.manifest.committed_seq)
            rec.tick()
            if progress is not None:
                progress.update(rec, head_seq())
            s = rec.core.stats
            if limits.max_captures is not None and s.captures >= limits.max_captures:
                why = f"--max-captures {limits.max_captures} reached"
                break
            if limits.max_bytes is not None and s.tensor_bytes >= limits.max_bytes:
                why = f"--max-bytes {limits.max_bytes} reached"
                break
            if limits.duration_s is not None and time.monotonic() - t0 >= limits.duration_s:
                why = f"--duration {limits.duration_s:g} s reached"
                break
            if stop.is_set() and not stopping:
                why = "stopped"
                stopping = True  # take in what is already queued here, then stop
    except (RecorderError, StreamFailed):
        raise
    except BaseException:
        rec.abort()
        raise
    rec.close()
    if progress is not None:
        progress.update(rec, head_seq(), force=True)
        progress.close()
    return why


def install_stop_signals(stop: threading.Event) -> None:
    """SIGTERM / SIGINT: commit what is open and exit 0 (a second SIGINT interrupts)."""
    def handler(signum: int, frame: Any) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
