"""Kernel swaps check the model they patch: RoPE is swapped only where the model's own is the reference math
(partial-rotary Qwen3-Next and gpt_oss's YaRN half tables are left alone, with one log line), and the GDN flags
say what runs in the qwen3_next model id. References: transformers' own models, unswapped."""
import torch

from fsdp2_backend.config import OptimizationArguments
from fsdp2_backend.parallel.kernel_swaps import apply_fused_ops
from tests.support.tiny_models import tiny_next_config


def _swap(model, **flags):
    lines = []
    apply_fused_ops(model, OptimizationArguments(**flags), "cpu", log=lines.append)
    return lines


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=256, sliding_window=8,
                          rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                               original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                               truncate=False))
    return GptOssForCausalLM(config).eval()


def _qwen3_next():
    from transformers import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(tiny_next_config()).eval()


def test_fused_rotary_leaves_partial_rotary_and_yarn_half_tables_alone():
    for build, cls in ((_qwen3_next, "Qwen3NextAttention"), (_gpt_oss, "GptOssAttention")):
        torch.manual_seed(0)
        model = build()
        ids = torch.randint(0, 128, (1, 12))
        with torch.no_grad():
            before = model(input_ids=ids, use_cache=False).logits
        lines = _swap(model, use_fused_rotary_pos_emb=True)
        assert len(lines) == 1 and cls in lines[0] and "left alone" in lines[0], lines
        assert not any("forward" in vars(m) for m in model.modules())  # no instance got a patched forward
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, use_cache=False).logits, before)


def test_fused_rotary_still_patches_the_reference_rope():
    from transformers import Qwen3ForCausalLM

    from tests.support.tiny_models import tiny_qwen3_config

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config()).eval()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    lines = _swap(model, use_fused_rotary_pos_emb=True)
    assert len(lines) == 1 and "Qwen3Attention" in lines[0] and "left alone" not in lines[0]
    assert any("forward" in vars(m) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before)


def test_gdn_flags_say_what_runs():
    from fsdp2_backend.models.qwen3_next.modeling import build_qwen3_next

    native = _swap(_qwen3_next(), use_triton_rmsnormgated=True, gdn_chunk_size=32)
    assert len(native) == 2 and all("transformers' own" in line and "no effect" in line for line in native)
    ours = _swap(build_qwen3_next(tiny_next_config()), use_triton_rmsnormgated=True, gdn_chunk_size=32)
    assert len(ours) == 2 and "3 Gated DeltaNet layers" in ours[0] and "no effect" not in " ".join(ours)
