"""preprocess_data.py: output bytes equal to megatron-core's builder fed by Megatron's per-document algorithm
with megatron-core's own tokenizers, for each tokenizer family; Megatron's flags; every bad input."""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy
import pytest
import torch

from megatron_compat.data.preprocess import preprocess_files
from megatron_compat.data.tokenizer import build_tokenizer
from tests.support.tiny_models import stdlib_texts
from tests.support.preprocess import assert_same_files, mcore_ds, megatron_preprocess, run_preprocess_tool
from tests.support.preprocess import corpus, hf_dir  # noqa: F401  (pytest fixtures)

mcore_tok = pytest.importorskip("megatron.core.tokenizers.text.utils.build_tokenizer")


def _megatron_tokenizer(tokenizer_type, tokenizer_model=None, vocab_size=None, include_special_tokens=False):
    ns = argparse.Namespace(
        tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model, vocab_file=None, merge_file=None,
        tokenizer_special_tokens=None, tokenizer_hf_use_fast=True, trust_remote_code=False,
        tokenizer_hf_include_special_tokens=include_special_tokens, tokenizer_metadata=None, vocab_size=vocab_size,
        tiktoken_pattern=None, tokenizer_sentencepiece_legacy=False, tiktoken_num_special_tokens=1000)
    return mcore_tok.build_tokenizer(ns)


def test_cli_bytelevel_two_workers_matches_megatron(tmp_path, hf_dir, corpus):
    path, lines = corpus
    result = run_preprocess_tool("--input", path, "--output-prefix", tmp_path / "ours", "--tokenizer-type",
                       "HuggingFaceTokenizer", "--tokenizer-model", hf_dir, "--json-keys", "text", "title",
                       "--append-eod", "--workers", 2, "--log-interval", 10)
    assert result.returncode == 0, result.stderr
    assert "tiktoken fast path, identical" in result.stderr
    assert f"Processed {len(lines) // 10 * 10} documents (" in result.stderr and " MB/s)." in result.stderr
    megatron_preprocess(lines, ["text", "title"], _megatron_tokenizer("HuggingFaceTokenizer", hf_dir), True,
                        tmp_path / "ref")
    assert_same_files(tmp_path / "ours", tmp_path / "ref", ["text", "title"])
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("append_eod", [False, True])
def test_hf_path_without_fast_path_matches_megatron(tmp_path, hf_dir, corpus, append_eod):
    path, lines = corpus
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    preprocess_files(str(path), str(tmp_path / "ours"), ["title", "text"], tokenizer, append_eod=append_eod,
                     workers=1, fast=False, batch_bytes=4096)
    megatron_preprocess(lines, ["title", "text"], _megatron_tokenizer("HuggingFaceTokenizer", hf_dir),
                        append_eod, tmp_path / "ref")
    assert_same_files(tmp_path / "ours", tmp_path / "ref", ["title", "text"])


def _retokenizer(hf_dir, out_dir, edit):
    """The trained tokenizer with its pipeline edited (as Qwen / Llama 3 style tokenizers differ)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(Path(hf_dir, "tokenizer.json").read_text())
    edit(spec)
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(str(out_dir))
    return str(out_dir)


LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_and_bos(spec):
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|pad|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                              "special_tokens": {"<|pad|>": {"id": "<|pad|>", "ids": [1], "tokens": ["<|pad|>"]}}}


def _lowercase(spec):
    spec["normalizer"] = {"type": "Lowercase"}


@pytest.mark.parametrize("edit,expect,specials", [
    (_split_and_bos, "tiktoken fast path, identical", False),
    (_split_and_bos, "tiktoken fast path, identical", True),
    (_lowercase, "cannot represent this tokenizer (normalizer Lowercase)", False)])
def test_fast_path_variants_and_fallback(tmp_path, hf_dir, corpus, edit, expect, specials, capsys):
    path, lines = corpus
    tok_dir = _retokenizer(hf_dir, tmp_path / "tok", edit)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tok_dir, include_special_tokens=specials)
    preprocess_files(str(path), str(tmp_path / "ours"), ["text", "title"], tokenizer, append_eod=True,
                     workers=1)
    assert expect in capsys.readouterr().err
    reference = _megatron_tokenizer("HuggingFaceTokenizer", tok_dir, include_special_tokens=specials)
    assert (reference.tokenize("x")[0] == 1) == specials  # the BOS, only with special tokens
    megatron_preprocess(lines, ["text", "title"], reference, True, tmp_path / "ref")
    assert_same_files(tmp_path / "ours", tmp_path / "ref", ["text", "title"])


def _ignore_merges(spec):
    spec["model"]["ignore_merges"] = True


def _prefix_space(spec):
    spec["pre_tokenizer"]["add_prefix_space"] = True


def _lstrip_token(spec):
    spec["added_tokens"][1]["lstrip"] = True


@pytest.mark.parametrize("edit,reason", [(_ignore_merges, None), (_prefix_space, "add_prefix_space=True"),
                                         (_lstrip_token, "lstrip/rstrip/single_word")])
def test_fast_path_decisions(tmp_path, hf_dir, edit, reason):
    from megatron_compat.data.fast_bpe import select_fast_path

    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=_retokenizer(hf_dir, tmp_path, edit))
    texts = stdlib_texts(max_files=20, max_chars=2000)
    fast, why = select_fast_path(tokenizer, texts)
    if reason is None:
        assert fast is not None and fast.tokenize_batch(texts) == tokenizer.tokenize_batch(texts), why
    else:
        assert fast is None and reason in why


def test_mindspeed_pretrained_from_hf_rules(tmp_path, hf_dir, corpus):
    """MindSpeed's GeneralPretrainHandler: `tokenizer(text)` with its BOS, empty texts skipped, documents
    without ids left out, items added per sentence then end_document."""
    from transformers import AutoTokenizer

    path, lines = corpus
    tok_dir = _retokenizer(hf_dir, tmp_path / "tok", _split_and_bos)
    preprocess_files(str(path), str(tmp_path / "ours"), ["title"], build_tokenizer(
        "PretrainedFromHF", tokenizer_name_or_path=tok_dir), append_eod=True, workers=2)
    hf = AutoTokenizer.from_pretrained(tok_dir)
    builder = mcore_ds.IndexedDatasetBuilder(str(tmp_path / "ref_title_document.bin"), dtype=numpy.uint16)
    for line in lines:
        value = json.loads(line)["title"]
        doc = [hf(s).input_ids for s in (value if isinstance(value, list) else [value]) if len(s) > 0]
        if not doc:
            continue
        doc[-1].append(hf.eos_token_id)
        for ids in doc:
            builder.add_item(torch.IntTensor(ids))
        builder.end_document()
    builder.finalize(str(tmp_path / "ref_title_document.idx"))
    assert_same_files(tmp_path / "ours", tmp_path / "ref", ["title"])


def test_sentencepiece_and_null_tokenizers_match_megatron(tmp_path, corpus):
    import sentencepiece

    path, lines = corpus
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(stdlib_texts(40, 3000)), vocab_size=300,
                                             model_prefix=str(tmp_path / "sp"), model_type="bpe", minloglevel=2)
    model = str(tmp_path / "sp.model")
    for kind in ("Llama2Tokenizer", "GPTSentencePieceTokenizer"):
        preprocess_files(str(path), str(tmp_path / kind), ["text", "title"],
                         build_tokenizer(kind, tokenizer_model=model), append_eod=True, workers=2)
        megatron_preprocess(lines, ["text", "title"], _megatron_tokenizer(kind, model), True,
                            tmp_path / f"ref{kind}")
        assert_same_files(tmp_path / kind, tmp_path / f"ref{kind}", ["text", "title"])
    ids_path = tmp_path / "ids.jsonl"
    id_lines = [json.dumps({"text": " ".join(str((i * 7 + j) % 70000) for j in range(i % 9 + 1))}) + "\n"
                for i in range(30)]
    ids_path.write_text("".join(id_lines))
    preprocess_files(str(ids_path), str(tmp_path / "null"), ["text"], build_tokenizer("NullTokenizer",
                     vocab_size=70000), append_eod=True)
    megatron_preprocess(id_lines, ["text"], _megatron_tokenizer("NullTokenizer", vocab_size=70000), True,
                        tmp_path / "refnull")
    assert_same_files(tmp_path / "null", tmp_path / "refnull", ["text"])


def test_gpt2_bpe_files_give_the_hf_ids(tmp_path, hf_dir):
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(Path(hf_dir, "tokenizer.json"))).model.save(str(tmp_path))
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                           merge_file=str(tmp_path / "merges.txt"))
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    text = "def f(x):\n    return x  # ok <|endoftext|>"
    assert gpt2.tokenize(text) == hf.tokenize(text) and gpt2.eod == hf.eod == 0


def test_partitions_glob_gzip_and_order(tmp_path, hf_dir, corpus):
    _, lines = corpus
    half = len(lines) // 2
    (tmp_path / "a.jsonl").write_text("".join(lines[:half]))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(lines[half:]))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    reference = _megatron_tokenizer("HuggingFaceTokenizer", hf_dir)
    pattern = str(tmp_path / "*.jsonl*")
    preprocess_files(pattern, str(tmp_path / "rr"), ["text"], tokenizer, append_eod=True, workers=2,
                     partitions=2, batch_docs=5)
    megatron_preprocess(lines, ["text"], reference, True, tmp_path / "refrr",
                        order=list(range(0, len(lines), 2)) + list(range(1, len(lines), 2)))
    assert_same_files(tmp_path / "rr", tmp_path / "refrr", ["text"])
    preprocess_files(pattern, str(tmp_path / "seq"), ["text"], tokenizer, append_eod=True, workers=2,
                     partitions=2, keep_sequential_samples=True)
    megatron_preprocess(lines, ["text"], reference, True, tmp_path / "refseq")
    assert_same_files(tmp_path / "seq", tmp_path / "refseq", ["text"])


def test_parquet_input_matches_jsonl(tmp_path, hf_dir, corpus):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    _, lines = corpus
    records = [json.loads(line) for line in lines]
    pq.write_table(pa.table({"text": [r["text"] for r in records]}), tmp_path / "c.parquet", row_group_size=7)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    preprocess_files(str(tmp_path / "c.parquet"), str(tmp_path / "pq"), ["text"], tokenizer, append_eod=True,
                     workers=2)
    megatron_preprocess(lines, ["text"], _megatron_tokenizer("HuggingFaceTokenizer", hf_dir), True,
                        tmp_path / "ref")
    assert_same_files(tmp_path / "pq", tmp_path / "ref", ["text"])


def test_split_sentences_with_locally_trained_punkt(tmp_path, hf_dir, corpus, monkeypatch):
    nltk = pytest.importorskip("nltk")
    from nltk.tokenize.punkt import PunktTokenizer, PunktTrainer, save_punkt_params

    lang_dir = tmp_path / "nltk" / "tokenizers" / "punkt_tab" / "english"
    lang_dir.mkdir(parents=True)
    trainer = PunktTrainer()
    trainer.train("\n".join(stdlib_texts(40, 3000)), finalize=True)
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk")] + nltk.data.path)
    save_punkt_params(trainer.get_params(), dir=str(lang_dir))
    path, lines = corpus
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    preprocess_files(str(path), str(tmp_path / "ours"), ["text"], tokenizer, append_eod=True, workers=2,
                     split_sentences=True)
    splitter = PunktTokenizer("english")
    split_lines = [json.dumps({"text": splitter.tokenize(json.loads(line)["text"])}) for line in lines]
    megatron_preprocess(split_lines, ["text"], _megatron_tokenizer("HuggingFaceTokenizer", hf_dir), True,
                        tmp_path / "ref", level="sentence")
    assert_same_files(tmp_path / "ours", tmp_path / "ref", ["text"], level="sentence")
    # --keep-newlines: the same text, sentence by sentence, with the newlines after sentences kept
    preprocess_files(str(path), str(tmp_path / "nl"), ["text"], tokenizer, workers=1, split_sentences=True,
                     keep_newlines=True)
    from megatron_compat.data.indexed_dataset import IndexedDataset

    def document_texts(prefix):
        dataset = IndexedDataset(prefix)
        bounds = dataset.document_indices
        return ["".join(tokenizer.detokenize(dataset[i].tolist()) for i in range(bounds[d], bounds[d + 1]))
                for d in range(len(bounds) - 1)]

    kept = document_texts(str(tmp_path / "nl_text_sentence"))
    eaten = document_texts(str(tmp_path / "ref_text_sentence"))
    originals = [json.loads(line)["text"] for line in lines]
    assert ["".join(t.split()) for t in kept] == ["".join(t.split()) for t in originals]
    assert sum(t.count("\n") for t in kept) > sum(t.count("\n") for t in eaten)
