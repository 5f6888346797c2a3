"""Packed rows (neat_packing) through a real tiny Qwen3: the packed attention equals attention with a dense
block-diagonal causal mask, and packed training sees the same per-sample losses as each sample alone (plain
packing does not: its samples attend to the earlier ones of their row)."""
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from fsdp2_backend.data.sft.collator import SFTCollator
from fsdp2_backend.data.sft.supervised import IGNORE_INDEX
from fsdp2_backend.models.packed_attention import PACKED_ATTENTION, packed_attention
from fsdp2_backend.cli.demo_assets import tiny_qwen3_config


class _Module:
    is_causal = True


def test_packed_attention_equals_a_dense_block_diagonal_mask():
    torch.manual_seed(0)
    b, h, hkv, s, d = 2, 4, 2, 12, 8
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 0, 1, 0, 1, 2]])
    out, _ = packed_attention(_Module(), q, k, v, None, scaling=d ** -0.5, position_ids=positions)
    doc = (positions == 0).cumsum(-1)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal  # [b, s, s]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=mask[:, None], scale=d ** -0.5).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def _per_sample_losses(model, batch):
    logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    return (losses * batch["loss_mask"].flatten()).view_as(batch["labels"])


def test_neat_packing_keeps_per_sample_losses_and_plain_packing_does_not():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=64), attn_implementation="sdpa").eval()
    samples = [torch.randint(1, 64, (n,)).tolist() for n in (7, 5, 9)]
    rows = [{"input_ids": ids, "labels": [IGNORE_INDEX] + ids[1:], "doc_lens": [len(ids)]} for ids in samples]
    packed_row = [{"input_ids": sum(samples, []), "labels": sum((r["labels"] for r in rows), []),
                   "doc_lens": [len(ids) for ids in samples]}]
    with torch.no_grad():
        alone = [_per_sample_losses(model, SFTCollator(0, False)([row]))[0].sum().item() for row in rows]
        model.set_attn_implementation(PACKED_ATTENTION)
        neat = _per_sample_losses(model, SFTCollator(0, True)(packed_row))[0]
        model.set_attn_implementation("sdpa")
        plain = _per_sample_losses(model, SFTCollator(0, False)(packed_row))[0]
    bounds = [0, 7, 12, 21]
    neat_sums = [neat[a:b].sum().item() for a, b in zip(bounds, bounds[1:])]
    plain_sums = [plain[a:b].sum().item() for a, b in zip(bounds, bounds[1:])]
    assert all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(neat_sums, alone)), (neat_sums, alone)
    assert abs(plain_sums[0] - alone[0]) <= 1e-5 * abs(alone[0])  # the first sample has nothing before it
    assert all(abs(x - y) > 1e-3 for x, y in zip(plain_sums[1:], alone[1:])), (plain_sums, alone)
