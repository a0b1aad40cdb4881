"""Run the daemon as a service: logging, sd_notify readiness and watchdog, metrics, signals.

`python -m vllm_tap.daemon.service [--config FILE] [--KEY VALUE ...]` runs it without the CLI;
`vllm-tap daemon` is the same thing through click (see cli_entry).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Mapping

from vllm_tap.status_format import DaemonStatus

from .config import DaemonConfig
from .config_load import ConfigError, flag_name, load_config
from .sdnotify import Notifier

log = logging.getLogger("vllm_tap.daemon.service")

STATUS_PERIOD_S = 5.0  # how often STATUS= and the lost-records warning are refreshed
SNAPSHOT_WAIT_S = 2.0  # a scrape waits this long for the main loop before reporting up=0
GC_YOUNG_THRESHOLD = 50_000  # allocations between collections of the youngest generation (default 700)
EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2  # the unit sets RestartPreventExitStatus=2


# --- logging ---------------------------------------------------------------------------------

_SYSLOG_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def _stderr_is_journal(env: Mapping[str, str]) -> bool:
    """True when stderr is the journal stream systemd gave us (not a pipe a child inherited)."""
    stream = env.get("JOURNAL_STREAM", "")
    if not stream or sys.stderr.isatty():
        return False
    try:
        dev, ino = (int(x) for x in stream.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class _OneLineFormatter(logging.Formatter):
    """One event, one line: a multi-line traceback would become many unrelated journal entries."""

    def __init__(self, fmt: str, journal: bool):
        super().__init__(fmt, datefmt="%Y-%m-%dT%H:%M:%S")
        self._journal = journal

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).replace("\n", " | ")
        if self._journal:
            # journald reads a leading <N> as the syslog priority, so `journalctl -p warning` works.
            text = f"<{_SYSLOG_PRIORITY.get(record.levelno, 6)}>{text}"
        return text


def setup_logging(level: str, env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    journal = _stderr_is_journal(env)
    handler = logging.StreamHandler(sys.stderr)
    if sys.stderr.isatty():
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    elif journal:  # the journal stamps time and unit itself
        handler.setFormatter(_OneLineFormatter("%(levelname)s %(name)s: %(message)s", journal=True))
    else:
        handler.setFormatter(_OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", journal=False))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)


# --- snapshots for other threads -------------------------------------------------------------


class _Pending:
    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None


class MainLoopSnapshots:
    """Lets the metrics thread ask for Daemon.snapshot() and have the main loop take it.

    The daemon's state is owned by its loop; taking the snapshot there (from on_tick) avoids
    needing it to be thread-safe, costs the loop nothing between scrapes, and makes a hung loop
    visible as a failed scrape instead of a stale one.
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any]], wait_s: float = SNAPSHOT_WAIT_S):
        self._snapshot = snapshot
        self._wait_s = wait_s
        self._queue: collections.deque[_Pending] = collections.deque()

    def snapshot(self) -> dict[str, Any]:  # any thread
        req = _Pending()
        self._queue.append(req)
        if not req.done.wait(self._wait_s):
            raise TimeoutError(f"daemon main loop did not answer within {self._wait_s}s")
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def serve(self) -> None:  # main loop only
        while self._queue:
            req = self._queue.popleft()
            try:
                req.result = self._snapshot()
            except Exception as e:  # handed to the asking thread, which logs it
                req.error = e
            req.done.set()


# --- the service -----------------------------------------------------------------------------


def _summary(snap: DaemonStatus) -> tuple[str, int, int]:
    """(STATUS= text, records writers dropped so far, bytes writers dropped so far)."""
    rings = snap.rings
    alive = sum(1 for r in rings if r["alive"])
    drops = snap.drops
    text = (
        f"{len(rings)} rings ({alive} writers alive), {snap.requests_in_flight} requests in flight, "
        f"{snap.subscribers} subscribers, {snap.records_in} records in, {drops.records} dropped"
    )
    return text, int(drops.records), int(drops.bytes)


class _Service:
    """The callbacks the Daemon's loop calls, and the signal handling around Daemon.run()."""

    def __init__(self, config: DaemonConfig, notifier: Notifier):
        self.config = config
        self.notifier = notifier
        self.daemon: Any = None
        self.snapshots: MainLoopSnapshots | None = None
        self.stop_requested = False
        self.metrics_url = ""
        self._next_status = 0.0
        self._drops_seen: tuple[int, int] | None = None

    def on_ready(self) -> None:
        status = f"watching {self.config.shm_dir}, serving {self.config.resolved_endpoint()}"
        if self.metrics_url:
            status += f", metrics on {self.metrics_url}"
        log.info("ready: %s", status)
        self.notifier.ready(status)
        self.notifier.watchdog()
        self._next_status = time.monotonic() + STATUS_PERIOD_S

    def on_tick(self) -> None:
        # Pinging only from here means a wedged loop stops the pings and systemd restarts us.
        self.notifier.watchdog()
        if self.snapshots is not None:
            self.snapshots.serve()
        now = time.monotonic()
        if now >= self._next_status:
            self._next_status = now + STATUS_PERIOD_S
            self._report(self.daemon.snapshot())

    def _report(self, snap: DaemonStatus) -> None:
        text, records, nbytes = _summary(snap)
        self.notifier.status(text)
        # The writers cannot log a drop (they must never slow vLLM down), so the daemon says it;
        # slow subscribers and gaps are logged by the daemon core where they happen.
        if self._drops_seen is not None and records > self._drops_seen[0]:
            log.warning(
                "captures lost: writers dropped %d records (%.1f MiB) in the last %.0f s because a ring was full "
                "(daemon behind, or ring_bytes too small for the bursts); see `vllm-tap status`",
                records - self._drops_seen[0], (nbytes - self._drops_seen[1]) / (1 << 20), STATUS_PERIOD_S,
            )
        self._drops_seen = (records, nbytes)

    def on_signal(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.stop_requested:
            # A second ^C means "now": skip the orderly stop rather than ignore the operator.
            log.warning("%s again while stopping; exiting without cleanup", name)
            os._exit(EXIT_FAILED)
        self.stop_requested = True
        log.info("%s: stopping", name)
        self.notifier.stopping(f"stopping ({name})")
        if self.daemon is not None:
            self.daemon.stop(f"daemon stopping ({name})")  # what subscribers are told


def run_service(config: DaemonConfig, env: Mapping[str, str] | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT; 0 after an orderly stop, 1 when it could not run."""
    setup_logging(config.log_level, env)
    from .server import AccessError, Daemon, DaemonError  # lazily: other CLI commands need none of it
    from .sequence import SequenceStateError

    # The daemon keeps many small objects alive for a while (an event per capture and step until
    # retention lets it go): collections of the young generation, at the default threshold every
    # 700 allocations, would walk them again and again. Reference counting frees them (and the
    # arena's regions) anyway; the cycle collector runs far less often.
    gc.set_threshold(GC_YOUNG_THRESHOLD, 50, 100)
    notifier = Notifier(env)
    svc = _Service(config, notifier)
    previous = {s: signal.signal(s, svc.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    metrics = None
    try:
        svc.daemon = Daemon(config, on_ready=svc.on_ready, on_tick=svc.on_tick)
        if config.metrics_addr:
            from .metrics import start_metrics_server

            svc.snapshots = MainLoopSnapshots(svc.daemon.snapshot)
            try:
                metrics, _ = start_metrics_server(config.metrics_addr, svc.snapshots)
                host, port = metrics.server_address[:2]
                svc.metrics_url = f"http://{host}:{port}/metrics"
            except OSError as e:
                log.error("metrics_addr %s: cannot listen: %s", config.metrics_addr, e.strerror or e)
                return EXIT_FAILED
        if not svc.stop_requested:
            svc.daemon.run()
    except (SequenceStateError, AccessError) as e:  # the operator must act: restarting cannot fix it
        log.error("%s", e)
        notifier.stopping(str(e))
        return EXIT_CONFIG
    except DaemonError as e:  # cannot start (address in use, ...): the message says it all
        log.error("%s", e)
        notifier.stopping(str(e))
        return EXIT_FAILED
    except Exception:
        log.exception("daemon failed")
        notifier.stopping("failed")
        return EXIT_FAILED
    finally:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        notifier.close()
    log.info("stopped")
    return EXIT_OK


def cli_entry(config_path: str | None, flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> int:
    """What `vllm-tap daemon` runs: a configuration problem is one line on stderr and exit 2."""
    try:
        config = load_config(config_path, os.environ if env is None else env, flags)
    except ConfigError as e:
        sys.stderr.write(f"vllm-tap: {e}\n")
        return EXIT_CONFIG
    return run_service(config, env)


def _parse_args(argv: list[str] | None) -> tuple[str | None, dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m vllm_tap.daemon.service", description=__doc__)
    parser.add_argument("--config", help="TOML file (default /etc/vllm-tap/config.toml if it exists)")
    keys = [f.name for f in dataclasses.fields(DaemonConfig)]
    for f in dataclasses.fields(DaemonConfig):
        # Strings: load_config parses them exactly like environment values.
        if f.type in (bool, "bool"):
            parser.add_argument(flag_name(f.name), dest=f.name, default=None, action="store_const", const="true")
        else:
            parser.add_argument(flag_name(f.name), dest=f.name, default=None, metavar="VALUE")
    ns = parser.parse_args(argv)
    return ns.config, {k: getattr(ns, k) for k in keys}


def main(argv: list[str] | None = None) -> int:
    config_path, flags = _parse_args(argv)
    return cli_entry(config_path, flags)


if __name__ == "__main__":
    sys.exit(main())
