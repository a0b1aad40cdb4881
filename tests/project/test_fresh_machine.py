"""What the suite needs from a fresh machine, checked without root and without SAELens, so that a
machine set up differently from the one the suite was written on finds the same gaps:

- code the suite runs as other local accounts (test_access.py) runs on an interpreter those accounts
  can execute, and every file that interpreter maps or imports for the CLI, the daemon and numpy's
  lazily imported parts (`savez` -> zipfile) is open to them;
- a virtualenv made by `./run venv` (how `./run install` makes .venv-sae for SAELens) imports this
  checkout of the project and its run-time dependencies, also when ./run itself runs from a virtualenv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from other_users_python import unreachable_for_others
from project_layout import REPO

# What the accounts' runs import, plus a lazy import inside numpy; prints every file the process uses.
PROBE = """
import io, json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import vllm_tap.cli, vllm_tap.daemon.service, vllm_tap.client, synthetic_writer
np.savez(io.BytesIO(), a=np.zeros(3))
maps = {l.split(maxsplit=5)[5].strip() for l in open('/proc/self/maps') if len(l.split()) == 6}
files = {getattr(m, '__file__', None) for m in list(sys.modules.values())}
print(json.dumps({"files": sorted(p for p in maps | files if p and p.startswith('/')), "path": sys.path}))
"""


def _probe(python: str, tests: str) -> dict:
    # Without what vLLM's CPU platform puts in this process's LD_PRELOAD once a test imported it
    # (torch's libgomp): the accounts' processes are started without it.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run([python, "-c", PROBE, tests], capture_output=True, text=True, timeout=120, cwd="/", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_other_accounts_interpreter_opens_only_what_they_may(other_users_python):
    py = other_users_python
    got = _probe(py.python, py.tests)
    assert len(got["files"]) > 50, got["files"]  # numpy, zmq, the project: the probe saw real imports
    assert unreachable_for_others([os.path.realpath(py.python), *got["files"]]) == []
    # Nothing on the import path leads back out of the tree.
    assert [p for p in got["path"] if p and not p.startswith(py.root)] == []


def test_run_venv_imports_this_checkout_and_its_dependencies(tmp_path):
    venv = str(tmp_path / "venv")
    r = subprocess.run([os.path.join(REPO, "run"), "venv", venv, "--without-pip"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr
    code = "import json, vllm_tap.cli, vllm_tap.client, zmq, msgspec, msgpack, click; print(vllm_tap.__file__)"
    r = subprocess.run([os.path.join(venv, "bin", "python"), "-c", code], capture_output=True, text=True,
                       timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.path.realpath(r.stdout.strip()).startswith(os.path.realpath(REPO) + os.sep), r.stdout
