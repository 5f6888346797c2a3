"""`model.mla_scale_q_lora` / `model.mla_scale_kv_lora` (MindSpeed's --enable-mla-scale-*-lora) in validation: kept for
an MLA model, refused with the reason, before any process group, for a model without MLA or without a query latent."""
import pytest

from fsdp2_backend.config.loading import build_config
from fsdp2_backend.config.validation import validate_with_notices
from fsdp2_backend.usage_errors import UsageError
from tests.support.tiny_models import tiny_model_dir
from tests.support.tiny_models import tiny_mla_config


def _validate(model_dir, tmp_path, **model):
    base = {"model": {"model_name_or_path": str(model_dir), "train_from_scratch": True, **model},
            "data": {"data_manager_type": "mg", "mock_data": True, "cutoff_len": 32},
            "training": {"stage": "pt", "output_dir": str(tmp_path / "out"), "max_steps": 2,
                         "per_device_train_batch_size": 2}}
    return validate_with_notices(build_config([("test", base)]), 1)[0]


def _mla_dir(tmp_path, q_lora_rank):
    path = tmp_path / f"mla_{q_lora_rank}"
    tiny_mla_config(q_lora_rank).save_pretrained(str(path))
    tiny = tiny_model_dir(tmp_path / "tok", seed=0)  # its tokenizer files beside the MLA config
    import shutil
    from pathlib import Path
    for f in Path(tiny).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy2(f, path / f.name)
    return path


def test_kept_for_an_mla_model(tmp_path):
    config = _validate(_mla_dir(tmp_path, 16), tmp_path, mla_scale_q_lora=True, mla_scale_kv_lora=True)
    assert (config.model.mla_scale_q_lora, config.model.mla_scale_kv_lora) == (True, True)


def test_refused_without_mla_or_query_latent(tmp_path):
    with pytest.raises(UsageError, match=r"model.mla_scale_kv_lora: the model \(qwen3\) has no multi-latent"):
        _validate(tiny_model_dir(tmp_path / "qwen", seed=0), tmp_path, mla_scale_kv_lora=True)
    with pytest.raises(UsageError, match="model.mla_scale_q_lora: .* no query latent"):
        _validate(_mla_dir(tmp_path, None), tmp_path, mla_scale_q_lora=True)
    assert _validate(_mla_dir(tmp_path, None), tmp_path, mla_scale_kv_lora=True).model.mla_scale_kv_lora
