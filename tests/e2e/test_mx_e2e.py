"""MXFP8 through the real entry point with Megatron's flags: `--fp8-format e4m3 --fp8-recipe mxfp8
--fp8-param-gather` trains on 2 ranks (low-precision all-gather), a stopped run resumes from its checkpoint
with the straight run's losses (checkpoints hold the unquantised master weights), and the HF export loads with
plain transformers."""
from tests.support.launchers import run_pretrain
from tests.support.megatron_lines import RESUME_RUN_FLAGS

MX = ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather", "--train-iters", "6",
      "--save-interval", "3"]


def test_mxfp8_megatron_flags_train_save_resume_and_export(tmp_path):
    straight, log = run_pretrain(RESUME_RUN_FLAGS + MX, tmp_path / "straight", ranks=2)
    assert "quantisation: mxfp8 in 14 module(s)" in log
    assert sorted(straight) == list(range(1, 7))
    first, _ = run_pretrain(RESUME_RUN_FLAGS + MX, tmp_path / "run", "--exit-interval", "3", ranks=2)
    second, log = run_pretrain(RESUME_RUN_FLAGS + MX, tmp_path / "run", "--exit-interval", "3", ranks=2)
    assert "resuming from the newest complete checkpoint" in log
    assert sorted(second) == [4, 5, 6]
    for it in range(1, 7):
        assert (first if it <= 3 else second)[it] == straight[it], it  # consumed samples and printed loss

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "hf")
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert weight.dtype == torch.float32 and torch.isfinite(weight).all()
