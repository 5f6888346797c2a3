"""The model ids MindSpeed-LLM added after the seed (deepseek_v4, glm52, longcat_flash_ngram) against transformers:
a tiny model saved by transformers (its on-disk layout: DeepSeek-V4's native `attn.wq_a` / `ffn.experts.{e}.w1`
keys, per-expert GLM / LongCat keys) loads through the engine's streaming loader (meta-device init) and gives
transformers' logits and loss; LongCat-Flash-Lite's n-gram embeddings against a loop written from MindSpeed's
description (per-document history, polynomial hash, mean of 1 + k(n-1) embeddings)."""
import pytest
import torch

from fsdp2_backend.config.schema import ModelArguments

VOCAB = 96


def tiny_config(model_id):
    from transformers import DeepseekV4Config, GlmMoeDsaConfig

    if model_id == "deepseek_v4":
        return DeepseekV4Config(
            vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
            n_shared_experts=1, max_position_embeddings=128, o_groups=2, o_lora_rank=8, index_n_heads=2,
            index_head_dim=8, index_topk=4, sliding_window=4, qk_rope_head_dim=8, hc_mult=2, swiglu_limit=0.05,
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            mlp_layer_types=["hash_moe", "moe"],  # one hash-routed layer, one top-k layer
            # one compressed-sparse-attention layer (the lightning indexer and its KL loss), one heavily compressed
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
            tie_word_embeddings=False)
    if model_id == "glm52":
        return GlmMoeDsaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=8,
            q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, index_topk=4, index_head_dim=8,
            index_n_heads=2, first_k_dense_replace=1, max_position_embeddings=128, tie_word_embeddings=False)
    from fsdp2_backend.models.longcat_flash_ngram.modeling import LongcatFlashNgramConfig

    return LongcatFlashNgramConfig(
        vocab_size=VOCAB, hidden_size=48, num_layers=1, num_attention_heads=2, num_key_value_heads=2,
        ffn_hidden_size=32, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8,
        v_head_dim=8, moe_topk=2, n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=16,
        max_position_embeddings=128, ngram_vocab_size_ratio=2, emb_neighbor_num=3, emb_split_num=2,
        eos_token_id=5, pad_token_id=0, tie_word_embeddings=False)


def save_tiny(model_id, path, seed=0):
    """A seeded tiny model of `model_id` saved by transformers (router biases non-zero)."""
    from fsdp2_backend.models.registry import model_spec

    spec = model_spec(model_id)
    if spec.register_hf:
        spec.register_hf()
    torch.manual_seed(seed)
    model = spec.build(tiny_config(model_id))
    model.init_weights() if hasattr(model, "init_weights") else None
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
    model.save_pretrained(str(path))
    return model


def _engine_model(model_id, path):
    from fsdp2_backend.models.loading import create_model, load_hf_config

    args = ModelArguments(model_name_or_path=str(path), model_id=model_id, init_model_with_meta_device=True)
    hf_config = load_hf_config(args)
    return create_model(args, hf_config, seed=1, device=torch.device("cpu"), parallelize=lambda m: m)


@pytest.mark.parametrize("model_id, hf_class", [("deepseek_v4", "DeepseekV4ForCausalLM"),
                                                 ("glm52", "GlmMoeDsaForCausalLM")])
def test_streamed_model_equals_transformers(model_id, hf_class, tmp_path):
    import transformers

    save_tiny(model_id, tmp_path)
    ours = _engine_model(model_id, tmp_path).eval()
    reference = getattr(transformers, hf_class).from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(6, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = ours(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss)
    experts = [m for m in ours.modules() if type(m).__name__.endswith("GroupedExperts")]
    assert len(experts) == (2 if model_id == "deepseek_v4" else 1)  # GLM's first layer is dense


def _ngram_reference(ids, embed, embedders, projs, vocab, n, k, eos):
    """MindSpeed's n-gram embedding as a plain loop over positions."""
    batch, seq = ids.shape
    out = torch.zeros(batch, seq, embed.shape[1])
    for b in range(batch):
        start = 0
        for s in range(seq):
            token = int(ids[b, s])
            total = embed[token].clone()
            for i in range(2, n + 1):
                for j in range(k):
                    t = (i - 2) * k + j
                    size = len(embedders[t])
                    h = token
                    for m in range(1, i):
                        prev = int(ids[b, s - m]) if s - m >= start else 0
                        h += prev * (vocab ** m % size)
                    total = total + projs[t] @ embedders[t][h % size]
            out[b, s] = total / (1 + k * (n - 1))
            if token == eos:
                start = s + 1
    return out


def test_longcat_ngram_equals_transformers_longcat_with_the_ngram_embeddings(tmp_path):
    from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

    save_tiny("longcat_flash_ngram", tmp_path)
    ours = _engine_model("longcat_flash_ngram", tmp_path).eval()
    config = tiny_config("longcat_flash_ngram")
    plain = LongcatFlashConfig(**{k: v for k, v in config.to_dict().items()
                                  if k not in ("model_type", "ngram_vocab_size_ratio", "emb_neighbor_num",
                                               "emb_split_num", "transformers_version")})
    reference = LongcatFlashForCausalLM.from_pretrained(str(tmp_path), config=plain, dtype=torch.float32).eval()
    ids = torch.randint(6, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    ids[0, 4], ids[1, 1] = 5, 5  # EOS: the history restarts after it
    ng = ours.model.ngram_embeddings
    with torch.no_grad():
        embeds = _ngram_reference(ids, ours.model.embed_tokens.weight, [e.weight for e in ng.embedders],
                                  [p.weight for p in ng.post_projs], VOCAB, 3, 2, 5)
        want = reference(inputs_embeds=embeds).logits
        got = ours(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [len(e.weight) for e in ng.embedders] == [2 * VOCAB + 1 + 2 * t for t in range(4)]
