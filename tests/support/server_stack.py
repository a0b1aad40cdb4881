"""The stack the server tests share: a `vllm-tap daemon` and a vLLM OpenAI server with the tap (tiny
float32 Llama, CPU settings), on a fresh shm directory, started together and torn down together.

    with ServerStack("e2e", eager=False, server_args=["--max-logprobs", "-1"]) as s:
        r = s.complete("w1 w2", {"tap": 1})
        cap = s.client.fetch(r.id)

Every module using it starts vLLM, so it is marked `vllm` (pyproject's markers; `./run test-fast`
leaves them out).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from typing import Any, Sequence

from reference import tiny_model
from vllm_tap.client import Client
from vllm_tap.tools.launch import DaemonHandle, ServerHandle, cpu_server_args, free_port, tap_server_args
from vllm_tap.tools.tiny_model import TinyLlamaSpec

SERVER_START_S = 420  # a compiled server on two shared cores


class ServerStack:
    def __init__(self, instance: str, *, eager: bool = True, max_num_batched_tokens: int | None = None,
                 server_args: Sequence[str] = (), max_tokens: int = 4, spec: TinyLlamaSpec | None = None,
                 daemon_args: Sequence[str] = (), **tap: Any):
        """`tap`: the plugin's settings beyond shm_dir and instance (policy, ring_bytes, layers);
        `daemon_args`: flags for `vllm-tap daemon` (`--end-grace 0`), at every start."""
        self.shm = tempfile.mkdtemp(prefix=f"vt-{instance}-", dir="/dev/shm")
        self.tmp = tempfile.mkdtemp(prefix="vt-")
        self.model = tiny_model(spec or TinyLlamaSpec())
        self.max_tokens = max_tokens
        self.daemon = DaemonHandle(self.shm, f"ipc://{self.tmp}/tap.sock", os.path.join(self.tmp, "daemon.log"),
                                   args=list(daemon_args))
        args = cpu_server_args(eager=eager, max_num_batched_tokens=max_num_batched_tokens) + list(server_args)
        # vLLM's CPU inference below the daemon and the test: as on a GPU host, where it leaves them cores.
        self.server = ServerHandle(self.model, free_port(), os.path.join(self.tmp, "server.log"),
                                   args + tap_server_args(self.shm, instance, **tap), nice=10)

    def __enter__(self) -> "ServerStack":
        import openai

        self.daemon.start()
        try:
            self.server.start(timeout=SERVER_START_S)
        except BaseException:
            self._clean()
            raise
        self.openai = openai.OpenAI(base_url=self.server.base_url + "/v1", api_key="unused", max_retries=0)
        self.client = Client(self.daemon.endpoint)
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()
        if exc[0] is not None:  # the daemon's last lines beside the failure (its log goes with the stack)
            try:
                with open(self.daemon.log_path, "rb") as f:
                    f.seek(max(0, os.path.getsize(self.daemon.log_path) - 6000))
                    sys.stderr.write("--- daemon log (tail) ---\n" + f.read().decode(errors="replace") + "\n")
            except OSError:
                pass
        self._clean()

    def _clean(self) -> None:
        self.server.stop()
        self.daemon.stop()
        keep = os.environ.get("VLLM_TAP_TEST_LOGS")  # a directory: the daemon's and the server's logs go there
        if keep:
            os.makedirs(keep, exist_ok=True)
            for name in ("daemon.log", "server.log"):
                try:
                    shutil.copy(os.path.join(self.tmp, name), os.path.join(keep, f"{os.path.basename(self.tmp)}-{name}"))
                except OSError:
                    pass
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.shm.rstrip("/") + ".arena", ignore_errors=True)  # the arena directory a killed daemon left
        shutil.rmtree(self.tmp, ignore_errors=True)

    def complete(self, prompt, xargs: dict | None = None, **kw):
        """A completion through the openai SDK: greedy, EOS ignored, `xargs` as vllm_xargs."""
        body = dict(kw.pop("extra_body", {}))
        body.setdefault("ignore_eos", True)
        if xargs is not None:
            body["vllm_xargs"] = xargs
        kw.setdefault("temperature", 0.0)
        kw.setdefault("max_tokens", self.max_tokens)
        return self.openai.completions.create(model=self.model, prompt=prompt, extra_body=body, **kw)

    def post(self, body: dict, headers: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
        """A raw /v1/completions request (where the exact JSON type matters): (HTTP status, JSON body)."""
        body = {"model": self.model, "max_tokens": 1, **body}
        req = urllib.request.Request(self.server.base_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
