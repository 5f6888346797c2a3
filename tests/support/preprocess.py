"""tools/preprocess_data.py against Megatron-LM's preprocessing: Megatron's algorithm run on megatron-core's builder
(`megatron_preprocess`), a byte comparison of the outputs, the tool run as a subprocess (`run_preprocess_tool`),
and module-scoped fixtures for a tokenizer directory and a corpus."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_models import stdlib_texts, train_bytelevel_tokenizer

mcore_ds = pytest.importorskip("megatron.core.datasets.indexed_dataset")


ROOT = Path(__file__).resolve().parents[2]


PREPROCESS_TOOL = ROOT / "tools" / "preprocess_data.py"


TOOL_ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def megatron_preprocess(lines, keys, tokenizer, append_eod, prefix, order=None, level="document"):
    """Megatron-LM's Encoder.encode + Partition.process_json_file, with megatron-core's builder."""
    dtype = mcore_ds.DType.optimal_dtype(tokenizer.vocab_size)
    builders = {k: mcore_ds.IndexedDatasetBuilder(f"{prefix}_{k}_{level}.bin", dtype=dtype) for k in keys}
    for i in order if order is not None else range(len(lines)):
        data = json.loads(lines[i])
        for key in keys:
            text = data[key]
            doc_ids, lens = [], []
            for sentence in text if isinstance(text, list) else [text]:
                ids = tokenizer.tokenize(sentence)
                if len(ids) > 0:
                    doc_ids.extend(ids)
                    lens.append(len(ids))
            if len(doc_ids) > 0 and append_eod:
                doc_ids.append(tokenizer.eod)
                lens[-1] += 1
            builders[key].add_document(doc_ids, lens)
    for key in keys:
        builders[key].finalize(f"{prefix}_{key}_{level}.idx")


def assert_same_files(ours_prefix, ref_prefix, keys, level="document"):
    for key in keys:
        for ext in (".bin", ".idx"):
            a = Path(f"{ours_prefix}_{key}_{level}{ext}").read_bytes()
            b = Path(f"{ref_prefix}_{key}_{level}{ext}").read_bytes()
            assert a == b, (key, ext)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_bytelevel_tokenizer(path, vocab_size=400)
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real text with the edge cases: empty docs, added tokens inside text, unicode, sentence lists."""
    texts = stdlib_texts(max_files=40, max_chars=3000)
    lines = []
    for i, text in enumerate(texts):
        title = ["first part. ", "", "sécond <|endoftext|> part"] if i % 7 == 0 else f"title {i} ünï <|pad|>"
        lines.append(json.dumps({"text": "" if i % 11 == 3 else text, "title": title, "n": i}) + "\n")
    path = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    path.write_text("".join(lines) + "\n")  # a trailing blank line is tolerated
    return path, lines


def run_preprocess_tool(*args):
    """tools/preprocess_data.py with `args`, as a subprocess; returns the CompletedProcess."""
    return subprocess.run([sys.executable, str(PREPROCESS_TOOL), *map(str, args)], capture_output=True, text=True,
                          env=TOOL_ENV, timeout=120)
