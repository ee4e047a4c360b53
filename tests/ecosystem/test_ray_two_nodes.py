"""Ray Data LLM's vLLM processor on a two-node Ray cluster: one engine replica on each node.

Both nodes run on this machine (`ray start --head` and `ray start --address=...`, 1 CPU each,
each in its own temp dir), through the vllm alias; the job is ray_data_llm_cluster_job.py.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pagedlm import LLM, SamplingParams
from tests.ecosystem.conftest import REPO, result_line

pytest.importorskip("ray.data.llm")

JOB = Path(__file__).with_name("ray_data_llm_cluster_job.py")
RAY = Path(sys.executable).with_name("ray")
REPLICAS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Node:
    """One `ray start --block` process: the node lives exactly as long as it does."""

    def __init__(self, log: Path, args: list[str], env: dict[str, str]) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(RAY), "start", "--block", *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_started(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"ray start (rc {self.proc.poll()}) did not start:\n"
                    + self.log.read_text(errors="replace")[-4000:]
                )
            time.sleep(0.5)

    def stop(self, grace: float = 30) -> list[str]:
        """Stop the node; SIGKILL (and name) any of its processes that outlive it."""
        import psutil  # a dependency of ray

        # Its processes, taken now: Ray renames most of them ("ray::...") and they can be
        # reparented, so neither their command lines nor the tree find them later.
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            procs = []
        # SIGTERM: the `ray start --block` process shuts its node down (raylet, agents,
        # workers; GCS on the head). Never `ray stop`: it kills every Ray on the machine.
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _, alive = psutil.wait_procs(procs, timeout=10)
        names = []
        for proc in alive:
            try:
                names.append(f"{proc.pid} {proc.name()}")
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        return names


@pytest.fixture
def two_node_cluster(alias_target, monkeypatch):
    """A head and a worker node (1 CPU each); the driver env points at it. Always stopped."""
    # Short, and not /tmp/ray: unix socket paths stay under 107 bytes, and a plain ray.init()
    # elsewhere on the machine never finds this cluster (/tmp/ray/ray_current_cluster).
    base = Path(tempfile.mkdtemp(prefix="r2n-", dir="/tmp"))
    token = base / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    # Token authentication, set explicitly for both nodes and the driver: left unset, Ray 2.60
    # turns it on for `ray start --head` only when ~/.ray/auth_token exists, and never for
    # `ray start --address` or `ray.init(address=...)`.
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(auth)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # On SIGTERM, `ray start --block` first drains its node for up to 30 s (Ray 2.60); the
    # head never finishes draining here. 0: shut down at once.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    # What run_client gives the driver: the actors run in the nodes' environment.
    env["PYTHONPATH"] = os.pathsep.join([str(alias_target), str(REPO)])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    port = _free_port()
    common = [
        "--num-cpus=1",
        "--num-gpus=0",
        "--object-store-memory=200000000",
        # Ports that would collide between two nodes on one machine: random ones instead.
        "--dashboard-agent-listen-port=0",  # default 52365 on every node
        "--min-worker-port=0",  # default range 10002-19999 on every node
        "--max-worker-port=0",
        "--disable-usage-stats",
    ]
    nodes: list[_Node] = []
    try:
        nodes.append(
            _Node(
                base / "head.log",
                [
                    "--head",
                    f"--port={port}",
                    "--include-dashboard=false",
                    f"--temp-dir={base}/head",
                    *common,
                ],
                env,
            )
        )
        nodes[-1].wait_started()
        nodes.append(
            _Node(
                base / "worker.log",
                # 127.0.0.1 (here and in RAY_ADDRESS): Ray advertises the machine's own IP.
                [f"--address=127.0.0.1:{port}", f"--temp-dir={base}/worker", *common],
                env,
            )
        )
        nodes[-1].wait_started()
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        for key, value in auth.items():
            monkeypatch.setenv(key, value)
        yield base
    finally:
        leftovers = []
        for node in reversed(nodes):  # the worker first, then the head (GCS)
            leftovers += node.stop()
        shutil.rmtree(base, ignore_errors=True)
    # Not inside finally: a failing test keeps its own error.
    assert not leftovers, f"killed processes that outlived their node: {leftovers}"


@pytest.mark.slow
def test_ray_data_llm_chat_two_nodes_match_llm(
    run_client, two_node_cluster, tiny_qwen2, tmp_path
) -> None:
    started = time.monotonic()
    got = result_line(run_client(JOB, args=(tiny_qwen2, tmp_path / "work", REPLICAS), timeout=900))
    print(f"job: {time.monotonic() - started:.1f}s")
    chat = got["chat"]
    assert [r["id"] for r in chat] == list(range(8 * REPLICAS))

    # Two live nodes of one CPU each, and one engine replica on each of them...
    nodes = {n["node_id"] for n in got["nodes"] if n["alive"]}
    assert len(nodes) == REPLICAS and all(n["cpus"] == 1 for n in got["nodes"]), got["nodes"]
    engines = got["engines"]
    assert len(engines) == REPLICAS, engines
    assert {e["node_id"] for e in engines} == nodes, (engines, nodes)
    # ...that both generated: the engine stage's batches ran on both nodes.
    assert got["engine_nodes_used"] == REPLICAS, got["engine_nodes_used"]

    # The rows: what LLM.generate gives on the prompts Ray rendered, which are what LLM.chat
    # renders from the same messages. (The tokens differ from LLM.chat's: Ray's tokenize stage
    # encodes the rendered text with the special tokens, here a BOS, as LLM.generate does;
    # LLM.chat, like vLLM's, encodes it without.)
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.generate([r["prompt"] for r in chat], params, use_tqdm=False)
    messages = [
        [{"role": "user", "content": f"Question {r['id']}: what is {r['id']} plus {r['id']}?"}]
        for r in chat
    ]
    want_chat = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    tok = llm.get_tokenizer()
    for row, ref, ref_chat in zip(chat, want, want_chat, strict=True):
        assert row["prompt"].startswith("<|user|>Question ") and row["prompt"].endswith(
            "<|assistant|>"
        )
        assert row["prompt"] == ref_chat.prompt
        assert ref.prompt_token_ids == [tok.bos_token_id, *ref_chat.prompt_token_ids]
        assert row["tokens"] == ref.outputs[0].token_ids
        # Ray's detokenize stage decodes the whole output (batch_decode), so a trailing partial
        # UTF-8 character shows as U+FFFD there while LLM's incremental text holds it back.
        assert row["answer"] == tok.decode(ref.outputs[0].token_ids, skip_special_tokens=True)
        assert row["answer"].startswith(ref.outputs[0].text)
