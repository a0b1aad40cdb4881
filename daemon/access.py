"""Who may touch what the daemon reads and serves: rings on one side, the subscriber socket on the other.

Two roles, two groups (docs/operate.md, "Access model"):
- writers (the vLLM service) and the daemon share ring access: `ring_group` owns the shm directory,
  the instance directories and the rings; subscribers are not in it, so they can neither read nor
  forge a ring;
- subscribers reach only the daemon's socket: `socket_group` owns the ipc socket (0660) and its
  directory (0750). Over tcp they authenticate with CURVE keys (daemon/curve.py).

Rules this module keeps:
- The shm directory is made by the daemon when it is missing (mode 2770 in `ring_group`, else 0700)
  and refused at start-up when it exists but is a link, is owned by someone untrusted, belongs to
  another group or is looser than configured: one line naming it, non-zero exit.
- An instance directory or a ring that fails the same rules is not read: one line, counted
  (`rings_refused`, `dirs_refused` in status). Rings and directories are opened without following
  links (discovery.py) and judged by fstat of what was opened.
- The arena's directory (`arena_dir`, default `<shm_dir>.arena`) is the daemon's own: made 0750 in
  `socket_group` (0700 without) when missing; an existing one must be ours, not a link, no looser
  than that (setgid allowed), else start-up stops with one line naming it. One of ours in another
  group is handed to `socket_group`. The arena file in it is 0640 in that group: subscribers map
  it read-only, writers and everyone else cannot even list the directory. It is not under the
  shm directory, which readers may not enter, and not in /run, usually a small tmpfs (the arena
  may grow to `arena_bytes`, 2 GiB by default); /dev/shm is already sized for shared memory.
- The socket's directory is made 0700 (0750 in `socket_group`) when missing; an existing one must be
  ours with no more than that mode, or root's and not writable by others (/run, /tmp): otherwise
  start-up stops with one line naming it. The socket itself is then narrowed to 0600 (0660 in
  `socket_group`), whatever the umask.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass

from vllm_tap.safe_paths import (Expect, UnsafePath, dir_mode, ensure_dir, gid_of, group_name, me, open_dir, uid_of,
                                 user_name)

from .config import DaemonConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RingAccess:
    """The rules rings and their directories must pass before the daemon reads them."""

    root: Expect  # the shm directory
    dirs: Expect  # instance directories
    files: Expect  # rings
    root_mode: int
    root_gid: int | None

    @classmethod
    def from_config(cls, cfg: DaemonConfig) -> "RingAccess":
        gid = gid_of(cfg.ring_group) if cfg.ring_group else None
        owners = frozenset(uid_of(u.strip()) for u in cfg.ring_owners.split(",") if u.strip())
        # Inside a directory that passes, only its group's members (or root) can make entries, so
        # without ring_owners any owner is accepted there; the shm directory itself must be made by
        # us, root, a listed owner, or a member of ring_group (the group vouches for its members).
        inner_owners = (owners | me()) if owners else None
        dmode = dir_mode(cfg.ring_mode)
        return cls(
            root=Expect(dmode, owners | me(), gid, vouching_group=gid, sticky_root_ok=True),
            dirs=Expect(dmode, inner_owners, gid),
            files=Expect(cfg.ring_mode, inner_owners, gid),
            root_mode=(stat.S_ISGID | 0o770) if gid is not None else 0o700,
            root_gid=gid,
        )

    def prepare_root(self, shm_dir: str) -> None:
        """Make the shm directory, or check the one that is there (UnsafePath: one line)."""
        ensure_dir(shm_dir, self.root_mode, self.root, gid=self.root_gid, what="shm directory")


def socket_gid(cfg: DaemonConfig) -> int | None:
    return gid_of(cfg.socket_group) if cfg.socket_group else None


def socket_path(endpoint: str) -> str | None:
    """The file of an ipc:// endpoint (None: tcp, or Linux's abstract namespace)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return None if not path or path.startswith("@") else path


def prepare_socket_dir(directory: str, gid: int | None) -> None:
    """Make (or check) the directory the ipc socket goes in; UnsafePath (one line) when it is not safe."""
    mode = 0o750 if gid is not None else 0o700
    try:
        fd = open_dir(directory, "socket directory")
    except FileNotFoundError:
        ensure_dir(directory, mode, Expect(mode | stat.S_ISGID, me(), gid), gid=gid, what="socket directory")
        return
    try:
        st = os.fstat(fd)
        perm = stat.S_IMODE(st.st_mode)
        private = mode | stat.S_ISGID | stat.S_ISVTX
        if st.st_uid == 0 and (os.geteuid() != 0 or perm & ~private):
            # Root's, and not a private directory of our own (/run, /tmp): trusted as long as nobody
            # else can replace what we put in it.
            if perm & 0o022 and not perm & stat.S_ISVTX:
                raise UnsafePath(f"socket directory {directory} is writable by others: use another endpoint")
            return
        if st.st_uid != os.geteuid():
            raise UnsafePath(f"socket directory {directory} is owned by {user_name(st.st_uid)}, not by "
                             f"{user_name(os.geteuid())}: remove it (whoever made it could answer this daemon's "
                             "clients) or use another endpoint")
        if perm & ~private:
            raise UnsafePath(f"socket directory {directory} has mode {perm:04o}, looser than "
                             f"{mode:04o}: chmod {mode:o} it or remove it")
        if gid is not None and (st.st_gid != gid or perm & 0o050 != 0o050):
            # Ours (say systemd's RuntimeDirectory=, made in the unit's group): hand it to the subscribers.
            os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def prepare_arena_dir(directory: str, gid: int | None) -> bool:
    """Make (or check) the arena's directory; True when this call made it (the daemon removes it
    again at stop). UnsafePath (one line) when an existing one is not ours or is too open."""
    mode = 0o750 if gid is not None else 0o700
    expect = Expect(mode | stat.S_ISGID, frozenset({os.geteuid()}))
    try:
        fd = open_dir(directory, "arena directory")
    except FileNotFoundError:
        ensure_dir(directory, mode, Expect(mode, frozenset({os.geteuid()}), gid), gid=gid, what="arena directory",
                   parents=False)
        return True
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafePath(f"arena directory {directory} is owned by {user_name(st.st_uid)}, not by "
                             f"{user_name(os.geteuid())}: remove it (whoever made it could read the captures "
                             "placed in it) or set arena_dir")
        expect.check_fd(fd, directory, "arena directory")
        if gid is not None and st.st_gid != gid:
            try:  # ours (say made by tmpfiles.d in another group): hand it to the subscribers
                os.fchown(fd, -1, gid)
            except PermissionError:
                raise UnsafePath(f"cannot give arena directory {directory} to group {group_name(gid)}: this "
                                 f"account ({user_name(os.geteuid())}) is not in it") from None
        return False
    finally:
        os.close(fd)


def narrow_socket(endpoint: str, gid: int | None) -> None:
    """After bind: the socket file 0660 in the subscribers' group, or 0600, whatever the umask made it."""
    path = socket_path(endpoint)
    if path is None:
        return
    if gid is not None:
        os.chown(path, -1, gid, follow_symlinks=False)
    os.chmod(path, 0o660 if gid is not None else 0o600)
