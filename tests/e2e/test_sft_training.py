"""`stage: sft` end to end through pretrain_fsdp2.py: the per-token loss over the global batch's valid tokens is
the same on 1 rank (gradient accumulation 2) and on 2 data-parallel ranks, evaluation prints a loss block per
dataset at each interval and at the end, and neat-packed rows under Ulysses context parallel 2 train like one
rank."""
import re


from tests.support.sft_assets import RTOL, losses_close, run_sft, sft_losses, sft_yaml
from tests.support.sft_assets import assets  # noqa: F401  (pytest fixture)

VALIDATION = re.compile(r"validation loss at iteration (\d+)(?: on ([^|]+?))? \| lm loss value: ([0-9.E+-]+)")


def test_one_rank_equals_two_ranks_and_evaluates_each_dataset(assets, tmp_path):
    data = {"val_size": 3, "eval_on_each_dataset": True}
    one = sft_yaml(assets, "one", data, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                                      "eval_interval": 2})
    two = sft_yaml(assets, "two", data, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
                                      "eval_interval": 2})
    lines1, log1 = run_sft(one, tmp_path / "one", ranks=1)
    lines2, log2 = run_sft(two, tmp_path / "two", ranks=2)
    losses_close(sft_losses(lines2), sft_losses(lines1))
    evals1 = [(int(i), where, float(v)) for i, where, v in VALIDATION.findall(log1)]
    evals2 = [(int(i), where, float(v)) for i, where, v in VALIDATION.findall(log2)]
    # a block per dataset at iterations 2 and 4, and once more at the end
    assert [(i, w) for i, w, _ in evals1] == [(2, "eval set set_a"), (2, "eval set set_b"),
                                              (4, "eval set set_a"), (4, "eval set set_b"),
                                              (4, "eval set set_a"), (4, "eval set set_b")], log1[-3000:]
    assert [(i, w) for i, w, _ in evals2] == [(i, w) for i, w, _ in evals1]
    for (_, _, v1), (_, _, v2) in zip(evals1, evals2):
        assert abs(v1 - v2) <= RTOL * abs(v1)


def test_neat_packing_with_ulysses_cp2_equals_one_rank(assets, tmp_path):
    data = {"neat_packing": True, "cutoff_len": 128}
    training = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1}
    one = sft_yaml(assets, "packed_one", data, training)
    cp2 = sft_yaml(assets, "packed_cp2", data, training, {"cp_size": 2, "cp_type": "ulysses"})
    lines1, _ = run_sft(one, tmp_path / "one", ranks=1)
    lines2, log2 = run_sft(cp2, tmp_path / "cp2", ranks=2)
    losses_close(sft_losses(lines2), sft_losses(lines1))
