"""Where a dataset lives: a directory or any fsspec URL, with the two operations the commit protocol
needs from it: make a staged file visible under its final name only once complete, and replace a
small file (the manifest) atomically.

- Local directory: stage inside DEST (`writers/{w}/.staging/`, same filesystem), fsync, rename
  (atomic), fsync the directory. The shard is written once; no copy.
- Object store (s3, gs, az, ...): stage on local disk, upload; an object appears only when its
  upload completes (a single PUT, or a multipart upload's completion), and a PUT replaces an object
  atomically, so the manifest is simply put.
- Other fsspec filesystems: upload to a dot-prefixed temporary name, then move it into place.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from typing import Any, Callable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from vllm_tap import dataset_format as df

log = logging.getLogger(__name__)

OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}
UPLOAD_PART_BYTES = 8 << 20  # multipart upload part size (S3 needs >= 5 MiB per part)
RETRIES = 3


class StoreError(RuntimeError):
    """The destination cannot be written (full, unreachable, refused): one line for the user."""


def describe_error(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return "no space left on device"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _failpoint_spec() -> tuple[str, int] | None:
    raw = os.environ.get("VLLM_TAP_RECORD_FAILPOINT", "")
    if not raw:
        return None
    name, _, k = raw.partition(":")
    return name, int(k or 1)


_FAILPOINT = _failpoint_spec()
_FAILPOINT_HITS: dict[str, int] = {}


def failpoint(name: str) -> None:
    """Crash testing: SIGKILL this process the k-th time `name` is reached when
    VLLM_TAP_RECORD_FAILPOINT=name[:k] (see tests/datasets/test_record.py). A no-op otherwise."""
    if _FAILPOINT is None or _FAILPOINT[0] != name:
        return
    _FAILPOINT_HITS[name] = _FAILPOINT_HITS.get(name, 0) + 1
    if _FAILPOINT_HITS[name] >= _FAILPOINT[1]:
        import signal

        log.warning("failpoint %s: SIGKILL", name)
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DatasetStore:
    """A dataset root (DEST) and one writer's corner of it."""

    def __init__(self, dest: str, storage_options: dict[str, Any] | None = None) -> None:
        self.dest = dest
        try:
            self.fs, root = fsspec.core.url_to_fs(dest, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise StoreError(f"{dest}: {describe_error(e)}") from None
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.object_store = not self.local and any(p in OBJECT_STORES for p in protocols)

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if self.root else rel

    def url(self, rel: str) -> str:
        return self.fs.unstrip_protocol(self.path(rel))

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        for attempt in range(RETRIES):
            try:
                return fn()
            except OSError as e:
                if e.errno == errno.ENOSPC or attempt == RETRIES - 1 or self.local:
                    raise StoreError(f"cannot {what}: {describe_error(e)}") from None
                log.warning("%s failed (%s); retrying", what, describe_error(e))
            except Exception as e:  # botocore and other client errors
                if attempt == RETRIES - 1:
                    raise StoreError(f"cannot {what}: {describe_error(e)}") from None
                log.warning("%s failed (%s); retrying", what, describe_error(e))
            time.sleep(0.5 * 2 ** attempt)

    # -- reading --

    def read_bytes(self, rel: str) -> bytes | None:
        p = self.path(rel)

        def get() -> bytes | None:
            try:
                return self.fs.cat_file(p)
            except FileNotFoundError:
                return None

        return self._retry(f"read {self.url(rel)}", get)

    def list_files(self, rel_dir: str) -> list[str]:
        """Names of the files directly under rel_dir (none if it does not exist)."""
        p = self.path(rel_dir)

        def ls() -> list[str]:
            try:
                entries = self.fs.ls(p, detail=True, refresh=True) if not self.local else self.fs.ls(p, detail=True)
            except FileNotFoundError:
                return []
            return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "file"]

        return self._retry(f"list {self.url(rel_dir)}", ls)

    def list_dirs(self, rel_dir: str) -> list[str]:
        p = self.path(rel_dir)

        def ls() -> list[str]:
            try:
                entries = self.fs.ls(p, detail=True, refresh=True) if not self.local else self.fs.ls(p, detail=True)
            except FileNotFoundError:
                return []
            return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"]

        return self._retry(f"list {self.url(rel_dir)}", ls)

    def delete(self, rel: str) -> None:
        p = self.path(rel)

        def rm() -> None:
            try:
                self.fs.rm_file(p)
            except FileNotFoundError:
                pass

        self._retry(f"delete {self.url(rel)}", rm)

    # -- writing --

    def staging_dir(self, writer: str, local_staging: str | None) -> str:
        """Where shards of `writer` are staged: inside DEST for a local DEST, else on local disk."""
        if self.local and local_staging is None:
            d = self.path(f"{df.writer_dir(writer)}/.staging")
        else:
            base = local_staging or os.path.join(os.path.expanduser("~/.cache/vllm-tap/record"),
                                                 hashlib.sha1(self.dest.encode()).hexdigest()[:12])
            d = os.path.join(base, writer)
        os.makedirs(d, exist_ok=True)
        return d

    def publish(self, staged: str, rel: str, on_progress: Callable[[int], None] | None = None) -> None:
        """Make the complete local file `staged` visible as `rel` (atomically; `staged` is consumed)."""
        dst = self.path(rel)
        if self.local:
            d = os.path.dirname(dst)
            try:
                os.makedirs(d, exist_ok=True)
                with open(staged, "rb+") as f:
                    os.fsync(f.fileno())
                if os.stat(staged).st_dev == os.stat(d).st_dev:
                    os.replace(staged, dst)
                else:  # staging on another disk: copy to a hidden name, then rename
                    tmp = os.path.join(d, f".tmp-{os.path.basename(dst)}")
                    with open(staged, "rb") as src, open(tmp, "wb") as out:
                        while chunk := src.read(8 << 20):
                            out.write(chunk)
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(tmp, dst)
                    os.unlink(staged)
                _fsync_dir(d)
            except OSError as e:
                raise StoreError(f"cannot write {dst}: {describe_error(e)}") from None
            return
        cb = None
        if on_progress is not None:
            from fsspec.callbacks import Callback

            class _CB(Callback):
                def relative_update(self, inc: int = 1) -> None:
                    super().relative_update(inc)
                    on_progress(self.value)

            cb = _CB()
        if self.object_store:
            kw: dict[str, Any] = {"callback": cb} if cb is not None else {}
            if self.fs.protocol and "s3" in (self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)):
                kw["chunksize"] = UPLOAD_PART_BYTES
            self._retry(f"upload {self.url(rel)}", lambda: self.fs.put_file(staged, dst, **kw))
        else:
            tmp = dst.rsplit("/", 1)[0] + "/.tmp-" + dst.rsplit("/", 1)[-1]
            self._retry(f"upload {self.url(rel)}", lambda: self.fs.put_file(staged, tmp))
            self._retry(f"rename into {self.url(rel)}", lambda: self.fs.mv(tmp, dst))
        os.unlink(staged)

    def replace_small(self, rel: str, data: bytes) -> None:
        """Replace a small file atomically (the manifest): readers see the old or the new bytes."""
        dst = self.path(rel)
        if self.local:
            d = os.path.dirname(dst)
            tmp = os.path.join(d, f".tmp-{os.path.basename(dst)}")
            try:
                os.makedirs(d, exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                failpoint("mid-manifest")
                os.replace(tmp, dst)
                _fsync_dir(d)
            except OSError as e:
                raise StoreError(f"cannot write {dst}: {describe_error(e)}") from None
            return
        failpoint("mid-manifest")
        if self.object_store:
            self._retry(f"write {self.url(rel)}", lambda: self.fs.pipe_file(dst, data))
        else:
            tmp = dst.rsplit("/", 1)[0] + "/.tmp-" + dst.rsplit("/", 1)[-1]
            self._retry(f"write {self.url(rel)}", lambda: self.fs.pipe_file(tmp, data))
            self._retry(f"rename into {self.url(rel)}", lambda: self.fs.mv(tmp, dst))
