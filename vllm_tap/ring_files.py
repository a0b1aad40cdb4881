"""Where rings live and what both ends of one share: the paths of an instance's rings, the checks
that make or vouch for their directories, and the errors a ring file raises.

The writer (vllm_tap.ring_writer) runs inside vLLM and the reader (vllm_tap.ring_reader) in the
daemon; neither imports the other, both import this. A directory is made or checked by the rules of
vllm_tap.safe_paths: never a link, never someone else's unless its group vouches for it, never open
to others.
"""

from __future__ import annotations

import dataclasses
import os
import stat

from vllm_tap import ring_format as rf
from vllm_tap import safe_paths

class RingFormatError(RuntimeError):
    """The file is not a ring this version can read."""


class RingSpaceError(RuntimeError):
    """The file system cannot hold a ring of the asked size. One line: the directory, the space
    needed and what is free, and the setting to change."""

    def __init__(self, directory: str, needed: int, free: int):
        self.directory, self.needed, self.free = directory, needed, free
        super().__init__(
            f"vllm-tap: no room for a {_mib(needed)} ring in {directory} ({_mib(free)} free): give that file "
            f"system more room (containers: --shm-size) or lower vllm_tap.ring_bytes"
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still allocate on the file system holding `path` (or its
    nearest existing parent)."""
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def instance_dir(shm_dir: str, instance: str) -> str:
    return os.path.join(shm_dir, instance)


def ring_path(shm_dir: str, instance: str, rank: int) -> str:
    name = "engine" if rank == rf.ENGINE_RANK else f"rank-{rank:05d}"
    return os.path.join(instance_dir(shm_dir, instance), name + rf.RING_SUFFIX)


def _dir_rule(group: str | None) -> tuple[int | None, safe_paths.Expect]:
    gid = safe_paths.gid_of(group) if group is not None else None
    return gid, safe_paths.Expect(safe_paths.dir_mode(0o660), safe_paths.me(), vouching_group=gid)


def ensure_shm_dir(shm_dir: str, group: str | None = None) -> None:
    """The shm directory, made or checked by the rules of ensure_dir; UnsafePath (one line) otherwise."""
    gid, rule = _dir_rule(group)
    safe_paths.ensure_dir(shm_dir, (stat.S_ISGID | 0o770) if gid is not None else 0o700,
                          dataclasses.replace(rule, sticky_root_ok=True), gid=gid, what="shm directory")


def ensure_dir(path: str, mode: int = 0o700, group: str | None = None) -> None:
    """The instance directory `path` and the shm directory above it, made or checked (safe_paths):
    neither may be a link, someone else's (unless it belongs to `group`, whose members vouch for
    it), or open to others. UnsafePath (one line naming it) otherwise, which stops start-up: a
    squatted directory would let its maker read or forge every capture."""
    gid, rule = _dir_rule(group)
    parent = os.path.dirname(path)
    if parent:
        ensure_shm_dir(parent, group)
    # group may enter and read; setgid keeps new files in the group
    safe_paths.ensure_dir(path, (stat.S_ISGID | 0o750) if gid is not None else mode & 0o700, rule, gid=gid,
                          what="instance directory")

