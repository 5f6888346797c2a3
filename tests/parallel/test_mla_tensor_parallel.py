"""The Megatron DeepSeek-V3 layout of the launch corpus in small: model id deepseek_v3 (multi-latent attention,
stacked experts with a shared expert, one MTP depth) on 2 gloo ranks at TP 2 x EP 2 with sequence parallel (the
experts not tensor-parallel: expert tensor-parallel size 1), through `build._with_mtp` + `apply_parallelism`,
gives one process's losses (lm loss + factor x MTP loss) over 3 steps."""
import torch

from tests.support.launchers import run_distributed
from tests.support.mtp_parallel_runs import FACTOR, train_steps  # the same 3 steps, batches and loss


def _config(size):
    from fsdp2_backend.config import Config

    config = Config()
    config.model.model_id, config.model.mtp_num_layers, config.model.mtp_loss_scaling_factor = "deepseek_v3", 1, FACTOR
    config.optimization.moe_grouped_gemm = True
    config.parallel.param_dtype, config.parallel.tp_size, config.parallel.ep_size = "fp32", size, size
    config.parallel.sequence_parallel = size > 1
    config.parallel.ep_modules = config.parallel.ep_fsdp_modules = ["model.layers.{*}.mlp.experts"]
    return config


def _model(config):
    from transformers import DeepseekV3Config

    from fsdp2_backend.build import _with_mtp
    from fsdp2_backend.models.registry import model_spec

    torch.manual_seed(0)
    hf_config = DeepseekV3Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
                                 num_experts_per_tok=2, intermediate_size=48, moe_intermediate_size=16,
                                 n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1,
                                 first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                 qk_rope_head_dim=8, v_head_dim=8)
    hf_config._attn_implementation = "sdpa"
    model, config = _with_mtp(model_spec("deepseek_v3").build(hf_config), config)
    return model, config


def _ranks(rank, world_size, out_dir):
    import json

    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.parallel.apply import apply_parallelism

    model, config = _model(_config(2))
    model = apply_parallelism(model, config, ParallelContext.create(config.parallel))
    attention = model.model.layers[0].self_attn
    assert attention.kv_b_proj.weight.to_local().shape[0] == 2 * 16  # 2 of 4 heads x (8 nope + 8 v)
    assert model.mtp.layers[0].transformer_layer.mlp.experts.gate_up_proj.to_local().shape[0] == 2
    losses = train_steps(model)
    if rank == 0:
        with open(f"{out_dir}/losses.json", "w") as f:
            json.dump(losses, f)


def test_deepseek_v3_tp2_ep2_sp_mtp_equals_one_process(tmp_path):
    import json

    from fsdp2_backend.parallel.apply import _model_switches

    run_distributed(_ranks, 2, str(tmp_path))
    got = json.loads((tmp_path / "losses.json").read_text())
    model, config = _model(_config(1))
    _model_switches(model, config, "cpu")
    want = train_steps(model)
    assert want[-1] < want[0]  # it trains
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
