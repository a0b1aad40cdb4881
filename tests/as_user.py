"""Test helper: run a Python module or script as another local user (the caller must be root).

    python tests/as_user.py USER -- -m vllm_tap.cli status ...
    python tests/as_user.py USER -- tests/synthetic_writer.py SHM '{...}'
    python tests/as_user.py USER -- -c 'CODE' ARGS...

The interpreter and every module the run may need are loaded first, as root (this project's Python
lives under /root, which other users cannot enter); then the process takes on USER's uid, gid and
supplementary groups (as `runuser` would) and only then runs the module. Every file, socket and
ring it touches afterwards is judged by the kernel as USER's.
"""

from __future__ import annotations

import importlib
import os
import pwd
import runpy
import sys
import warnings

PRELOAD = [
    "json", "pkgutil", "logging.handlers", "tomllib", "argparse", "ipaddress", "encodings.idna", "http.server", "ctypes",
    "numpy", "zmq", "zmq.auth", "zmq.asyncio", "msgpack", "msgspec", "click",
    "vllm_tap.cli", "vllm_tap.cli_keys", "vllm_tap.keys", "vllm_tap.ring", "vllm_tap.safe_paths",
    "vllm_tap.daemon.service", "vllm_tap.daemon.server", "vllm_tap.daemon.metrics", "vllm_tap.daemon.curve",
    "vllm_tap.daemon.access", "vllm_tap.daemon.sequence", "vllm_tap.daemon.watch", "vllm_tap.daemon.sdnotify",
    "vllm_tap.client", "vllm_tap.client.records", "vllm_tap.spec", "synthetic_writer",
]


def main() -> None:
    user = sys.argv[1]
    assert sys.argv[2] == "--", "usage: as_user.py USER -- (-m MODULE | -c CODE | SCRIPT) ARGS..."
    rest = sys.argv[3:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    for name in PRELOAD:
        importlib.import_module(name)
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
        # The module was preloaded on purpose (see above): not the mistake runpy warns about.
        warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
