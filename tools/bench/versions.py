"""Before/after in one run: the code of git revisions of this checkout measured beside it.

Each revision is checked out into a temporary worktree and imported through PYTHONPATH (a package
directory of symlinks, as the package-dir mapping lays it out), each version in an interpreter of
its own. `compare` runs one bench part (ingest, transport) that way, the versions interleaved
repeat by repeat and their order rotated, so load on a shared box falls on all of them alike;
`lines` gives each version's medians and this checkout's ratio to each other's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable

from vllm_tap.tools.bench import median


def checkout_root() -> str:
    # realpath: a package of symlinks (a version measured beside this one) still finds its checkout
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def _package_of(checkout: str, into: str) -> str:
    """A directory holding `vllm_tap` as the package-dir mapping makes it (the core with hooks/,
    daemon/, ... inside), built of symlinks into a checkout: what PYTHONPATH needs to import it."""
    pkg = os.path.join(into, "vllm_tap")
    os.makedirs(pkg)
    core = os.path.join(checkout, "vllm_tap")
    for name in os.listdir(core):
        os.symlink(os.path.join(core, name), os.path.join(pkg, name))
    for part in ("hooks", "daemon", "client", "tools", "cli"):
        if os.path.isdir(os.path.join(checkout, part)):
            os.symlink(os.path.join(checkout, part), os.path.join(pkg, part))
    return into


def check_revisions(revs: list[str]) -> None:
    """Each of `revs` names a commit of this checkout (RuntimeError naming the first that does not),
    before anything is measured."""
    root = checkout_root()
    for rev in revs:
        try:
            subprocess.run(["git", "-C", root, "rev-parse", "--verify", "-q", f"{rev}^{{commit}}"], check=True,
                           capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError):
            raise RuntimeError(f"--against {rev}: not a commit of a git checkout at {root}") from None


def this_version() -> str:
    root = checkout_root()
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "this install"


class Versions:
    """This checkout and the revisions `revs`, as [(label, PYTHONPATH or None)] while open; their
    worktrees are removed on close."""

    def __init__(self, revs: list[str]):
        self.revs = revs
        self.items: list[tuple[str, str | None]] = []
        self._tmp = ""
        self._trees: list[str] = []

    def __enter__(self) -> "Versions":
        self._tmp = tempfile.mkdtemp(prefix="vllm-tap-bench-versions-")
        self.items = [(this_version(), None)]
        root = checkout_root()
        try:
            for rev in self.revs:
                try:
                    sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", rev], check=True,
                                         capture_output=True, text=True).stdout.strip()
                    tree = os.path.join(self._tmp, f"tree-{sha}")
                    subprocess.run(["git", "-C", root, "worktree", "add", "--detach", "-q", tree, sha], check=True,
                                   capture_output=True, text=True)
                except (OSError, subprocess.CalledProcessError) as e:
                    detail = getattr(e, "stderr", "") or str(e)
                    raise RuntimeError(f"--against {rev}: not a revision of a git checkout at {root} "
                                       f"({detail.strip()})") from None
                self._trees.append(tree)
                self.items.append((sha, _package_of(tree, os.path.join(self._tmp, f"pkg-{sha}"))))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        root = checkout_root()
        for tree in self._trees:
            subprocess.run(["git", "-C", root, "worktree", "remove", "--force", tree], capture_output=True)
        shutil.rmtree(self._tmp, ignore_errors=True)

    @staticmethod
    def env(path: str | None) -> dict[str, str]:
        env = dict(os.environ)
        if path is not None:
            env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def rotated(self, r: int) -> list[tuple[str, str | None]]:
        k = r % len(self.items)
        return self.items[k:] + self.items[:k]


# The child: one run of a part with the version's own code (whatever its other helpers are).
_CHILD = """
import json, sys
from dataclasses import fields
from vllm_tap.tools.bench import {part} as m
P = m.{params}
known = {{f.name for f in fields(P)}}
p = P(**{{k: v for k, v in json.loads(sys.argv[1]).items() if k in known}})
res = m.run(p, sys.argv[2], echo=lambda s: print(s, file=sys.stderr, flush=True))
json.dump(res["summary"], sys.stdout)
"""
_PARAMS = {"ingest": "IngestParams", "transport": "TransportParams"}


def compare(part: str, params: dict[str, Any], revs: list[str], repeats: int, workdir: str,
            echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """`repeats` runs of `part` (one repeat each) per version, interleaved; each run's summary."""
    runs = []
    code = _CHILD.format(part=part, params=_PARAMS[part])
    with Versions(revs) as versions:
        for r in range(repeats):
            for label, path in versions.rotated(r):
                out = subprocess.run([sys.executable, "-c", code, json.dumps({**params, "repeats": 1}), workdir],
                                     env=Versions.env(path), cwd=workdir, capture_output=True, text=True, timeout=3600)
                if out.returncode != 0:
                    raise RuntimeError(f"the {part} bench of {label} failed:\n{out.stderr[-3000:]}")
                runs.append({"version": label, "repeat": r, "summary": json.loads(out.stdout)})
                echo(f"  {part} {label} r{r} done")
        labels = [label for label, _ in versions.items]
    return {"part": part, "versions": labels, "runs": runs}


def _metrics(part: str, summary: Any) -> dict[str, float]:
    """The numbers compared: ingest steps/s and daemon CPU per 1000 steps of each shape; transport
    p99 latency and GB/s per subscriber of each size, path and subscriber count."""
    out = {}
    if part == "ingest":
        for label, row in summary.items():
            out[f"{label}: steps/s"] = row["steps_per_s"]
            out[f"{label}: daemon CPU s / 1000 steps"] = row["daemon_cpu_s_per_kstep"]
    else:
        for row in summary:
            name = f"{row['size'] // 1024} KiB, {row['subscribers']} sub, {row['path']}"
            out[f"{name}: p99 ms"] = row["p99_ms"]
            out[f"{name}: GB/s per sub"] = row["gbps_per_sub"]
    return out


def lines(res: dict[str, Any]) -> list[str]:
    """A markdown table: each metric's median per version, and this checkout's over each other's."""
    labels = res["versions"]
    per: dict[str, dict[str, list[float]]] = {}
    for run in res["runs"]:
        for name, v in _metrics(res["part"], run["summary"]).items():
            per.setdefault(name, {}).setdefault(run["version"], []).append(v)
    head = ["metric", *labels, *(f"{labels[0]} / {b}" for b in labels[1:])]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by in per.items():
        meds = [median(by.get(v, [])) for v in labels]
        ratios = [f"{meds[0] / m:.2f}" if m else "-" for m in meds[1:]]
        out.append("| " + " | ".join([name, *(f"{m:.3g}" for m in meds), *ratios]) + " |")
    return out
