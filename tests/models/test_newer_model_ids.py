"""The model ids MindSpeed-LLM added after the seed (deepseek_v4, glm52, longcat_flash_ngram) against transformers:
a tiny model saved by transformers (its on-disk layout: DeepSeek-V4's native `attn.wq_a` / `ffn.experts.{e}.w1`
keys, per-expert GLM / LongCat keys) loads through the engine's streaming loader (meta-device init) and gives
transformers' logits and loss; LongCat-Flash-Lite's n-gram embeddings against a loop written from MindSpeed's
description (per-document history, polynomial hash, mean of 1 + k(n-1) embeddings)."""
import pytest
import torch

from tests.support.tiny_models import NEWER_VOCAB, engine_model, save_tiny, tiny_newer_config


@pytest.mark.parametrize("model_id, hf_class", [("deepseek_v4", "DeepseekV4ForCausalLM"),
                                                 ("glm52", "GlmMoeDsaForCausalLM")])
def test_streamed_model_equals_transformers(model_id, hf_class, tmp_path):
    import transformers

    save_tiny(model_id, tmp_path)
    ours = engine_model(model_id, tmp_path).eval()
    reference = getattr(transformers, hf_class).from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(6, NEWER_VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
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
    ours = engine_model("longcat_flash_ngram", tmp_path).eval()
    config = tiny_newer_config("longcat_flash_ngram")
    plain = LongcatFlashConfig(**{k: v for k, v in config.to_dict().items()
                                  if k not in ("model_type", "ngram_vocab_size_ratio", "emb_neighbor_num",
                                               "emb_split_num", "transformers_version")})
    reference = LongcatFlashForCausalLM.from_pretrained(str(tmp_path), config=plain, dtype=torch.float32).eval()
    ids = torch.randint(6, NEWER_VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    ids[0, 4], ids[1, 1] = 5, 5  # EOS: the history restarts after it
    ng = ours.model.ngram_embeddings
    with torch.no_grad():
        embeds = _ngram_reference(ids, ours.model.embed_tokens.weight, [e.weight for e in ng.embedders],
                                  [p.weight for p in ng.post_projs], NEWER_VOCAB, 3, 2, 5)
        want = reference(inputs_embeds=embeds).logits
        got = ours(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [len(e.weight) for e in ng.embedders] == [2 * NEWER_VOCAB + 1 + 2 * t for t in range(4)]
