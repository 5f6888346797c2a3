"""build_pretrain_data: Megatron's sample counts, batches equal to megatron-core's datasets read in Megatron's
sampler order, raw .jsonl preprocessing (reuse, overwrite, rank 0 then the others), and the data options."""
from __future__ import annotations

import json
import os

import numpy
import pytest
import torch

from fsdp2_backend.config import Config
from fsdp2_backend.data.pretrain import build_pretrain_data, data_iterator, pretrain_sample_counts
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.data.tokenizer import NullTokenizer
from tests.support.launchers import run_distributed
from tests.support.megatron_reference import IdsTokenizer, write_corpus

SEQ = 16


def _config(tmp_path, **data):
    config = Config()
    config.training.seed = 1234
    config.training.eval_interval = 5
    config.training.eval_iters = 2
    config.data.cutoff_len = SEQ
    config.data.data_cache_path = str(tmp_path / "cache")
    for key, value in data.items():
        setattr(config.data, key, value)
    return config


def _write_jsonl(path, num_docs=150, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(num_docs):
            n = int(torch.randint(1, 40, (1,), generator=g))
            f.write(json.dumps({"text": " ".join(str(int(t)) for t in torch.randint(0, vocab, (n,), generator=g))})
                    + "\n")
    return str(path)


def test_sample_counts_follow_megatron():
    assert pretrain_sample_counts(100, 32, None, 10, 5) == (3200, (100 // 10 + 1) * 5 * 32, 160)
    assert pretrain_sample_counts(100, 32, 5000, None, 5) == (5000, 0, 160)


def test_batches_equal_megatron_core_in_sampler_order(tmp_path):
    mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    prefixes = [write_corpus(str(tmp_path / f"c{i}" / "text_document"), 300, seed=i) for i in range(2)]
    tokenizer = IdsTokenizer()
    config = _config(tmp_path, dataset=f"0.3 {prefixes[0]} 0.7 {prefixes[1]}", split="90,8,2", eod_mask_loss=True)
    gbs, mbs, iters, consumed = 8, 2, 20, 24
    data = build_pretrain_data(config, tokenizer, dp_rank=1, dp_size=2, consumed_samples=consumed,
                               global_batch_size=gbs, micro_batch_size=mbs, train_iters=iters)
    assert data.sample_counts == (160, (20 // 5 + 1) * 2 * 8, 16)
    ref = BlendedMegatronDatasetBuilder(mcore.GPTDataset, list(data.sample_counts), lambda: True, mcore.GPTDatasetConfig(
        random_seed=1234, sequence_length=SEQ, blend=([prefixes[0], prefixes[1]], [0.3, 0.7]), split="90,8,2",
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=True,
        create_attention_mask=False)).build()
    for k, batch in zip(range(6), data.train_loader):
        first = consumed + k * mbs * 2 + 1 * mbs  # rank 1's slice of the k-th micro-step
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            expected = torch.stack([ref[0][i][key] for i in range(first, first + mbs)])
            assert torch.equal(batch[key], expected), (k, key)
    valid = next(data_iterator(data.valid_loader, "single"))
    assert torch.equal(valid["tokens"], torch.stack([ref[1][i]["tokens"] for i in (2, 3)]))
    assert "attention_mask" not in valid


def test_options_mock_max_samples_mask_cyclic(tmp_path):
    config = _config(tmp_path, mock_data=True, max_samples=12, create_attention_mask_in_dataloader=True,
                     dataloader_type="cyclic")
    config.training.eval_interval = None
    data = build_pretrain_data(config, IdsTokenizer(vocab_size=300), 0, 1, 0, 4, 4, 10)
    assert len(data.datasets[0]) == 12 and data.valid_loader is None
    batches = list(zip(range(5), data_iterator(data.train_loader, "cyclic")))  # 3 per epoch: wraps around
    assert len(batches) == 5 and batches[0][1]["attention_mask"].shape == (4, 1, SEQ, SEQ)
    assert sorted(batches[0][1]["tokens"].flatten().tolist()) != sorted(batches[3][1]["tokens"].flatten().tolist())


def test_raw_jsonl_is_tokenized_once_and_reused(tmp_path):
    raw = _write_jsonl(tmp_path / "corpus.jsonl")
    tokenizer = NullTokenizer(1000)
    config = _config(tmp_path, dataset=raw, append_eod=True, tokenized_path=str(tmp_path / "tok"))
    data = build_pretrain_data(config, tokenizer, 0, 1, 0, 4, 2, 10)
    bin_path = tmp_path / "tok" / "corpus_text_document.bin"
    assert bin_path.is_file() and len(data.datasets[0]) >= 40
    first_tokens = next(iter(data.train_loader))["tokens"]
    os.utime(bin_path, (1, 1))
    build_pretrain_data(config, tokenizer, 0, 1, 0, 4, 2, 10)
    assert os.stat(bin_path).st_mtime == 1  # reused
    config.data.overwrite_cache = True
    again = build_pretrain_data(config, tokenizer, 0, 1, 0, 4, 2, 10)
    assert os.stat(bin_path).st_mtime != 1 and torch.equal(next(iter(again.train_loader))["tokens"], first_tokens)


def test_bad_inputs_have_clear_errors(tmp_path):
    # (reset_attention_mask without append_eod is validation's rule: tests/config/test_config.py)
    with pytest.raises(UsageError, match="nothing.bin/.idx not found"):
        build_pretrain_data(_config(tmp_path, dataset=str(tmp_path / "nothing")), IdsTokenizer(), 0, 1, 0, 4, 2, 10)
    prefix = write_corpus(str(tmp_path / "small" / "text_document"), 40, seed=3)
    with pytest.raises(UsageError, match="test split has 0 documents"):
        build_pretrain_data(_config(tmp_path, dataset=prefix, split="969,30,1"), IdsTokenizer(), 0, 1, 0, 4, 2, 10)


def _rank_batches(rank, world_size, tmp, raw, out):
    config = _config_at(tmp, raw)
    data = build_pretrain_data(config, NullTokenizer(1000), rank, world_size, 0, 8, 2, 6)
    batches = [b["tokens"] for _, b in zip(range(8 // world_size), data.train_loader)]
    config.data.split = "969,30,1"  # too little data for a test split: rank 0 fails, rank 1 must not hang
    try:
        build_pretrain_data(config, NullTokenizer(1000), rank, world_size, 0, 8, 2, 6)
        message = "no error"
    except UsageError as exc:
        message = str(exc)
    # Two "nodes" without shared storage: each rank is its node's local rank 0 with a node-local cache folder.
    os.environ["LOCAL_RANK"] = "0"
    config = _config_at(tmp, raw)
    config.data.no_shared_storage, config.data.mock_data = True, True
    config.data.data_cache_path = os.path.join(tmp, f"node{rank}")
    build_pretrain_data(config, NullTokenizer(1000), rank, world_size, 0, 8, 2, 6)
    torch.save((batches, message), f"{out}.{rank}")


def _config_at(tmp, raw):
    import pathlib

    return _config(pathlib.Path(tmp), dataset=raw, append_eod=True, tokenized_path=os.path.join(tmp, "tok"),
                   split="98,2,0")


def test_two_ranks_preprocess_once_and_share_the_global_batch(tmp_path):
    raw = _write_jsonl(tmp_path / "corpus.jsonl", num_docs=300)
    run_distributed(_rank_batches, 2, str(tmp_path), raw, str(tmp_path / "two"))
    two, messages = zip(*[torch.load(tmp_path / f"two.{r}") for r in range(2)])
    assert "test split has 0 documents" in messages[0] and "failed on another rank" in messages[1]
    single = build_pretrain_data(_config_at(str(tmp_path), raw), NullTokenizer(1000), 0, 1, 0, 8, 2, 6)
    one = [b["tokens"] for _, b in zip(range(4), single.train_loader)]
    # Iteration 0 = micro-steps 0, 1: at DP 2 each rank's two micro-batches, at DP 1 four in a row.
    two_rows = torch.cat([two[0][0], two[1][0], two[0][1], two[1][1]])
    assert torch.equal(two_rows, torch.cat(one))
    assert len(list((tmp_path / "tok").glob("*.bin"))) == 1
    assert all(len(list((tmp_path / f"node{r}").glob("*.npy"))) == 9 for r in range(2))  # 3 arrays x 3 splits


@pytest.mark.parametrize("dataloader_type", ["single", "cyclic"])
def test_disable_shuffling_reads_the_documents_in_order(tmp_path, dataloader_type):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MIndexedDataset

    prefix = write_corpus(str(tmp_path / "c" / "text_document"), 200, seed=5)
    config = _config(tmp_path, dataset=prefix, split="100,0,0", dataloader_type=dataloader_type)
    config.training.eval_interval = None
    config.training.disable_shuffling = True
    data = build_pretrain_data(config, IdsTokenizer(), 0, 1, 0, 4, 2, 10)
    reader = MIndexedDataset(prefix)  # independent reader: the documents concatenated in file order
    stream = torch.from_numpy(numpy.concatenate([reader[d] for d in range(200)]).astype(numpy.int64))
    rows = torch.cat([b["tokens"] for _, b in zip(range(3), data.train_loader)])
    assert torch.equal(rows, torch.stack([stream[i * SEQ:(i + 1) * SEQ] for i in range(6)]))


@pytest.mark.parametrize("drop_last", [False, True])
def test_dataloader_drop_last_applies_to_validation_not_training(tmp_path, drop_last):
    config = _config(tmp_path, mock_data=True, max_samples=13)  # 13 samples: not a multiple of mbs x dp = 4
    config.training.dataloader_drop_last = drop_last
    data = build_pretrain_data(config, IdsTokenizer(vocab_size=300), 0, 2, 0, 4, 2, 10)  # rank 0 of dp 2
    valid = list(data.valid_loader)
    assert [len(b["tokens"]) for b in valid] == [2, 2, 2] + ([] if drop_last else [1])
    if not drop_last:  # the last partial group [12] goes to rank 0
        assert torch.equal(valid[-1]["tokens"][0], data.datasets[1][12]["tokens"])
    assert [len(b["tokens"]) for b in data.train_loader] == [2, 2, 2]  # training always drops it


def test_reset_attention_mask_alone_gives_megatrons_per_document_result(tmp_path):
    """--reset-attention-mask without --reset-position-ids: Megatron masks attention per document and keeps the
    positions running. The batch here carries the documents as restarting positions (the one packed
    representation); for a rotary model its logits equal megatron-core's mask and positions fed to the model
    (the mask from megatron-core's own GPTDataset). Before, the flag was accepted and had no effect at all."""
    mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from transformers import LlamaConfig, LlamaForCausalLM

    prefix = write_corpus(str(tmp_path / "c" / "text_document"), 200, seed=5, max_len=12, vocab_size=128)
    tokenizer = IdsTokenizer(vocab_size=128)
    config = _config(tmp_path, dataset=prefix, split="100,0,0", reset_attention_mask=True, append_eod=True)
    config.training.eval_interval = None
    data = build_pretrain_data(config, tokenizer, 0, 1, 0, 2, 2, 3)
    ref = BlendedMegatronDatasetBuilder(mcore.GPTDataset, list(data.sample_counts), lambda: True, mcore.GPTDatasetConfig(
        random_seed=1234, sequence_length=SEQ, blend=([prefix], None), split="100,0,0", tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=True, eod_mask_loss=False, create_attention_mask=True)).build()
    batch = next(iter(data.train_loader))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model.config._attn_implementation = "sdpa"
    documents_seen = 0
    for row in range(2):
        sample = ref[0][row]
        assert torch.equal(batch["tokens"][row], sample["tokens"])
        assert torch.equal(sample["position_ids"], torch.arange(SEQ))  # Megatron's positions run on
        starts = int((batch["position_ids"][row] == 0).sum())
        documents_seen += starts
        allowed = ~sample["attention_mask"][0]  # True = masked in Megatron's mask
        additive = torch.zeros(SEQ, SEQ).masked_fill(~allowed, float("-inf"))[None, None]
        with torch.no_grad():
            want = model(input_ids=sample["tokens"][None], position_ids=sample["position_ids"][None],
                         attention_mask=additive).logits
            # as the trainer calls it (no cache: transformers then reads documents from restarting positions)
            got = model(input_ids=batch["tokens"][row][None], position_ids=batch["position_ids"][row][None],
                        use_cache=False).logits
            plain = model(input_ids=batch["tokens"][row][None], use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if starts > 1:  # attention across documents differs: the mask matters here
            assert (plain - want).abs().max() > 1e-3
    assert documents_seen > 2
