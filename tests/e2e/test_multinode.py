"""Two nodes on one machine: two torchrun agents (static rendezvous: --nnodes 2 --node_rank 0/1 --master_addr
--master_port, the launch a Megatron user has), 2 ranks each, HSDP from Megatron's
--num-distributed-optimizer-instances 2 (shard 2 / replicate 2), with the optimizer and the first layer's
activations offloaded to the host. The lm losses equal one rank's (no HSDP, no offload); the run stops at
--exit-interval after its checkpoint, the very same commands resume it, and the end writes the HF export
from every rank (shards + index) that transformers loads. One test: four processes are what CI can afford.
"""
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launchers import MEGATRON_LINE, REPO, run_pretrain, signal_tree

pytestmark = pytest.mark.e2e

FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --seq-length 32 --max-position-embeddings 64 --micro-batch-size 1 "
         "--global-batch-size 4 --train-iters 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
         "--vocab-size 128 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 --log-interval 1 "
         "--eval-iters 0").split()
ACROSS_NODES = ("--num-distributed-optimizer-instances 2 --optimizer-cpu-offload --cpu-offloading-num-layers 1 "
                "--save-interval 2 --exit-interval 2").split()


def _unclaimed_port() -> int:
    """A port free now, outside the kernel's ephemeral range (ip_local_port_range).

    The one port a test still picks: static rendezvous needs its --master_port before either agent starts, and
    node 0's agent binds it only seconds later (torchrun has no way to be handed a bound socket, and the other
    node could not learn a port node 0 chose itself). Outside the ephemeral range nothing that binds port 0 or
    connects out (every other test: torchrun --standalone, gloo) can be given it in between; only a process naming
    this very port could, and `_two_nodes` starts over once if that happened."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    candidates = [port for port in range(10000, 65536) if not low <= port <= high]
    pick = random.SystemRandom()  # not the test session's seeded generator: two sessions at once differ
    for _ in range(100):
        port = pick.choice(candidates)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))  # the agent's store listens on every address
            except OSError:
                continue
        return port
    raise AssertionError("no free port outside the ephemeral range")


def _two_nodes(save_dir):
    """Both agents of one launch; returns their logs together (rank 0 prints the run's lines, the last rank the
    training lines, as in Megatron). Started over once if node 0's agent found its port taken (EADDRINUSE)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    for attempt in (1, 2):
        port = _unclaimed_port()
        logs = [save_dir.parent / f"{save_dir.name}-node{node}.log" for node in (0, 1)]
        agents = []
        for node, log in zip((0, 1), logs):
            with open(log, "w") as out:  # files, not pipes: node 0 is waited for first
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                     "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                     os.path.join(REPO, "pretrain_fsdp2.py"), *FLAGS, *ACROSS_NODES, "--save", str(save_dir)],
                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO))
        agents[0].wait(timeout=600)  # node 0 hosts the rendezvous: it ends first if it could not bind the port
        if agents[0].returncode != 0:
            signal_tree(agents[1].pid, signal.SIGKILL)  # it would wait for node 0 (or talk to the port's taker)
            agents[1].wait()
            if attempt == 1 and "EADDRINUSE" in logs[0].read_text():
                continue
        agents[1].wait(timeout=600)
        texts = [log.read_text() for log in logs]
        for agent, text in zip(agents, texts):
            assert agent.returncode == 0, text[-3000:]
        return "\n".join(texts)


def test_two_nodes_hsdp_offload_match_one_rank_save_resume_and_export(tmp_path):
    from transformers import AutoModelForCausalLM

    reference, _ = run_pretrain(FLAGS, tmp_path / "one_rank")
    expected = {it: float(loss) for it, (_, loss) in reference.items()}
    assert sorted(expected) == [1, 2, 3, 4]

    save = tmp_path / "two_nodes"
    first = _two_nodes(save)
    assert (save / "iter_0000002").is_dir() and not (save / "hf").exists()
    second = _two_nodes(save)  # the same commands
    assert f"resuming from the newest complete checkpoint {save / 'iter_0000002'}" in second
    losses = {int(it): float(loss) for log in (first, second) for it, _, loss in MEGATRON_LINE.findall(log)}
    assert sorted(losses) == [1, 2, 3, 4]
    for it, loss in expected.items():
        assert loss == pytest.approx(losses[it], rel=1e-4), (it, losses)

    assert (save / "iter_0000004").is_dir()
    export = save / "hf"
    assert (export / "model.safetensors.index.json").is_file() and not (save / "hf.tmp").exists()
    assert len(list(export.glob("model-*-of-*.safetensors"))) == 3  # 4 writers, 3 groups: 2 layers + the rest
    AutoModelForCausalLM.from_pretrained(str(export))
