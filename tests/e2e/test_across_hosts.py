"""One vLLM engine across two hosts (two network namespaces, each with its own /dev/shm: see
tests/support/two_hosts.py), tensor parallel 2 across them, the tap on both nodes and a daemon on
the home host (node 0, world rank 0's): every tp rank holds the whole logits and hidden states, so
the home's rank writes every column and the other host's rank writes nothing; the home daemon's
captures are whole, equal to vLLM's own logprobs and to a transformers float32 forward, and each
ring says where its writer runs (its placement: host, node, home, tp place, writers, settings).

vLLM 0.32's CPU backend runs tensor parallelism across the two namespaces; pipeline parallelism
across them fails inside vLLM itself (its second stage asserts on missing intermediate tensors at
the first request, with or without any plugin), so that layout is not run here.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import pytest

import two_hosts
from conftest import SUPPORT_DIR
from reference import hf_forward, tiny_model
from vllm_tap.tools.launch import cpu_server_args
from vllm_tap.tools.tiny_model import TinyLlamaSpec

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(two_hosts.available() is not None, reason=f"two hosts: {two_hosts.available()}")]

SPEC = TinyLlamaSpec()
SHM = "/dev/shm/vllm-tap"
PORT = 8011
TOL = 1e-5


def _node_env(hosts: two_hosts.TwoHosts, i: int) -> dict:
    return {"VLLM_HOST_IP": two_hosts.ADDRESSES[i], "GLOO_SOCKET_IFNAME": hosts.interface(i),
            "VLLM_CPU_OMP_THREADS_BIND": str(i % max(os.cpu_count() or 1, 1)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": SUPPORT_DIR}


def _wait_healthy(hosts: two_hosts.TwoHosts, procs, logs, timeout: float = 420) -> None:
    url = f"http://{two_hosts.ADDRESSES[0]}:{PORT}/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if hosts.run(0, ["curl", "-sf", url], timeout=10).returncode == 0:
            return
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                raise RuntimeError(f"a node exited ({p.returncode}):\n" + _tail(log))
        time.sleep(3)
    raise TimeoutError("the engine across two hosts was not healthy:\n" + "\n---\n".join(_tail(x) for x in logs))


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _probe(hosts: two_hosts.TwoHosts, host: int, *args: str) -> dict:
    got = hosts.run(host, [sys.executable, os.path.join(SUPPORT_DIR, "across_hosts_probe.py"), *args], timeout=600,
                    env={"PYTHONPATH": SUPPORT_DIR})
    assert got.returncode == 0, got.stderr[-4000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


def test_tp_across_two_hosts_the_home_captures_whole_and_the_other_host_writes_nothing(tmp_path):
    model = tiny_model(SPEC)
    tap = json.dumps({"vllm_tap": {"shm_dir": SHM, "layers": "all"}})
    common = [sys.executable, os.path.join(SUPPORT_DIR, "vllm_command.py"), "serve", model,
              "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", two_hosts.ADDRESSES[0],
              "--master-port", "29511", *cpu_server_args(eager=True, max_model_len=512), "--max-num-seqs", "4",
              "--additional-config", tap]
    endpoint = f"ipc://{tmp_path}/d0.sock"
    logs = [str(tmp_path / "node0.log"), str(tmp_path / "node1.log")]
    with two_hosts.TwoHosts() as hosts:
        hosts.spawn(0, [sys.executable, "-m", "vllm_tap.cli", "daemon", "--shm-dir", SHM, "--endpoint", endpoint,
                        "--state-dir", str(tmp_path / "state0")], str(tmp_path / "daemon0.log"))
        node1 = hosts.spawn(1, common + ["--node-rank", "1", "--headless"], logs[1], _node_env(hosts, 1))
        node0 = hosts.spawn(0, common + ["--node-rank", "0", "--host", two_hosts.ADDRESSES[0], "--port", str(PORT)],
                            logs[0], _node_env(hosts, 0))
        _wait_healthy(hosts, [node0, node1], logs)
        got = _probe(hosts, 0, "capture", f"http://{two_hosts.ADDRESSES[0]}:{PORT}", model, endpoint, "3")
        home_rings = _probe(hosts, 0, "rings", SHM)
        other_rings = _probe(hosts, 1, "rings", SHM)
    # The other host's rank wrote nothing; the home's wrote every step, whole.
    assert sorted(other_rings) == ["rank-00001.ring"] and other_rings["rank-00001.ring"]["records_written"] == 0
    assert "rank-00000.ring" in home_rings and "rank-00001.ring" not in home_rings
    assert home_rings["rank-00000.ring"]["records_written"] > 0
    home, other = home_rings["rank-00000.ring"]["placement"], other_rings["rank-00001.ring"]["placement"]
    assert (home["node_rank"], home["tp_rank"], home["writers"]) == (0, 0, [0])
    assert (other["node_rank"], other["tp_rank"], other["writers"]) == (1, 1, [0])
    assert home["nnodes"] == other["nnodes"] == 2 and home["home"] == other["home"] == f"{two_hosts.ADDRESSES[0]}:29511"
    assert home["address"] == two_hosts.ADDRESSES[0] and other["address"] == two_hosts.ADDRESSES[1]
    assert home["settings"] == other["settings"] != ""
    engine = [v["placement"] for k, v in home_rings.items() if v["placement"] and v["placement"]["engine"]]
    assert len(engine) == 1 and engine[0]["world_size"] == 2
    # Every capture whole, equal to vLLM's logprobs and to a float32 forward on this host.
    assert len(got["requests"]) == 3
    for r in got["requests"]:
        assert r["complete"] and r["missing"] == 0 and r["positions"] == r["expected"], r["id"]
        assert r["output_ids_equal"] and r["max_logprob_error"] <= TOL, r["id"]
        assert r["layers"] == list(range(SPEC.num_layers + 1))
    for r in got["requests"]:
        assert r["token_ids"][: len(r["prompt_ids"])] == r["prompt_ids"]
        hf_logits, hf_hidden = hf_forward(model, r["token_ids"])
        assert np.abs(np.asarray(r["logits"], np.float32) - hf_logits).max() <= TOL
        for layer, h in r["hidden"].items():
            assert np.abs(np.asarray(h, np.float32) - hf_hidden[int(layer)]).max() <= TOL, layer
