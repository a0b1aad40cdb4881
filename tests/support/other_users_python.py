"""An interpreter other local accounts can run, for the tests that run code as those accounts
(test_access.py, through as_user.py).

Why: the interpreter running the suite may live where other accounts cannot enter (a pyenv or a
virtualenv under /root, mode 0700). Importing modules as root before dropping privileges is not
enough: code imports lazily (numpy's `savez` imports `zipfile` when called), so what works would
depend on what the environment happened to import. Instead, once per test session, `build()` puts in
a world-readable directory the interpreter binary and its shared library, the standard library, the
distributions the project depends on at run time (pyproject's `dependencies` and theirs, found from
their metadata) and the project's packages (pyproject's package map) plus the test helpers. Files are
hard-linked where the file system allows, else copied.

Rules kept here:
- What goes in is computed from metadata and pyproject, never listed by hand.
- Nothing in the tree refers to a path outside it except the system's own libraries;
  `unreachable_for_others` names every file a process maps or imports that an account in no group
  could not open, so a test can check the tree without root.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

from project_layout import SUPPORT, package_dirs, pyproject

# Parts of the standard library no code run as another account needs (the test suite alone is 120 MB).
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3"}


@dataclass(frozen=True)
class OtherUsersPython:
    root: str  # world-readable; removed by the session fixture

    @property
    def python(self) -> str:
        """A launcher other accounts can execute (sets the library path for the shared libpython)."""
        return os.path.join(self.root, "bin", "python")

    @property
    def tests(self) -> str:
        """The copy of the tests/support helpers (as_user.py, synthetic_writer.py, ...)."""
        return os.path.join(self.root, "tests")

    def as_user(self, user: str, *args: str) -> list[str]:
        """argv running `args` (-m MODULE ... | -c CODE ... | SCRIPT ...) as `user` (the caller must be root)."""
        return [self.python, os.path.join(self.tests, "as_user.py"), user, "--", *args]


def _place(src: str, dst: str) -> None:
    """A hard link when the file is already readable by all (a link shares the original's mode, which
    must never change), else a copy opened up."""
    if os.path.lexists(dst):  # a RECORD may list a file twice
        return
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    mode = os.stat(src).st_mode
    if mode & stat.S_IROTH and (mode & stat.S_IXOTH or not mode & stat.S_IXUSR):
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system, or links refused
            pass
    shutil.copy2(src, dst)
    os.chmod(dst, stat.S_IMODE(mode) | 0o444 | (0o111 if mode & stat.S_IXUSR else 0))


def _place_tree(src: str, dst: str, skip: set[str] = frozenset()) -> None:
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n in skip], copy_function=_place,
                    symlinks=False, dirs_exist_ok=True)


def _requirements_closure(names: list[str]) -> list[md.Distribution]:
    """The installed distributions `names` need at run time (no extras), with theirs, once each."""
    from packaging.requirements import Requirement

    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in seen:
            continue
        dist = md.distribution(req.name)  # PackageNotFoundError: the environment misses a dependency
        seen[key] = dist
        todo += dist.requires or []
    return list(seen.values())


def _place_distribution(dist: md.Distribution, site: str) -> None:
    base = os.path.realpath(str(dist.locate_file("")))
    for f in dist.files or []:
        src = os.path.realpath(str(dist.locate_file(f)))
        if not src.startswith(base + os.sep) or not os.path.isfile(src):
            continue  # scripts in bin/, files RECORD lists but the install left out
        _place(src, os.path.join(site, os.path.relpath(src, base)))


def _place_project(site: str) -> None:
    """The project's packages as a regular install lays them out (pyproject's packages + package-dir)."""
    for pkg, src in package_dirs().items():
        for name in os.listdir(src):
            if name.endswith(".py"):
                _place(os.path.join(src, name), os.path.join(site, *pkg.split("."), name))
    try:  # its metadata too (the version, the entry points), when it is installed
        dist = md.distribution("vllm-tap")
        meta = str(dist._path)  # type: ignore[attr-defined]
        _place_tree(meta, os.path.join(site, os.path.basename(meta)))
    except (md.PackageNotFoundError, AttributeError):
        pass


def build(parent: str | None = None) -> OtherUsersPython:
    """Make the tree (about 150 MB when copied; hard links cost nothing) and return it."""
    root = tempfile.mkdtemp(prefix="vllm-tap-python-", dir=parent)
    try:
        _fill(root)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return OtherUsersPython(root)


def _fill(root: str) -> None:
    os.chmod(root, 0o755)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    binary = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    real = os.path.join(root, "bin", ver)
    _place(binary, real)
    # The interpreter finds its prefix from lib/pythonX.Y/os.py next to ../ of the binary: the tree's.
    stdlib = os.path.join(root, "lib", ver)
    _place_tree(os.path.dirname(os.__file__), stdlib, STDLIB_SKIP)
    dynload = os.path.dirname(getattr(sys.modules.get("_struct"), "__file__", "") or "") or None
    if dynload and not dynload.startswith(os.path.dirname(os.__file__)):
        _place_tree(dynload, os.path.join(stdlib, "lib-dynload"))
    libdir = os.path.join(root, "lib")
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        so = sysconfig.get_config_var("INSTSONAME")
        _place(os.path.join(sysconfig.get_config_var("LIBDIR"), so), os.path.join(libdir, so))
    launcher = os.path.join(root, "bin", "python")
    with open(launcher, "w") as f:
        # -E: nothing from the caller's PYTHONPATH/PYTHONHOME leads the interpreter back out of the tree.
        f.write(f'#!/bin/sh\nLD_LIBRARY_PATH="{libdir}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" '
                f'exec "{real}" -E "$@"\n')
    os.chmod(launcher, 0o755)
    site = _site_dir(launcher, root)
    for dist in _requirements_closure(pyproject()["project"]["dependencies"]):
        _place_distribution(dist, site)
    _place_project(site)
    for name in os.listdir(SUPPORT):
        if name.endswith(".py"):
            _place(os.path.join(SUPPORT, name), os.path.join(root, "tests", name))
    for d, _, _ in os.walk(root):  # files were opened up as placed (_place)
        os.chmod(d, 0o755)


class CannotRun(Exception):
    """The tree cannot be executed where it was made (a file system mounted noexec)."""


def _site_dir(launcher: str, root: str) -> str:
    """The tree's own site directory, as the copied interpreter names it (site-packages, or a
    distribution's own layout such as Debian's dist-packages)."""
    try:
        r = subprocess.run([launcher, "-c", "import site; print('\\n'.join(site.getsitepackages()))"],
                           capture_output=True, text=True, timeout=60, cwd="/")
    except PermissionError as e:
        raise CannotRun(f"{root} does not allow executing files ({e})") from e
    assert r.returncode == 0, f"the copied interpreter in {root} does not start: {r.stderr[-1000:]}"
    inside = [p for p in r.stdout.split() if p.startswith(root + os.sep)]
    assert inside, f"the copied interpreter in {root} has no site directory inside it: {r.stdout.split()}"
    os.makedirs(inside[0], exist_ok=True)
    return inside[0]


def unreachable_for_others(paths: list[str]) -> list[str]:
    """Those of `paths` an account that is neither owner nor in the group could not open (by the mode
    bits: every directory above needs o+x, the file o+r)."""
    bad = []
    for p in paths:
        p = os.path.realpath(p)
        parts = p.split(os.sep)
        dirs = [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]
        ok = all(os.stat(d).st_mode & stat.S_IXOTH for d in dirs) and bool(os.stat(p).st_mode & stat.S_IROTH)
        if not ok:
            bad.append(p)
    return bad
