"""The SentencePiece BPE fast path (fast_spm): same ids as `SentencePieceProcessor.encode` on real local text,
for the default (nmt_nfkc) and Llama-style (identity, byte fallback, split digits) models; declines what it
cannot represent; falls back when its self-check disagrees with the processor."""
import io
import json

import pytest

from megatron_compat.data.fast_spm import select_fast_path
from megatron_compat.data.preprocess import preprocess_files
from megatron_compat.data.tokenizer import build_tokenizer
from tests.support.tiny_models import stdlib_texts

# characters the small models never saw (unknown runs, byte fallback), odd whitespace, compatibility forms
_EDGES = ["héllo wörld ✓ 日本語 🙂 ☃☃x", "  indented\tcode\n\n    y = 1  ", "ｶﾀｶﾅ ﬁ ① 12345 ６７", "a\u00a0b\u3000c\x00d",
          "\U0001f600\U0001f600a ▁▁b", "x" * 5000]


def _train(tmp_path, name, **options):
    import sentencepiece

    lines = [line for text in stdlib_texts(60, 3000) for line in text.splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / name),
                                             vocab_size=options.pop("vocab_size", 1500), minloglevel=2,
                                             **options)
    return build_tokenizer("Llama2Tokenizer", tokenizer_model=str(tmp_path / f"{name}.model"))


@pytest.mark.parametrize("options", [
    dict(model_type="bpe"),
    dict(model_type="bpe", byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
         split_digits=True),
], ids=["nmt_nfkc", "llama_style"])
def test_fast_path_gives_sentencepiece_ids(tmp_path, options):
    tokenizer = _train(tmp_path, "sp", **options)
    texts = stdlib_texts(300, 6000)[60:] + _EDGES  # text the model was not trained on
    fast, why = select_fast_path(tokenizer, texts[:10])
    assert fast is not None, why
    expected = [tokenizer.sp.encode(text, out_type=int) for text in texts]
    assert fast.tokenize_batch(texts) == expected
    assert any(tokenizer.sp.unk_id() in ids or any(tokenizer.sp.is_byte(i) for i in ids) for ids in expected)


@pytest.mark.parametrize("options, reason", [
    (dict(model_type="unigram"), "model type 1"),
    (dict(model_type="bpe", user_defined_symbols=["<tool>"]), "user-defined piece '<tool>'"),
    (dict(model_type="bpe", split_by_whitespace=False), "inside"),
])
def test_declines_what_it_cannot_represent(tmp_path, options, reason):
    fast, why = select_fast_path(_train(tmp_path, "sp", **options), stdlib_texts(3))
    assert fast is None and reason in why


def test_falls_back_when_the_check_disagrees(tmp_path):
    tokenizer = _train(tmp_path, "sp", model_type="bpe")
    assert select_fast_path(tokenizer, stdlib_texts(3))[0] is not None
    import sentencepiece

    # a processor that adds a BOS to every text: an encode option the fast path does not model
    tokenizer.sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"), add_bos=True)
    fast, why = select_fast_path(tokenizer, stdlib_texts(3))
    assert fast is None and "disagrees with SentencePiece on sample text 0" in why


def test_preprocess_uses_it_and_writes_the_same_files(tmp_path):
    tokenizer = _train(tmp_path, "sp", model_type="bpe", byte_fallback=True)
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in stdlib_texts(80, 4000) + _EDGES))
    outputs = {}
    for fast in (True, False):
        log = io.StringIO()
        prefix = preprocess_files(str(corpus), str(tmp_path / f"fast{fast}"), ["text"], tokenizer,
                                  append_eod=True, fast=fast, log=log)["text"]
        outputs[fast] = [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]
        assert ("SentencePiece fast path" in log.getvalue()) == fast
    assert outputs[True] == outputs[False]
