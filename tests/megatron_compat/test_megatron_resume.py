"""`--load MEGATRON_CKPT` continues a run that megatron-core 0.16.1 trained and saved, as a straight megatron-core
run would continue it.

megatron-core trains its tiny Qwen3-like GPTModel (test_megatron_import's harness) on CPU for K iterations with its
own stack: `DistributedDataParallel`, `get_megatron_optimizer` (torch AdamW, as Megatron falls back to without
TE/Apex; the distributed optimizer for torch_dist), `OptimizerParamScheduler`, gradient clipping, on batches of
megatron-core's GPTDataset read in Megatron's sampler order. It saves the checkpoint in Megatron-LM's layout
(`dist_checkpointing.save` of the model / optimizer sharded state dicts, the scheduler, args with the consumed
samples and a ShardedObject RNG state; or the legacy `mp_rank_00/model_optim_rng.pt`; or `--ckpt-format torch_dcp`'s
DCP save of the legacy dict, which Megatron-LM writes with torch.distributed.checkpoint and megatron-core has no
writer for: built here as Megatron-LM's save_checkpoint builds it; or Megatron-FSDP's fsdp_dtensor layout,
test_megatron_fsdp_dtensor's writer) and then goes on for two
more iterations: the reference. Our engine, given only `--load` and the run's training flags, must print
megatron-core's loss for iteration K+1 (the loaded weights), its loss for K+2 (the Adam step from the loaded
moments, step count, learning rate, weight decay and clipping), the iteration, consumed samples and learning
rate Megatron would print, and end with megatron-core's weights.

Runtime stand-ins for megatron-core on CPU, in this test only (no file edited): `torch.cuda.current_device`
returns "cpu" and the dropout RNG fork is a no-op (test_megatron_import's fixture); a torch function mode puts
tensors megatron-core's optimizer creates on `device="cuda"` on the CPU and lets its fp32 gradient-type assertion
see a CUDA type name.
"""
import os

import pytest
import torch

from tests.support.launchers import run_pretrain
from tests.support.megatron_reference import write_corpus
from tests.support.megatron_checkpoints import VOCAB, megatron_gpt
from tests.support.megatron_checkpoints import megatron  # noqa: F401  (pytest fixture)
from tests.support.megatron_training import (GBS, K, CpuForCuda, hf_weights, megatron_gpt_dataset,
                                             megatron_training_stack, megatron_training_step, printed_steps,
                                             resume_flags, save_like_megatron_lm)


def _megatron_run(root, fmt: str, distributed_optimizer: bool):
    """Trains K iterations, saves root/mg in Megatron-LM's layout, trains 2 more; returns the reference."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    prefix = write_corpus(str(root / "data" / "text_document"), 120, seed=7, vocab_size=VOCAB - 1)
    data = megatron_gpt_dataset(prefix, str(root / "mcore_cache"))
    model, args = megatron_gpt(qk_layernorm=True, tied=False, seed=11)
    model.train()
    reference = {"loss": {}, "lr": {}}
    with CpuForCuda():
        ddp, optimizer, scheduler = megatron_training_stack(model, distributed_optimizer)
        for iteration in range(1, K + 3):
            samples = [data[(iteration - 1) * GBS + j] for j in range(GBS)]
            batch = {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask",
                                                                             "position_ids")}
            reference["loss"][iteration] = megatron_training_step(ddp, optimizer, scheduler, batch)
            reference["lr"][iteration] = next(g["lr"] for g in optimizer.param_groups if g["default_config"])
            if iteration == K:
                args.consumed_train_samples, args.consumed_valid_samples = K * GBS, 0
                save_like_megatron_lm(root / "mg", fmt, model, optimizer, scheduler, args, dist_checkpointing,
                                       ShardedObject)
    reference["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()
                            if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    return prefix, reference


_RUNS: dict = {}


def _reference(megatron, tmp_path_factory, fmt, distributed_optimizer):
    """megatron-core's run for (fmt, distributed_optimizer), trained once per module; (root, prefix, reference)."""
    key = (fmt, distributed_optimizer)
    if key not in _RUNS:
        root = tmp_path_factory.mktemp(f"mg_{fmt}")
        _RUNS[key] = (root, *_megatron_run(root, fmt, distributed_optimizer))
    return _RUNS[key]


@pytest.mark.parametrize("fmt,distributed_optimizer,ranks", [("torch_dist", True, 2), ("torch", False, 1),
                                                              ("torch_dcp", False, 1), ("fsdp_dtensor", False, 1)])
def test_resumes_a_megatron_core_run_as_megatron_core_continues_it(megatron, tmp_path_factory, fmt,
                                                                   distributed_optimizer, ranks):
    from transformers import AutoConfig

    from megatron_compat.checkpoint.convert import hf_config_from_args, to_hf_state_dict

    tmp_path, prefix, reference = _reference(megatron, tmp_path_factory, fmt, distributed_optimizer)
    # 2 ranks: one sample each (FSDP2 shards the loaded weights and moments); every sample has SEQ loss tokens,
    # so the token-weighted loss equals megatron-core's mean over its one micro-batch of 2
    _, log = run_pretrain(resume_flags(tmp_path, prefix, mbs=GBS // ranks), tmp_path / "out", ranks=ranks)
    got = printed_steps(log)
    assert sorted(got) == [K + 1, K + 2], log[-2000:]
    for iteration in (K + 1, K + 2):  # (c) iteration, consumed samples, lr as Megatron prints them
        consumed, lr, loss = got[iteration]
        assert consumed == iteration * GBS
        assert f"{lr:.6E}" == f"{reference['lr'][iteration]:.6E}"
        assert loss == pytest.approx(reference["loss"][iteration], abs=1e-5), iteration  # (a) and (b)
    # (b) after the two steps, megatron-core's weights (its checkpoint's args give the HF layout)
    _, args = megatron_gpt(qk_layernorm=True, tied=False, seed=11)
    config = hf_config_from_args(args, reference["weights"])
    expected = to_hf_state_dict(reference["weights"], config)
    ours = hf_weights(tmp_path / "out" / "hf")
    assert set(expected) <= set(ours)
    for name, value in expected.items():
        torch.testing.assert_close(ours[name].float(), value.float(), rtol=0, atol=2e-6, msg=name)
    print(f"\n{fmt} ({ranks} rank(s)): |loss - megatron-core| at K+1, K+2 = "  # figures for `pytest -s`
          f"{[abs(got[i][2] - reference['loss'][i]) for i in (K + 1, K + 2)]}, max |weight diff| after K+2 = "
          f"{max((ours[n].float() - v.float()).abs().max().item() for n, v in expected.items()):.2e}")
    assert isinstance(AutoConfig.from_pretrained(tmp_path / "out" / "hf"), type(config))


def test_without_the_optimizer_state_the_next_step_differs_and_finetune_starts_at_zero(megatron, tmp_path_factory,
                                                                                       tmp_path):
    """The continuation above is not a coincidence: --no-load-optim (fresh Adam moments, iteration and samples
    kept, as Megatron) gives iteration K+1's loss but not K+2's; --finetune starts at iteration 1, sample 0."""
    root, prefix, reference = _reference(megatron, tmp_path_factory, "torch_dist", True)
    _, log = run_pretrain(resume_flags(root, prefix, "--no-load-optim"), tmp_path / "out", ranks=1)
    got = printed_steps(log)
    assert got[K + 1][0] == (K + 1) * GBS
    assert got[K + 1][2] == pytest.approx(reference["loss"][K + 1], abs=1e-5)
    assert abs(got[K + 2][2] - reference["loss"][K + 2]) > 1e-4
    _, log = run_pretrain(resume_flags(root, prefix, "--finetune"), tmp_path / "ft", "--exit-interval", "1", ranks=1)
    got = printed_steps(log)
    assert sorted(got) == [1] and got[1][0] == GBS


def test_what_cannot_be_mapped_is_one_line(megatron, tmp_path_factory, tmp_path):
    """A distributed optimizer saved dp_zero_gather_scatter (deprecated; dp_reshardable, Megatron-LM's default, is
    read: test_megatron_resume_distopt), and disagreeing architecture flags:
    one error line each, exit code 2."""
    import shutil
    import subprocess
    import sys

    from tests.support.launchers import REPO

    root, prefix, _ = _reference(megatron, tmp_path_factory, "torch_dist", True)
    shutil.copytree(root / "mg", tmp_path / "mg")
    common = tmp_path / "mg" / f"iter_{K:07d}" / "common.pt"
    saved = torch.load(common, weights_only=False)
    saved["optimizer"]["param_state_sharding_type"] = "dp_zero_gather_scatter"  # Megatron-LM's deprecated format
    torch.save(saved, common)
    shape = ("--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings", "64")
    cases = [((), "dp_zero_gather_scatter"),
             (("--no-load-optim", *shape), "num_layers value from checkpoint (2) is not equal to the input num_layers "
                                           "value (3)")]
    for extra, words in cases:
        result = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"),
                                 *resume_flags(tmp_path, prefix, *extra), "--save", str(tmp_path / "out")],
                                capture_output=True, text=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert result.returncode == 2, result.stderr[-2000:]
        assert words in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
