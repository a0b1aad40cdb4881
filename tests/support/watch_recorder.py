"""Test helper: a watcher process that records what it gets, the way a dataset recorder would.

    python tests/support/watch_recorder.py ENDPOINT OUT.jsonl [--since N] [--stream] [--until SEQ] [--item-sleep S]
        [--filter key=value ...]

Every item becomes one JSON line, written with a single write and fsync'd before the next item is
read, carrying `last_seq` as of that item: after a SIGKILL, the last complete line says where to
resume (`--since`), exactly like a recorder that persists its progress with the data. Lines:
  {"kind": "capture", "seq", "last_seq", "request_id", "instance", "source", "tap_key", "model",
   "positions": [...], "missing": [...], "digest", "lazy", "reason"}                  (whole mode)
  {"kind": "start"|"data"|"gap"|"end", "seq", "last_seq", ...}                       (streamed)
  {"kind": "lost", "first", "last", "reason", "last_seq"}
It exits 0 once last_seq >= --until, printing nothing else.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np


def digest(arrays: dict[str, np.ndarray]) -> str:
    """Stable over names and bytes (the recorder's and the test's views of a capture agree)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode() + str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    from vllm_tap.client import Client, LostCaptures, WatchData, WatchedCapture, WatchEnd, WatchStart

    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("out")
    ap.add_argument("--since", type=int, default=None)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--until", type=int, default=None)
    ap.add_argument("--item-sleep", type=float, default=0.0)
    ap.add_argument("--filter", action="append", default=[])
    args = ap.parse_args(argv)
    filters = dict(f.split("=", 1) for f in args.filter)
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    w = Client(args.endpoint).watch(args.since, whole=not args.stream, timeout=60.0, **filters)

    def put(rec: dict) -> None:
        rec["last_seq"] = w.last_seq
        os.write(fd, (json.dumps(rec) + "\n").encode())
        os.fsync(fd)

    for item in w:
        if isinstance(item, LostCaptures):
            put({"kind": "lost", "first": item.first, "last": item.last, "reason": item.reason})
        elif isinstance(item, WatchedCapture):
            cap = item.capture
            put({"kind": "capture", "seq": item.seq, "request_id": item.request_id, "instance": item.instance,
                 "source": item.source, "tap_key": item.tap_key, "model": item.model, "lazy": item.begin.lazy,
                 "positions": cap.positions.tolist(), "missing": list(cap.missing_positions),
                 "digest": digest(cap.arrays()), "reason": item.end.reason})
        elif isinstance(item, WatchStart):
            put({"kind": "start", "seq": item.seq, "request_id": item.begin.request_id, "lazy": item.begin.lazy})
        elif isinstance(item, WatchData):
            it = item.item
            if it.missing:
                put({"kind": "gap", "seq": item.seq, "positions": [it.positions.start, it.positions.stop],
                     "reason": it.reason})
            else:
                put({"kind": "data", "seq": item.seq, "positions": it.positions.tolist()})
        elif isinstance(item, WatchEnd):
            put({"kind": "end", "seq": item.seq, "request_id": item.end.request_id,
                 "missing": list(item.end.missing_positions), "reason": item.end.reason})
        if args.item_sleep:
            time.sleep(args.item_sleep)
        if args.until is not None and w.last_seq is not None and w.last_seq >= args.until:
            break
    os.close(fd)
    return 0


def read_lines(path: str) -> list[dict]:
    """Complete lines only: a line cut by a SIGKILL mid-write was never persisted."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


if __name__ == "__main__":
    sys.exit(main())
