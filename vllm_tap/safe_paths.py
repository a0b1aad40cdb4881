"""Directories and files that someone else could have prepared for us: who owns them, how open they are.

The daemon, its subscribers and the vLLM hook meet at predictable paths (`/dev/shm/vllm-tap`,
`/run/vllm-tap`, `/tmp/vllm-tap-$UID`). A local user who creates such a path first could read or
forge captures, answer clients, or stop a service from starting. Rules this module keeps:
- Nothing is followed through a symbolic link: a path is opened O_NOFOLLOW (O_DIRECTORY for a
  directory) and judged by fstat of what was opened, never by a second look-up.
- A path is trusted when one of `owners` owns it (None: any owner; the checks below still apply) or,
  with `vouching_group`, when it belongs to that group: only the group's members and root can make
  a file or a directory belong to a group, so the group vouches for whoever made it.
- It must belong to `group` when one is given, and its mode must not grant any permission bit
  beyond `max_mode` ("looser than configured").
- A refusal is an UnsafePath whose message is one line naming the path, what is wrong, and what to do.

`Expect` holds one such rule; daemon/access.py builds the daemon's rules from its settings and
ring_files.ensure_dir the hook's. Anything else that puts files where others may look (an arena of
shared memory, say) can check them with `Expect.check_fd` / `ensure_dir` too.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from dataclasses import dataclass

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(RuntimeError):
    """A path we were about to trust is not safe; the message is one line naming it."""


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def gid_of(group: str) -> int:
    """A group name (or number) as a gid; KeyError naming it when there is no such group."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise KeyError(f"no group named {group!r}") from None


def uid_of(user: str) -> int:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        if user.isdigit():
            return int(user)
        raise KeyError(f"no user named {user!r}") from None


def me() -> frozenset[int]:
    """Owners always trusted: this process's user and root."""
    return frozenset({os.geteuid(), 0})


def dir_mode(file_mode: int) -> int:
    """The loosest directory mode that goes with a file mode: search where it may read, the setgid
    and sticky bits (they only narrow who owns what is made inside), and listing by others (names
    only: what is inside keeps its own mode; older versions made such directories 0755). Never
    writable by others."""
    return file_mode | ((file_mode & 0o444) >> 2) | stat.S_ISGID | stat.S_ISVTX | 0o005


@dataclass(frozen=True)
class Expect:
    """Who may own a path, which group it must belong to, and the loosest mode it may have."""

    max_mode: int
    owners: frozenset[int] | None = None  # None: any owner
    group: int | None = None  # the path must belong to this group
    vouching_group: int | None = None  # a path of this group is trusted whoever owns it
    # A directory of root's with the sticky bit (/dev/shm, /tmp, a tmpfs mount) passes whatever its
    # mode and group: nobody can remove or replace what another user made in it, and what is inside
    # is checked on its own.
    sticky_root_ok: bool = False

    def problem(self, st: os.stat_result) -> str | None:
        """What is wrong with a path of this stat (None: nothing)."""
        if self.sticky_root_ok and st.st_uid == 0 and st.st_mode & stat.S_ISVTX and stat.S_ISDIR(st.st_mode):
            return None
        if self.owners is not None and st.st_uid not in self.owners and not (
                self.vouching_group is not None and st.st_gid == self.vouching_group):
            allowed = ", ".join(sorted(user_name(u) for u in self.owners))
            return f"owned by {user_name(st.st_uid)}, not by {allowed}"
        if self.group is not None and st.st_gid != self.group:
            return f"group {group_name(st.st_gid)}, not {group_name(self.group)}"
        extra = stat.S_IMODE(st.st_mode) & ~self.max_mode
        if extra:
            return f"mode {stat.S_IMODE(st.st_mode):04o} is looser than {self.max_mode & 0o777:04o}"
        return None

    def check_fd(self, fd: int, path: str, what: str) -> os.stat_result:
        st = os.fstat(fd)
        why = self.problem(st)
        if why:
            raise UnsafePath(f"{what} {path} is {why}: {_remedy(path)}")
        return st


def _remedy(path: str) -> str:
    return "remove it or fix its owner and mode (whoever made it could read or replace what goes in it)"


def open_dir(path: str, what: str = "directory") -> int:
    """A descriptor of the directory itself, never of what a link there points to."""
    try:
        return os.open(path, DIR_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP or e.errno == errno.ENOTDIR and os.path.islink(path):
            raise UnsafePath(f"{what} {path} is a symbolic link (not followed): remove it") from None
        if e.errno == errno.ENOTDIR:
            raise UnsafePath(f"{what} {path} is not a directory: remove it") from None
        raise


def ensure_dir(path: str, mode: int, expect: Expect, *, gid: int | None = None, what: str = "directory",
               parents: bool = True) -> os.stat_result:
    """Make `path` with `mode` (and group `gid`) unless it exists; either way, return its stat once it
    passes `expect`, else raise UnsafePath (one line). Parents are made as by `os.makedirs`."""
    try:
        os.mkdir(path, mode & 0o777)
        created = True
    except FileExistsError:
        created = False
    except FileNotFoundError:
        if not parents:
            raise
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return ensure_dir(path, mode, expect, gid=gid, what=what, parents=False)
    fd = open_dir(path, what)
    try:
        if created:
            # mkdir honours the umask and never sets setgid: say exactly what we meant.
            if gid is not None:
                try:
                    os.fchown(fd, -1, gid)
                except PermissionError:
                    raise UnsafePath(f"cannot give {what} {path} to group {group_name(gid)}: "
                                     f"this account ({user_name(os.geteuid())}) is not in it") from None
            os.fchmod(fd, mode)
        return expect.check_fd(fd, path, what)
    finally:
        os.close(fd)
