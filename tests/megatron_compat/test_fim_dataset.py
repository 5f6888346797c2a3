"""Fill-in-the-middle data (`--fim-data`): our GPTFIMDataset equals, sample by sample in read order, a reference
built from megatron-core 0.16.1's own GPTDataset (the samples) and megatron-core's own tokenizer library (token
lookup, decoding, encoding), with the FIM transformation of Megatron-LM's `fim_dataset.py` written out below
from its description; Megatron flags → config; bad settings are one line each."""
from __future__ import annotations

import json
import os

import numpy
import pytest

from megatron_compat.data.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from megatron_compat.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_compat.data.indexed_dataset import IndexedDataset
from megatron_compat.data.tokenizer import build_tokenizer
from megatron_compat.data.utils import Split
from megatron_compat.translate import translate_megatron
from tests.support.tiny_models import stdlib_texts, train_bytelevel_tokenizer
from fsdp2_backend.usage_errors import UsageError

mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset")
from megatron.core.datasets.indexed_dataset import IndexedDataset as MIndexed, IndexedDatasetBuilder  # noqa: E402
from megatron.core.datasets.utils import Split as MSplit  # noqa: E402
from megatron.core.tokenizers import MegatronTokenizer  # noqa: E402

FIM = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
TOKENS = dict(zip(("prefix", "middle", "suffix", "pad"), FIM), eod="<|endoftext|>")
NUM_DOCS = 24


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A byte-level BPE tokenizer with the FIM tokens and a `<file_sep>` split token, and documents (some
    holding split tokens, one empty) written by megatron-core's builder, each ending in the eod."""
    root = tmp_path_factory.mktemp("fim")
    hf = train_bytelevel_tokenizer(root / "tok", vocab_size=400)
    hf.add_special_tokens({"additional_special_tokens": FIM + ["<file_sep>"]})
    hf.save_pretrained(str(root / "tok"))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(root / "tok"))
    texts = [t[:500] for t in stdlib_texts(NUM_DOCS)]
    texts = [t[:150] + "<file_sep>" + t[150:300] + "<file_sep>" + t[300:] if i % 3 == 0 else t
             for i, t in enumerate(texts)]
    texts[5] = ""
    prefix = str(root / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for text in texts:
        ids = tokenizer.tokenize(text) + [tokenizer.eod]
        builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + ".idx")
    return str(root / "tok"), prefix, tokenizer


class Reference:
    """Megatron-LM's FIM over megatron-core's GPTDataset samples with megatron-core's HF tokenizer library."""

    def __init__(self, base, lib, seed, rate, spm_rate, split=None, fragment_rate=None, no_prefix=None):
        self.base, self.lib, self.rng = base, lib, numpy.random.RandomState(seed)
        self.rate, self.spm_rate, self.fragment_rate, self.no_prefix = rate, spm_rate, fragment_rate, no_prefix
        self.pre, self.mid, self.suf, self.pad, self.eod = lib.tokens_to_ids(FIM + ["<|endoftext|>"])
        self.split = None if split is None else lib.tokens_to_ids(split)

    def sample(self, i):
        tokens = list(self.base._query_document_sample_shuffle_indices(i)[0])
        out, segment = [], []
        for t in tokens + [None]:  # None: the end of the sample closes the last segment
            if t is not None and t != self.eod:
                segment.append(t)
                continue
            if t is None or segment:
                out += self.segment(segment) + ([] if t is None else [self.eod])
            segment = []
        out = out[:len(tokens)] + [self.pad] * (len(tokens) - len(out))
        return numpy.array(out, dtype=numpy.int64)

    def segment(self, tokens):
        if self.split is None or self.split not in tokens:
            return self.fim(tokens, self.rate)
        if not self.rng.binomial(1, self.rate):
            return tokens
        fragments, current = [], []
        for t in tokens:
            if t == self.split:
                fragments.append(current)
                current = []
            else:
                current.append(t)
        out = []
        for fragment in fragments:
            if fragment:
                out += self.fim(fragment, self.fragment_rate) + [self.split]
        return out + self.fim(current, self.fragment_rate)

    def fim(self, tokens, rate):
        if not self.rng.binomial(1, rate):
            return tokens
        text = self.lib.ids_to_text(tokens, remove_special_tokens=True)
        if self.no_prefix is not None and text.startswith(self.no_prefix):
            return tokens
        a, b = sorted(self.rng.randint(0, len(text) + 1, size=2))
        p, m, s = (self.lib.text_to_ids(x) for x in (text[:a], text[a:b], text[b:]))
        if self.rng.binomial(1, self.spm_rate):
            return [self.pre, self.suf] + s + [self.mid] + p + m
        return [self.pre] + p + [self.suf] + s + [self.mid] + m


def _pair(corpus, tmp_path, **fim):
    tok_dir, prefix, tokenizer = corpus
    common = dict(random_seed=1234, sequence_length=48, split="1,0,0", reset_position_ids=False,
                  reset_attention_mask=False, eod_mask_loss=False)
    docs = numpy.arange(NUM_DOCS, dtype=numpy.int32)
    lib = MegatronTokenizer.from_pretrained(tokenizer_path=tok_dir, metadata_path={"library": "huggingface"},
                                            include_special_tokens=False)
    base = mcore.GPTDataset(MIndexed(prefix), prefix, docs, 80, MSplit.train,
                            mcore.GPTDatasetConfig(path_to_cache=str(tmp_path / "m"), tokenizer=lib, **common))
    ours = GPTFIMDataset(IndexedDataset(prefix), prefix, docs, 80, Split.train, GPTFIMDatasetConfig(
        path_to_cache=str(tmp_path / "o"), tokenizer=tokenizer, fim_extra_tokens=TOKENS, **common,
        fim_rate=fim["rate"], fim_spm_rate=fim["spm_rate"], fim_split_sample=fim.get("split"),
        fim_fragment_rate=fim.get("fragment_rate"), fim_no_prefix=fim.get("no_prefix")))
    return Reference(base, lib._tokenizer, 1234, **fim), ours


@pytest.mark.parametrize("fim", [dict(rate=0.5, spm_rate=0.5), dict(rate=1.0, spm_rate=0.0),
                                 dict(rate=1.0, spm_rate=1.0, no_prefix="import"),
                                 dict(rate=0.8, spm_rate=0.3, split="<file_sep>", fragment_rate=0.6)],
                         ids=["half", "psm", "spm-no-prefix", "split-fragments"])
def test_samples_equal_reference_in_read_order(corpus, tmp_path, fim):
    ref, ours = _pair(corpus, tmp_path, **fim)
    transformed = 0
    for i in range(len(ours)):
        expected = ref.sample(i)
        got = ours._query_document_sample_shuffle_indices(i)[0]
        assert got.dtype == numpy.int64 and got.tolist() == expected.tolist(), i
        transformed += int(ours.prefix_tok_id in got)
        expected = ref.sample(i)  # a second read draws anew, in both
        sample = ours[i]  # the training dict: tokens / labels shifted by one from the FIM sample
        assert sample["tokens"].tolist() == expected[:-1].tolist()
        assert sample["labels"].tolist() == expected[1:].tolist()
    assert transformed > len(ours) // 4  # the rates took effect (a FIM-less dataset fails the equality)


def test_rate_zero_is_gpt_dataset(corpus, tmp_path):
    tok_dir, prefix, tokenizer = corpus
    docs = numpy.arange(NUM_DOCS, dtype=numpy.int32)
    common = dict(random_seed=7, sequence_length=48, split="1,0,0", reset_position_ids=False,
                  reset_attention_mask=False, eod_mask_loss=False, tokenizer=tokenizer)
    plain = GPTDataset(IndexedDataset(prefix), prefix, docs, 40, Split.train,
                       GPTDatasetConfig(path_to_cache=str(tmp_path / "a"), **common))
    fim = GPTFIMDataset(IndexedDataset(prefix), prefix, docs, 40, Split.train, GPTFIMDatasetConfig(
        path_to_cache=str(tmp_path / "b"), fim_rate=0.0, fim_spm_rate=0.5, fim_extra_tokens=TOKENS, **common))
    assert fim.unique_identifiers["class"] == "GPTFIMDataset"  # Megatron-LM's cache names
    eod, dropped = tokenizer.eod, 0
    for i in range(len(plain)):
        raw = plain._query_document_sample_shuffle_indices(i)[0].tolist()
        # Megatron-LM's loop drops the eod that closes an empty segment (a sample starting at an eod, or two
        # eods in a row) and pads the end with the FIM pad token; nothing else changes at rate 0
        kept = [t for j, t in enumerate(raw) if not (t == eod and (j == 0 or raw[j - 1] == eod))]
        dropped += len(raw) - len(kept)
        expected = kept + [fim.pad_tok_id] * (len(raw) - len(kept))
        assert fim._query_document_sample_shuffle_indices(i)[0].tolist() == expected
    assert dropped > 0  # the corpus has an empty document: the case occurs


def test_unknown_fim_token_is_one_line(corpus, tmp_path):
    with pytest.raises(UsageError, match="--fim-prefix-token <nope>: not a single token"):
        _, prefix, tokenizer = corpus
        GPTFIMDataset(IndexedDataset(prefix), prefix, numpy.arange(NUM_DOCS, dtype=numpy.int32), 10, Split.train,
                      GPTFIMDatasetConfig(random_seed=1, sequence_length=48, split="1,0,0", tokenizer=tokenizer,
                                          reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                          path_to_cache=str(tmp_path), fim_rate=0.5, fim_spm_rate=0.5,
                                          fim_extra_tokens={**TOKENS, "prefix": "<nope>"}))


BASE = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --tokenizer-type NullTokenizer "
        "--vocab-size 100 --data-path corpus").split()


def test_flags_translate_and_validate():
    fields = translate_megatron(BASE + ["--fim-data", "--fim-rate", "0.7", "--fim-spm-rate", "0.2",
                                        "--fim-split-sample", "<file_sep>", "--fim-fragment-rate", "0.3",
                                        "--fim-no-prefix", "#!", "--fim-eod-token", "</s>"]).fields["data"]
    assert (fields["fim_data"], fields["fim_rate"], fields["fim_spm_rate"], fields["fim_split_sample"],
            fields["fim_fragment_rate"], fields["fim_no_prefix"]) == (True, 0.7, 0.2, "<file_sep>", 0.3, "#!")
    assert fields["fim_tokens"] == {**TOKENS, "eod": "</s>"}
    assert "fim_rate" not in translate_megatron(BASE + ["--fim-rate", "0.7"]).fields["data"]
    for extra, message in ((["--fim-split-sample", "<s>"], "--fim-fragment-rate"),
                           (["--fim-rate", "1.5"], "not a probability")):
        with pytest.raises(UsageError, match=message):
            _validate(BASE + ["--fim-data"] + extra)


def _validate(argv):
    from fsdp2_backend.launch import parse_command_line

    parse_command_line(argv, 1)
