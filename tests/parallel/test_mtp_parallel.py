"""Multi-token prediction end to end (Megatron flags): FSDP over 2 ranks and Ulysses context parallel 2 print the
same `lm loss` and `mtp_1 loss` as 1 rank, iteration by iteration; a stopped run resumes with its MTP weights
(the same losses as the straight run); the HF export keeps the MTP weights under `mtp.layers.*`, and they load
back into the MTP layers."""
import pytest
import torch

from fsdp2_backend.training.logging import parse_train_line
from tests.support.launchers import run_pretrain
from tests.support.megatron_lines import RESUME_RUN_FLAGS

pytestmark = pytest.mark.e2e


def _flags():
    flags = list(RESUME_RUN_FLAGS)
    flags[flags.index("--train-iters") + 1] = "3"
    return flags + ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]


def _losses(log):
    lines = [parse_train_line(line) for line in log.splitlines()]
    return {line["iteration"]: line["losses"] for line in lines if line}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    _, log = run_pretrain(_flags(), out)
    one = _losses(log)
    assert sorted(one) == [1, 2, 3] and all(list(v) == ["lm loss", "mtp_1 loss"] for v in one.values())
    return out, one


def test_fsdp2_and_ulysses_cp2_equal_one_rank(straight, tmp_path):
    _, one = straight
    _, log = run_pretrain(_flags(), tmp_path / "fsdp", ranks=2)
    fsdp = _losses(log)
    _, log = run_pretrain(_flags() + ["--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo"],
                          tmp_path / "cp", ranks=2)
    cp = _losses(log)
    for other in (fsdp, cp):
        assert sorted(other) == [1, 2, 3]
        for it in (1, 2, 3):
            for key in ("lm loss", "mtp_1 loss"):
                assert other[it][key] == pytest.approx(one[it][key], rel=1e-5), (it, key)


def test_resume_carries_the_mtp_weights(straight, tmp_path):
    _, one = straight
    run = tmp_path / "run"
    run_pretrain(_flags(), run, "--exit-interval", "2")
    _, log = run_pretrain(_flags(), run, "--exit-interval", "2")
    assert "resuming from the newest complete checkpoint" in log
    assert _losses(log)[3] == one[3]


def test_hf_export_keeps_mtp_weights_and_they_load_back(straight):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.models.mtp import attach_mtp, load_mtp_weights
    from fsdp2_backend.checkpoint.hf_export import load_model_state_dict

    out, _ = straight
    exported = {}
    for path in sorted((out / "hf").glob("*.safetensors")):
        exported.update(load_file(str(path)))
    saved = load_model_state_dict(out / "iter_0000003")
    mtp_keys = sorted(k for k in saved if k.startswith("mtp."))
    assert "mtp.layers.0.eh_proj.weight" in mtp_keys
    for key in mtp_keys:
        assert torch.equal(exported[key], saved[key]), key
    model = attach_mtp(AutoModelForCausalLM.from_pretrained(out / "hf"), 1, seed=99)
    assert not torch.equal(model.mtp.layers[0].eh_proj.weight, saved["mtp.layers.0.eh_proj.weight"])
    assert load_mtp_weights(model, str(out / "hf")) == len(mtp_keys)
    for key in mtp_keys:
        assert torch.equal(model.get_parameter(key), saved[key]), key
