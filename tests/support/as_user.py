"""Test helper: run a Python module or script as another local user (the caller must be root).

    OTHER_PY tests/support/as_user.py USER -- -m vllm_tap.cli status ...
    OTHER_PY tests/support/as_user.py USER -- tests/support/synthetic_writer.py SHM '{...}'
    OTHER_PY tests/support/as_user.py USER -- -c 'CODE' ARGS...

OTHER_PY is an interpreter that USER can execute, with everything the run imports (the session's
copy from tests/support/other_users_python.py: the suite's own interpreter may live under /root, where other
accounts cannot enter, and code imports lazily). The process takes on USER's uid, gid and
supplementary groups (as `runuser` would) before it imports anything of the project, so every module,
file, socket and ring it touches is judged by the kernel as USER's.
"""

from __future__ import annotations

import os
import pwd
import runpy
import sys


def main() -> None:
    user = sys.argv[1]
    assert sys.argv[2] == "--", "usage: as_user.py USER -- (-m MODULE | -c CODE | SCRIPT) ARGS..."
    rest = sys.argv[3:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    pw = pwd.getpwnam(user)
    os.setgroups(os.getgrouplist(user, pw.pw_gid))
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    os.environ.update(HOME=pw.pw_dir, USER=user, LOGNAME=user)
    os.environ.pop("XDG_RUNTIME_DIR", None)
    os.chdir("/")
    if rest[0] == "-c":
        sys.argv = ["-c", *rest[2:]]
        exec(compile(rest[1], "<as_user -c>", "exec"), {"__name__": "__main__"})
    elif rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
