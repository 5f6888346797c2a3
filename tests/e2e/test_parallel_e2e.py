"""Parallel layouts through the real entry point and Megatron flags: `torchrun --nproc_per_node 2
pretrain_fsdp2.py ... --tensor-model-parallel-size 2` (and context parallel Ulysses / ring, expert parallel on a
qwen3_moe built from flags) print the same lm loss per step as one rank, and their checkpoints resume on one
rank where the one-rank run is.

Each layout trains 8 steps and saves at 4 and 8; its iteration-4 checkpoint, copied alone into a fresh --save
directory, is where the same flags on one process resume (the newest checkpoint there), and they must print the
one-rank reference's losses for steps 5..8: like a run stopped at 4 and restarted without the parallel
flags, while the parallel run still covers all 8 steps. The TP 2 and EP 2 checkpoints are continued with
`--load CKPT` and no architecture flag at all (TP 2 at FSDP 2, EP 2 at one rank).
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.support.launchers import REPO, run_pretrain

ITERS, SAVED_AT, RTOL = 8, 4, 1e-4
DENSE = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --seq-length 32 --max-position-embeddings 64 --micro-batch-size 2 "
         f"--global-batch-size 4 --train-iters {ITERS} --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
         "--lr-warmup-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --swiglu "
         "--normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 --log-interval 1 "
         f"--save-interval {SAVED_AT} --eval-iters 0").split()
# --qk-layernorm makes the flags describe a Qwen3-MoE (without it: Mixtral).
MOE = DENSE + "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --qk-layernorm".split()


def train(flags, save_dir, *extra, ranks=1):
    """{iteration: lm loss} and the whole log of one run of the entry point."""
    lines, log = run_pretrain(flags, save_dir, *extra, ranks=ranks)
    return {it: float(loss) for it, (_, loss) in lines.items()}, log


def resume_on_one_rank(flags, run_dir, tmp_path):
    """The same flags on one process, restarted from the layout's iteration-4 checkpoint."""
    checkpoint = run_dir / f"iter_{SAVED_AT:07d}"
    assert checkpoint.is_dir(), sorted(p.name for p in run_dir.iterdir())
    shutil.copytree(checkpoint, tmp_path / "resumed" / checkpoint.name)
    losses, log = train(flags, tmp_path / "resumed")
    assert f"resuming from the newest complete checkpoint {tmp_path / 'resumed' / checkpoint.name}" in log
    return losses


def continue_without_architecture_flags(flags, run_dir, tmp_path, ranks=1):
    """`--load <the layout's iteration-4 checkpoint> --save NEW` with no architecture flag and no parallel flag:
    the checkpoint describes its model; it continues at `ranks` plain FSDP ranks."""
    from tests.support.megatron_lines import without_architecture

    checkpoint = run_dir / f"iter_{SAVED_AT:07d}"
    bare = without_architecture(flags)
    assert "--num-layers" not in bare and "--num-experts" not in bare
    losses, log = train(bare, tmp_path / "continued", "--load", str(checkpoint), ranks=ranks)
    assert f"resuming from {checkpoint}" in log
    return losses


def saved_run_config(run_dir):
    """The config the run trained with, as its iteration-4 checkpoint records it: the flags reached the run."""
    return json.loads((run_dir / f"iter_{SAVED_AT:07d}" / "run_config.json").read_text())


def weight_chunks(run_dir, name):
    """(offsets, sizes) of each rank's piece of parameter `name` in the iteration-4 DCP checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(run_dir / f"iter_{SAVED_AT:07d}")).read_metadata()
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in metadata.state_dict_metadata[name].chunks)


def assert_close(losses, reference, steps):
    assert sorted(losses) == list(steps), sorted(losses)
    for it in steps:
        assert abs(losses[it] - reference[it]) <= RTOL * abs(reference[it]), (it, losses[it], reference[it])


@pytest.fixture(scope="module")
def dense_reference(tmp_path_factory):
    losses, _ = train(DENSE, tmp_path_factory.mktemp("dense_reference"))
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert losses[ITERS] < losses[1]  # it trains
    return losses


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    # transformers' own Qwen3-MoE (model_id unset on one rank): independent of the stacked-expert model EP runs
    losses, _ = train(MOE, tmp_path_factory.mktemp("moe_reference"))
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses


def test_tensor_parallel_2_equals_one_rank_and_continues_at_fsdp_2(dense_reference, tmp_path):
    losses, _ = train(DENSE, tmp_path / "tp2", "--tensor-model-parallel-size", "2", ranks=2)
    assert_close(losses, dense_reference, range(1, ITERS + 1))
    # row-parallel o_proj is split along its input dim (FSDP alone would split dim 0): TP really ran
    assert weight_chunks(tmp_path / "tp2", "model.model.layers.0.self_attn.o_proj.weight") == \
        [((0, 0), (64, 32)), ((0, 32), (64, 32))]
    resumed = continue_without_architecture_flags(DENSE, tmp_path / "tp2", tmp_path, ranks=2)  # TP 2 -> FSDP 2
    assert_close(resumed, dense_reference, range(SAVED_AT + 1, ITERS + 1))


@pytest.mark.parametrize("algo, resume", [("ulysses_cp_algo", False), ("megatron_cp_algo", True)])
def test_context_parallel_2_equals_one_rank(dense_reference, tmp_path, algo, resume):
    losses, _ = train(DENSE, tmp_path / "cp2", "--context-parallel-size", "2", "--context-parallel-algo", algo,
                      ranks=2)
    assert_close(losses, dense_reference, range(1, ITERS + 1))
    parallel = saved_run_config(tmp_path / "cp2")["parallel"]
    assert (parallel["cp_size"], parallel["cp_type"]) == (2, {"ulysses_cp_algo": "ulysses"}.get(algo, "ring"))
    if resume:  # cp 2 -> 1 once: what is saved does not depend on the cp algorithm
        resumed = resume_on_one_rank(DENSE, tmp_path / "cp2", tmp_path)
        assert_close(resumed, dense_reference, range(SAVED_AT + 1, ITERS + 1))


def dry_run(flags):
    """`pretrain_fsdp2.py FLAGS --dry-run` validated for 2 ranks: the printed config (YAML + report comments)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WORLD_SIZE": "2"}
    result = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), *flags, "--dry-run"],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_hybrid_cp_algo_runs_as_ring_attention():
    """MindSpeed's hybrid (Ulysses x ring) computes the same exact attention: it is translated to ring (tested
    above through megatron_cp_algo), with a warning, and --ulysses-degree-in-cp is reported as without effect."""
    out = dry_run(DENSE + "--context-parallel-size 2 --context-parallel-algo hybrid_cp_algo "
                          "--ulysses-degree-in-cp 2".split())
    assert re.search(r"^\s+cp_size: 2$", out, re.M) and re.search(r"^\s+cp_type: ring$", out, re.M)
    assert "--context-parallel-algo hybrid_cp_algo: computed as ring attention" in out
    assert re.search(r"without effect.*--ulysses-degree-in-cp", out)


@pytest.mark.parametrize("extra, model_id", [([], "null"), (["--expert-model-parallel-size", "2"], "qwen3_moe"),
                                             (["--moe-grouped-gemm"], "qwen3_moe")])
def test_moe_flags_build_a_qwen3_moe(extra, model_id):
    """The MoE flags describe a Qwen3-MoE; expert parallel or grouped GEMM select the stacked-expert model."""
    out = dry_run(MOE + extra)
    assert re.search(r"^\s+model_type: qwen3_moe$", out, re.M)
    assert re.search(r"^\s+num_experts: 4$", out, re.M) and re.search(r"^\s+num_experts_per_tok: 2$", out, re.M)
    assert re.search(rf"^\s+model_id: {model_id}$", out, re.M), re.findall(r".*model_id.*", out)


def test_expert_parallel_2_equals_one_rank_and_resumes_at_ep_1(moe_reference, tmp_path):
    losses, _ = train(MOE, tmp_path / "ep2", "--expert-model-parallel-size", "2", ranks=2)
    assert_close(losses, moe_reference, range(1, ITERS + 1))
    config = saved_run_config(tmp_path / "ep2")
    assert (config["parallel"]["ep_size"], config["model"]["model_id"]) == (2, "qwen3_moe")
    # stacked experts -> transformers' model, the model read from the checkpoint alone
    resumed = continue_without_architecture_flags(MOE, tmp_path / "ep2", tmp_path)
    assert_close(resumed, moe_reference, range(SAVED_AT + 1, ITERS + 1))
    assert_close(resumed, losses, range(SAVED_AT + 1, ITERS + 1))
