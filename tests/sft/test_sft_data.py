"""The SFT data path's datasets, formats, mixing, caching, packing and batches, on real files read by HF datasets
and a locally trained Qwen3-like tokenizer. Expected values are worked from the inputs here."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fsdp2_backend.config import Config, DataArguments, TrainingArguments
from fsdp2_backend.data.sft.collator import SFTCollator
from fsdp2_backend.data.sft.formats import DatasetAttr, convert_example
from fsdp2_backend.data.sft.loader import dataset_attrs
from fsdp2_backend.data.sft.pipeline import _load_or_build, prepare_datasets
from fsdp2_backend.data.sft.supervised import IGNORE_INDEX, greedy_knapsack, pack_examples
from fsdp2_backend.kernels.varlen import cu_seqlens_from_position_ids
from tests.support.sft_assets import alpaca_rows, qwen3_like_tokenizer, write_jsonl
from fsdp2_backend.usage_errors import UsageError


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return qwen3_like_tokenizer(tmp_path_factory.mktemp("tok"))


def _config(**data):
    data.setdefault("template", "qwen3")
    data.setdefault("cutoff_len", 256)
    return Config(data=DataArguments(**data), training=TrainingArguments(stage="sft", max_steps=1))


def _decode_rows(tokenizer, dataset):
    return [tokenizer.decode(row["input_ids"]) for row in dataset]


# --- formats -------------------------------------------------------------------------------------------------

def test_alpaca_with_history_system_and_input():
    row = {"instruction": "Sum", "input": "2 and 3", "output": "5", "system": "math",
           "history": [["hi", "hello"]]}
    ex = convert_example(row, DatasetAttr(name="a", file_name="-"))
    assert ex["system"] == "math"
    assert ex["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                              {"role": "user", "content": "Sum\n2 and 3"}, {"role": "assistant", "content": "5"}]


def test_sharegpt_roles_system_tools_and_malformed():
    attr = DatasetAttr(name="s", file_name="-", formatting="sharegpt")
    row = {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q"},
                             {"from": "function_call", "value": '{"name": "f", "arguments": {}}'},
                             {"from": "observation", "value": "r"}, {"from": "gpt", "value": "a"}],
           "tools": '[{"name": "f"}]'}
    ex = convert_example(row, attr)
    assert ex["system"] == "sys" and ex["tools"] == '[{"name": "f"}]'
    assert [m["role"] for m in ex["messages"]] == ["user", "function", "observation", "assistant"]
    assert convert_example({"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]},
                           attr) is None


# --- datasets: registry, files, mixing -------------------------------------------------------------------------

def test_dataset_info_by_name_and_every_file_type(tmp_path, tokenizer):
    rows = alpaca_rows(6)
    write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "c.parquet"))
    import csv
    with open(tmp_path / "d.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.makedirs(tmp_path / "dir")
    write_jsonl(tmp_path / "dir" / "part0.jsonl", rows[:3])
    write_jsonl(tmp_path / "dir" / "part1.jsonl", rows[3:])
    info = {name: {"file_name": file} for name, file in
            (("a", "a.jsonl"), ("b", "b.json"), ("c", "c.parquet"), ("d", "d.csv"), ("dir", "dir"))}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    texts = None
    for name in info:
        prepared = prepare_datasets(_config(dataset=name, dataset_dir=str(tmp_path)), tokenizer)
        decoded = _decode_rows(tokenizer, prepared["train"])
        texts = texts or decoded
        assert decoded == texts, name
    assert len(texts) == 6 and rows[0]["output"] in texts[0]


def test_dropped_malformed_rows_are_counted_once(tmp_path, tokenizer, capsys):
    good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    bad = {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]}  # out of turn
    write_jsonl(tmp_path / "s.jsonl", [good, bad, good, bad, good])
    spec = {"file_name": str(tmp_path / "s.jsonl"), "formatting": "sharegpt"}
    prepared = prepare_datasets(_config(dataset=spec), tokenizer)
    assert len(prepared["train"]) == 3
    lines = [line for line in capsys.readouterr().out.splitlines() if "rows dropped" in line]
    assert len(lines) == 1 and "2 of 5 rows dropped" in lines[0] and "sharegpt" in lines[0]
    # more than half malformed: refused (tests/sft/test_sft_bad_data.py has the messages)
    write_jsonl(tmp_path / "s.jsonl", [good, bad, good, bad, bad])
    with pytest.raises(UsageError, match="3 of 5 rows are not sharegpt conversations"):
        prepare_datasets(_config(dataset=spec), tokenizer)


def test_unknown_dataset_name_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="data.dataset: 'nope'"):
        dataset_attrs("nope", str(tmp_path))


def test_inline_columns_and_max_samples(tmp_path, tokenizer):
    rows = [{"q": f"question {i}", "a": f"answer {i}"} for i in range(10)]
    write_jsonl(tmp_path / "x.jsonl", rows)
    spec = {"file_name": str(tmp_path / "x.jsonl"), "formatting": "alpaca",
            "columns": {"prompt": "q", "response": "a"}}
    prepared = prepare_datasets(_config(dataset=spec, max_samples=4), tokenizer)
    decoded = _decode_rows(tokenizer, prepared["train"])
    assert len(decoded) == 4 and "question 3" in decoded[3] and "answer 3" in decoded[3]


def _two_sets(tmp_path, sizes=(6, 2)):
    a = write_jsonl(tmp_path / "a.jsonl", [{"instruction": f"A{i}", "output": f"a{i}"} for i in range(sizes[0])])
    b = write_jsonl(tmp_path / "b.jsonl", [{"instruction": f"B{i}", "output": f"b{i}"} for i in range(sizes[1])])
    return [{"file_name": a}, {"file_name": b}]


def _sources(tokenizer, dataset):
    return ["A" if "user\nA" in t else "B" for t in _decode_rows(tokenizer, dataset)]


def test_mix_strategies(tmp_path, tokenizer):
    specs = _two_sets(tmp_path)
    concat = prepare_datasets(_config(dataset=specs), tokenizer)["train"]
    assert _sources(tokenizer, concat) == ["A"] * 6 + ["B"] * 2
    under = prepare_datasets(_config(dataset=specs, mix_strategy="interleave_under"), tokenizer)["train"]
    assert _sources(tokenizer, under) == ["A", "B", "A", "B"]  # alternates, stops when B runs out
    over = prepare_datasets(_config(dataset=specs, mix_strategy="interleave_over"), tokenizer)["train"]
    assert _sources(tokenizer, over) == ["A", "B"] * 6  # alternates until A (the longer) is exhausted
    probs = prepare_datasets(_config(dataset=specs, mix_strategy="interleave_over", interleave_probs="0.9,0.1"),
                             tokenizer)["train"]
    src = _sources(tokenizer, probs)
    assert src.count("A") > src.count("B") and set(src) == {"A", "B"}


def test_val_size_and_eval_on_each_dataset(tmp_path, tokenizer):
    specs = _two_sets(tmp_path, (10, 10))
    merged = prepare_datasets(_config(dataset=specs, val_size=0.2), tokenizer)
    assert len(merged["train"]) == 16 and len(merged["eval:eval"]) == 4
    each = prepare_datasets(_config(dataset=specs, val_size=2, eval_on_each_dataset=True), tokenizer)
    assert len(each["train"]) == 16 and sorted(k for k in each if k.startswith("eval:")) == ["eval:a.jsonl",
                                                                                          "eval:b.jsonl"]
    assert set(_sources(tokenizer, each["eval:a.jsonl"])) == {"A"}
    assert set(_sources(tokenizer, each["eval:b.jsonl"])) == {"B"}
    ev = prepare_datasets(_config(dataset=specs[0], eval_dataset=specs[1]), tokenizer)
    assert len(ev["train"]) == 10 and set(_sources(tokenizer, ev["eval:eval"])) == {"B"}


def test_tokenized_path_saves_arrow_loads_and_overwrite_rebuilds(tmp_path, tokenizer):
    spec = _two_sets(tmp_path)[0]
    path = str(tmp_path / "tok")
    first = _load_or_build(_config(dataset=spec, tokenized_path=path), tokenizer)
    files = [f for _, _, fs in os.walk(path) for f in fs]
    assert any(f.endswith(".arrow") for f in files) and not any(f.endswith((".pkl", ".pickle")) for f in files)
    # the cache wins over the source: change the source, the saved result is loaded
    write_jsonl(spec["file_name"], [{"instruction": "Z", "output": "z"}])
    again = _load_or_build(_config(dataset=spec, tokenized_path=path), tokenizer)
    assert _decode_rows(tokenizer, again["train"]) == _decode_rows(tokenizer, first["train"])
    rebuilt = _load_or_build(_config(dataset=spec, tokenized_path=path, overwrite_cache=True), tokenizer)
    assert len(rebuilt["train"]) == 1 and "user\nZ" in _decode_rows(tokenizer, rebuilt["train"])[0]


def test_streaming_reads_the_same_examples(tmp_path, tokenizer):
    spec = _two_sets(tmp_path)[0]
    eager = _decode_rows(tokenizer, prepare_datasets(_config(dataset=spec), tokenizer)["train"])
    config = _config(dataset=spec, streaming=True, buffer_size=4)
    streamed = prepare_datasets(config, tokenizer)["train"]
    assert sorted(_decode_rows(tokenizer, streamed)) == sorted(eager)


# --- packing and batches -------------------------------------------------------------------------------------

def test_greedy_knapsack_fills_with_the_largest_that_fits():
    assert greedy_knapsack([5, 3, 8, 2, 7], 10) == [[8, 2], [7, 3], [5]]


def test_packing_and_neat_batches(tokenizer):
    ids = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    labels = [[IGNORE_INDEX, 2, 3], [IGNORE_INDEX, 5], [IGNORE_INDEX, IGNORE_INDEX, 8, 9]]
    packed = pack_examples(ids, labels, 6)
    assert packed["doc_lens"] == [[4, 2], [3]]
    rows = [{k: packed[k][i] for k in packed} for i in range(2)]
    neat = SFTCollator(pad_id=0, neat_packing=True)(rows)
    assert neat["tokens"].tolist() == [[6, 7, 8, 9, 4, 5], [1, 2, 3, 0, 0, 0]]
    # labels shifted within each packed example: the last token of an example predicts nothing
    assert neat["labels"].tolist() == [[0, 8, 9, 0, 5, 0], [2, 3, 0, 0, 0, 0]]
    assert neat["loss_mask"].tolist() == [[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0]]
    assert neat["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    cu, _ = cu_seqlens_from_position_ids(neat["position_ids"])
    assert cu.tolist() == [0, 4, 6, 9, 12]
    plain = SFTCollator(pad_id=0, neat_packing=False, pad_multiple=4)(rows)
    assert plain["position_ids"].tolist() == [list(range(8))] * 2 and plain["tokens"].shape == (2, 8)


def test_ignore_pad_token_for_loss_false_trains_padding():
    rows = [{"input_ids": [1, 2], "labels": [1, 2], "doc_lens": [2]},
            {"input_ids": [3, 4, 5, 6], "labels": [3, 4, 5, 6], "doc_lens": [4]}]
    batch = SFTCollator(pad_id=9, neat_packing=False, ignore_pad_token_for_loss=False)(rows)
    assert batch["labels"][0].tolist() == [2, 9, 9, 0] and batch["loss_mask"][0].tolist() == [1, 1, 1, 0]
    batch = SFTCollator(pad_id=9, neat_packing=False)(rows)
    assert batch["loss_mask"][0].tolist() == [1, 0, 0, 0]


def test_rebuild_with_more_workers_splits_into_that_many_shards(tmp_path, tokenizer):
    """datasets keeps the shard count of an earlier run's cache files under the same fingerprint even when told to
    rebuild: a 2-worker rebuild after a 1-worker run ran as one shard in one worker. Its own record of the shards
    (one cache file each) tells; the rows are the same at either count."""
    path = write_jsonl(tmp_path / "a.jsonl", alpaca_rows(40))
    runs = {}
    for workers in (1, 2, 1, 2):
        config = _config(dataset={"file_name": path}, preprocessing_num_workers=workers, overwrite_cache=True,
                         preprocessing_batch_size=8)
        train = prepare_datasets(config, tokenizer)["train"]
        assert len(train.cache_files) == workers, (workers, train.cache_files)
        runs.setdefault(workers, _decode_rows(tokenizer, train))
    assert runs[2] == runs[1] and len(runs[1]) == 40
