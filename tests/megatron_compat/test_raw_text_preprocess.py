"""Raw-text pretraining data (a parquet / jsonl `dataset`) tokenized as fsdp2_backend/data/pretrain.py does it:
`preprocess_files(raw, prefix, ["text"], tokenizer, append_eod=...)` with the run's tokenizer, on transformers 5.

The tokenizers are real byte-level BPEs trained locally (tests.support.tiny_models), saved and re-loaded with
`AutoTokenizer.from_pretrained`: the project's own (a `TokenizersBackend`) and a Qwen2-style one (a
`Qwen2Tokenizer`: NFC, Split + ByteLevel, special added tokens). Both kinds of tokenizer object are passed: the
transformers tokenizer itself (whose `.backend` is the string "tokenizers" on transformers 5, which crashed
the tiktoken fast path) and the engine's `load_tokenizer` wrapper. The expected ids are plain HF's
`tokenizer(text)["input_ids"]` + eos, read back from the written .bin/.idx with megatron-core's IndexedDataset.
"""
from __future__ import annotations

import io
import json

import pytest

from megatron_compat.data.fast_bpe import rust_tokenizer, select_fast_path
from megatron_compat.data.preprocess import preprocess_files
from tests.support.tiny_models import stdlib_texts, train_bytelevel_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
mcore_ds = pytest.importorskip("megatron.core.datasets.indexed_dataset")

# real text plus the edges: added tokens inside text, unicode, whitespace runs, CRLF, digits
_EDGES = ["hello world", "def f(x):\n    return x  <|im_end|>\n\n", "ünï 日本語 🙂 ✓ Ａ\u0301 e\u0301",
          "<|endoftext|>x<|endoftext|>", "a\r\nb\u00a0c\t\t 12345 I'm", "  leading and trailing  "]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """{"bytelevel": the project's tiny tokenizer directory, "qwen": a Qwen2Tokenizer built from its
    vocabulary and merges}, both saved with save_pretrained."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    base = tmp_path_factory.mktemp("tok")
    train_bytelevel_tokenizer(base / "bytelevel", vocab_size=400)
    model = json.loads((base / "bytelevel" / "tokenizer.json").read_text())["model"]
    qwen = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],
                          eos_token="<|endoftext|>", pad_token="<|pad|>",
                          additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    qwen.save_pretrained(str(base / "qwen"))
    return {"bytelevel": str(base / "bytelevel"), "qwen": str(base / "qwen")}


@pytest.fixture(scope="module")
def texts():
    return stdlib_texts(max_files=30, max_chars=2500) + _EDGES


def _write_raw(folder, texts, kind: str) -> str:
    if kind == "parquet":
        path = folder / "corpus.parquet"
        pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), str(path), row_group_size=7)
    else:
        path = folder / "corpus.jsonl"
        path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return str(path)


def _run_tokenizer(kind: str, path: str):
    """The tokenizer object the run hands to preprocessing: the transformers tokenizer itself, or the
    engine's (fsdp2_backend.data.tokenizer.load_tokenizer: megatron_compat's PretrainedFromHF wrapper)."""
    from transformers import AutoTokenizer

    if kind == "hf":
        return AutoTokenizer.from_pretrained(path)
    from fsdp2_backend.config import ModelArguments
    from fsdp2_backend.data.tokenizer import load_tokenizer

    return load_tokenizer(ModelArguments(tokenizer_name_or_path=path))


def _read_back(prefix: str):
    dataset = mcore_ds.IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))], dataset.document_indices.tolist()


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("raw_kind", ["parquet", "jsonl"])
@pytest.mark.parametrize("object_kind", ["hf", "engine"])
@pytest.mark.parametrize("tok_kind", ["bytelevel", "qwen"])
def test_raw_text_gives_hf_ids_through_the_fast_path(tmp_path, tokenizer_dirs, texts, tok_kind, object_kind,
                                                     raw_kind, workers):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dirs[tok_kind])  # the independent reference
    assert isinstance(hf.backend, str)  # transformers 5: the backend's name, not the Rust tokenizer
    raw = _write_raw(tmp_path, texts, raw_kind)
    log = io.StringIO()
    prefixes = preprocess_files(raw, str(tmp_path / "out" / "corpus"), ["text"],
                                _run_tokenizer(object_kind, tokenizer_dirs[tok_kind]), append_eod=True,
                                workers=workers, batch_docs=8, log=log)
    assert "Tokenizer: tiktoken fast path, identical to the HF tokenizer" in log.getvalue(), log.getvalue()

    expected = [hf(text)["input_ids"] + [hf.eos_token_id] for text in texts]
    assert any(hf.convert_tokens_to_ids("<|im_end|>") in ids for ids in expected) == (tok_kind == "qwen")
    got, document_indices = _read_back(prefixes["text"])
    assert got == expected
    assert document_indices == list(range(len(texts) + 1))


def test_fast_path_off_writes_the_same_files(tmp_path, tokenizer_dirs, texts):
    """The fallback (HF itself) and the fast path write byte-identical datasets."""
    hf_tokenizer = _run_tokenizer("hf", tokenizer_dirs["qwen"])
    raw = _write_raw(tmp_path, texts, "parquet")
    outputs = []
    for fast in (True, False):
        prefix = preprocess_files(raw, str(tmp_path / f"fast{fast}" / "corpus"), ["text"], hf_tokenizer,
                                  append_eod=True, fast=fast, log=io.StringIO())["text"]
        outputs.append([open(prefix + ext, "rb").read() for ext in (".bin", ".idx")])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("object_kind", ["hf", "engine"])
def test_select_fast_path_finds_the_rust_tokenizer(tokenizer_dirs, texts, object_kind):
    """`select_fast_path` on either object: the `tokenizers.Tokenizer` is found, never the `.backend` string."""
    from tokenizers import Tokenizer

    tokenizer = _run_tokenizer(object_kind, tokenizer_dirs["qwen"])
    assert isinstance(rust_tokenizer(tokenizer), Tokenizer)
    fast, why = select_fast_path(tokenizer, texts)
    assert fast is not None, why
    hf = tokenizer if object_kind == "hf" else tokenizer.hf
    assert fast.tokenize_batch(texts) == [hf(text)["input_ids"] for text in texts]


def test_no_rust_tokenizer_falls_back_with_the_reason():
    """A tokenizer object with only a backend name (no `tokenizers.Tokenizer`) is declined, not crashed on."""
    class NamedBackendOnly:
        backend = "sentencepiece"

    assert rust_tokenizer(NamedBackendOnly()) is None
    fast, why = select_fast_path(NamedBackendOnly(), ["x"])
    assert fast is None and "NamedBackendOnly has no byte-level BPE fast path" in why
