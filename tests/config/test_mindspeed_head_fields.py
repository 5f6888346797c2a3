"""MindSpeed-LLM c77308a1's newer YAML fields (config/rules/mindspeed_master_fields.py): each accepted and honoured, or
reported once as having no effect here, or refused with MindSpeed's own rule — with non-default values."""
import pytest

from fsdp2_backend.config.loading import build_config
from fsdp2_backend.config.validation import validate_with_notices
from fsdp2_backend.usage_errors import UsageError
from tests.support.tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=0)


def _validate(model_dir, tmp_path, world=2, **groups):
    base = {"model": {"model_name_or_path": model_dir}, "data": {"data_manager_type": "mg", "mock_data": True,
                                                                  "cutoff_len": 32},
            "training": {"stage": "pt", "output_dir": str(tmp_path), "max_steps": 2,
                         "per_device_train_batch_size": 4}}
    for group, values in groups.items():
        base.setdefault(group, {}).update(values)
    return validate_with_notices(build_config([("test", base)]), world)


def test_honoured_fields_and_aliases(model_dir, tmp_path):
    config, notices = _validate(
        model_dir, tmp_path,
        parallel={"cp_size": 2, "cp_type": "kvallgather", "enable_chunk_batch": True, "chunk_mbs": 3,
                  "chunk_mbs_batch_dim": 1, "chunk_mbs_modules": ["model.layers.{*}"], "chunk_mbs_arg_indexs": [0, 2],
                  "chunk_mbs_kwarg_names": ["position_ids"]},
        training={"deterministic": False, "optimizer": "fused_adamw", "router_aux_loss_coef": 0.003,
                  "mtp_loss_scaling_factor": 0.3})
    p, t = config.parallel, config.training
    assert p.cp_type == "ring"  # MindSpeed's kvallgather: the same exact attention, run as ring
    assert (p.enable_chunk_batch, p.chunk_mbs, p.chunk_mbs_batch_dim, p.chunk_mbs_arg_indexs,
            p.chunk_mbs_kwarg_names) == (True, 3, 1, [0, 2], ["position_ids"])
    assert (t.deterministic, t.optimizer, t.router_aux_loss_coef) == (False, "fused_adamw", 0.003)
    assert config.model.mtp_loss_scaling_factor == 0.3  # the alias lands on the field the MTP loss reads
    assert any(n.startswith("parallel.cp_type: kvallgather runs as ring") for n in notices)
    assert not any("chunk_mbs" in n and "no effect" in n for n in notices)


def test_no_effect_fields_are_reported_once(model_dir, tmp_path):
    _, notices = _validate(
        model_dir, tmp_path, model={"model_id": "qwen3"},
        parallel={"fsdp_implementation": "custom", "hook_modules": ["model.layers.{*}", "lm_head"], "chunk_mbs": 2},
        optimization={"pre_tokens": 512, "next_tokens": 4})
    expected = ["parallel.fsdp_implementation: custom (MindSpeed's own Ascend FSDP) runs as native here",
                "parallel.hook_modules: no effect", "parallel.chunk_mbs: no effect without parallel.enable_chunk_batch",
                "optimization.pre_tokens: no effect", "optimization.next_tokens: no effect"]
    for start in expected:
        assert len([n for n in notices if n.startswith(start)]) == 1, (start, notices)


def test_npu_only_ops_and_mindspeeds_refusals(model_dir, tmp_path):
    with pytest.raises(UsageError) as err:
        _validate(model_dir, tmp_path, model={"model_id": "qwen3", "mtp_loss_scaling_factor": 0.2},
                  parallel={"chunk_mbs": 0, "chunk_mbs_batch_dim": -1},
                  training={"optimizer": "fused_adamw", "o2_optimizer": True, "router_aux_loss_coef": -1.0,
                            "indexer_loss_coeff": -0.5,
                            "mtp_loss_scaling_factor": 0.3},
                  optimization={"use_sparse_flash_attn": True, "use_ascend_mhc": True, "use_triton_swiglu_limit": True})
    text = str(err.value)
    for start in ("parallel.chunk_mbs: must be at least 1", "parallel.chunk_mbs_batch_dim / chunk_mbs_arg_indexs",
                  "training.optimizer: fused_adamw and training.o2_optimizer",
                  "training.router_aux_loss_coef: must be >= 0", "training.indexer_loss_coeff: must be >= 0",
                  "training.mtp_loss_scaling_factor: 0.3 and model.mtp_loss_scaling_factor 0.2",
                  "optimization.use_sparse_flash_attn: for DSA models only",
                  "optimization.use_ascend_mhc: for model_id deepseek_v4 only",
                  "optimization.use_triton_swiglu_limit: for model_id deepseek_v4 only"):
        assert start in text, (start, text)
    # on a DSA model the NPU-only ops are accepted and said to have no effect here
    from fsdp2_backend.config.rules.mindspeed_master_fields import head_field_notices

    config = build_config([("t", {"model": {"model_id": "glm52"}, "optimization": {
        "use_sparse_flash_attn": True, "use_fused_lightning_indexer": True, "use_fused_lightning_indexer_loss": True}})])
    notices = head_field_notices(config)
    assert [n.split(":")[0] for n in notices if n.startswith("optimization.") and "NPU" in n] == [
        "optimization.use_sparse_flash_attn", "optimization.use_fused_lightning_indexer",
        "optimization.use_fused_lightning_indexer_loss"]
    # both DSA models train their indexer (models/dsa_indexer_loss.py): no notice for the coefficient
    assert not any(n.startswith("training.indexer_loss_coeff") for n in notices)
    config = build_config([("t", {"model": {"model_id": "deepseek_v4"}, "training": {"indexer_loss_coeff": 0.3}})])
    assert not any(n.startswith("training.indexer_loss_coeff") for n in head_field_notices(config))


def test_chunk_batch_refuses_megatron_load_balancing_losses(model_dir, tmp_path):
    from fsdp2_backend.config.rules.mindspeed_master_fields import head_field_errors

    config = build_config([("t", {"parallel": {"enable_chunk_batch": True},
                                  "model": {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01}})])
    assert any(e.startswith("parallel.enable_chunk_batch: Megatron's load-balancing losses")
               for e in head_field_errors(config))


def test_transformers_routed_ids_refuse_megatrons_router_options():
    from fsdp2_backend.config.rules.mindspeed_master_fields import head_field_errors

    for model_id in ("deepseek_v4", "longcat_flash_ngram"):
        config = build_config([("t", {"model": {"model_id": model_id, "moe_router_score_function": "sigmoid"}})])
        assert any(e.startswith(f"model.moe_router_*: model_id {model_id} routes with transformers' own routers")
                   for e in head_field_errors(config))
    config = build_config([("t", {"model": {"model_id": "glm52", "moe_router_score_function": "sigmoid"}})])
    assert not head_field_errors(config)  # glm52 carries the project's router
