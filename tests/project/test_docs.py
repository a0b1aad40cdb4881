"""The documentation says what the code does: every `vllm-tap ...` option the docs and the shipped
units show exists in that command's `--help`, every reason the code can give a missing position
(a Gap) is in the semantics table, and every reason a watch can report lost captures is named there."""

from __future__ import annotations

import glob
import os
import re

import pytest
from click.testing import CliRunner

from project_layout import REPO
from vllm_tap import wire_format as wf

DOCS = sorted([os.path.join(REPO, "README.md"), *glob.glob(os.path.join(REPO, "docs", "*.md")),
               *glob.glob(os.path.join(REPO, "systemd", "*.service")), os.path.join(REPO, "systemd", "vllm-serve-with-tap.conf")])
SEMANTICS = os.path.join(REPO, "docs", "semantics.md")
# A command line of the CLI: `vllm-tap CMD [SUB] ...` up to a comment, the end of inline code, a pipe,
# or the next shell command.
_COMMAND = re.compile(r"(?<![\w/-])vllm-tap\s+([a-z][a-z-]*)(?:\s+([a-z][a-z-]*))?([^`#|;&]*)")
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _cli():
    from vllm_tap.cli import main

    return main


def _help(path: tuple[str, ...]) -> str:
    r = CliRunner().invoke(_cli(), [*path, "--help"])
    assert r.exit_code == 0, (path, r.output)
    return r.output


def shown_options() -> dict[tuple[str, ...], set[tuple[str, str]]]:
    """(command, subcommand...) -> {(option, where it is shown)} for every command line in the docs,
    and for the recorder's RECORD_ARGS (options of `vllm-tap record` in an environment file)."""
    import click

    main = _cli()
    out: dict[tuple[str, ...], set[tuple[str, str]]] = {}
    for path in DOCS:
        name = os.path.relpath(path, REPO)
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for n, line in enumerate(lines, 1):
            found: list[tuple[tuple[str, ...], str]] = []
            for m in _COMMAND.finditer(line):
                cmd, sub, rest = m.group(1), m.group(2), m.group(3)
                if cmd not in main.commands:
                    continue  # `systemctl restart vllm-tap`, `vllm-tap` the unit or account
                group = main.commands[cmd]
                if isinstance(group, click.Group):
                    if sub not in group.commands:
                        continue
                    found.append(((cmd, sub), rest))
                else:
                    found.append(((cmd,), (sub or "") + rest))
            rec = re.match(r"\s*(?:#\s*)?RECORD_ARGS=(.*)", line)
            if rec:
                found.append((("record",), rec.group(1)))
            for key, rest in found:
                for opt in _OPTION.findall(rest):
                    out.setdefault(key, set()).add((opt, f"{name}:{n}"))
    return out


def test_the_docs_show_command_lines_of_every_kind():
    """The scan finds what it should (a scan that matched nothing would pass whatever the docs say)."""
    shown = shown_options()
    for key, opt in [(("record",), "--shard-age"), (("watch",), "--since"), (("daemon",), "--shm-dir"),
                     (("export", "saelens"), "--layer"), (("status",), "--endpoint"), (("record",), "--writer")]:
        assert opt in {o for o, _ in shown.get(key, set())}, (key, opt)


def test_every_option_the_docs_show_exists_in_that_commands_help():
    missing = []
    for key, opts in sorted(shown_options().items()):
        text = _help(key)
        for opt, where in sorted(opts):
            if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text):
                missing.append(f"{where}: vllm-tap {' '.join(key)} {opt}")
    assert not missing, "options the docs show that the command does not have:\n" + "\n".join(missing)


def _semantics_reasons() -> set[str]:
    """The first column of the gap-reason table, without a trailing ': …'."""
    with open(SEMANTICS, encoding="utf-8") as f:
        text = f.read()
    table = text.split("The reasons are:", 1)[1].lstrip("\n").split("\n\n", 1)[0]
    out = set()
    for row in table.splitlines():
        m = re.match(r"\s*\|\s*`([^`]+)`\s*\|", row)
        if m:
            out.add(re.sub(r"(:\s*)?…$", "", m.group(1)).strip())
    return out


def code_gap_reasons() -> dict[str, str]:
    """Every reason the code gives a Gap: the daemon's (the block of constants after "Why positions
    are missing" in daemon/events.py, read by name so a reason added there is checked too, and the
    PEER_* reasons of daemon/federation.py) and
    the client's own (a region reused before it was copied; positions a restarted daemon skipped)."""
    from vllm_tap.client import arena, stream
    from vllm_tap.daemon import events

    with open(events.__file__, encoding="utf-8") as f:
        source = f.read()
    block = source.split("# Why positions are missing", 1)[1].split("\n\n", 1)[0]
    names = re.findall(r"^([A-Z][A-Z_]*)\s*=", block, re.M)
    assert len(names) >= 10, names
    out = {f"daemon/events.py {n}": getattr(events, n) for n in names}
    from vllm_tap.daemon import federation  # a peer daemon's session ending: what its ranks still owed

    with open(federation.__file__, encoding="utf-8") as f:
        peer_names = re.findall(r"^(PEER_[A-Z_]+)\s*=\s*\"", f.read(), re.M)
    assert len(peer_names) >= 3, peer_names
    out |= {f"daemon/federation.py {n}": getattr(federation, n) for n in peer_names}
    out["client/arena.py OVERWRITTEN"] = arena.OVERWRITTEN
    out["client/stream.py LOST"] = stream.LOST
    return out


def test_every_gap_reason_the_code_can_emit_is_in_the_semantics_table():
    documented = _semantics_reasons()
    undocumented = [f"{where}: {reason!r}" for where, reason in code_gap_reasons().items()
                    if not any(reason == d or reason.startswith(d + ":") for d in documented)]
    assert not undocumented, f"gap reasons missing from docs/semantics.md (documented: {sorted(documented)}):\n" + \
        "\n".join(undocumented)


def test_every_reason_a_watch_reports_lost_captures_is_in_the_semantics():
    with open(SEMANTICS, encoding="utf-8") as f:
        text = f.read()
    watch = text.split("## The capture stream (watch)", 1)[1]
    assert [r for r in wf.LOST_REASONS if f"`{r}`" not in watch] == []


@pytest.mark.parametrize("reason", ["overwritten", "overloaded"])
def test_the_reasons_a_reader_meets_under_load_have_their_rows(reason):
    assert reason in _semantics_reasons()
