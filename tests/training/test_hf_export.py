"""HF export of an FSDP2-sharded model, and the offline converter, checked with plain transformers.

Two ranks train a tied-embedding Qwen3 one step, export it (save_hf_weights: each rank writes a shard of
whole layers, with model.safetensors.index.json) and save a DCP checkpoint; the export must load with
`AutoModelForCausalLM.from_pretrained` and give the sharded model's logits; `tools/convert_checkpoint.py` run on
the checkpoint must write the same tensors and files (its shards split by size, not by rank).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_qwen3_config, train_bytelevel_tokenizer

REPO = Path(__file__).resolve().parents[2]


def _export_two_ranks(rank, world_size, root, tokenizer_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp2_backend.training.checkpoint import CheckpointManager
    from fsdp2_backend.checkpoint.hf_export import export_hf

    root = Path(root)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(tie_word_embeddings=True))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    export_hf(model, root / "hf", tokenizer)
    CheckpointManager(root / "ckpt").save(1, model, optimizer, tokenizer=tokenizer)
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    if rank == 0:
        torch.save({"batch": batch, "logits": logits}, root / "logits.pt")


def _tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def test_export_loads_in_transformers_and_converter_matches(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir = tmp_path / "tokenizer"
    train_bytelevel_tokenizer(tokenizer_dir, vocab_size=300, texts=["import os\nprint(os.sep)\n"] * 20)
    run_distributed(_export_two_ranks, 2, str(tmp_path), str(tokenizer_dir))

    exported = tmp_path / "hf"
    reference = torch.load(tmp_path / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    with torch.no_grad():
        logits = model(input_ids=reference["batch"]).logits
    assert torch.allclose(logits, reference["logits"], atol=1e-5, rtol=0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    assert tokenizer.encode("import os") == AutoTokenizer.from_pretrained(str(tokenizer_dir)).encode("import os")

    converted = tmp_path / "converted"
    result = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"),
                             str(tmp_path / "ckpt"), str(converted)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # each rank wrote a shard of whole layers, named and indexed as transformers names them; the converter (one
    # process, one shard under its size limit) writes the same tensors into one file
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    assert set(index["weight_map"]) == set(_tensors(exported))
    weight_files = ("model.safetensors", "model.safetensors.index.json")
    assert (sorted(p.name for p in converted.iterdir() if not p.name.startswith("model"))
            == sorted(p.name for p in exported.iterdir() if not p.name.startswith("model")))
    assert [p.name for p in converted.iterdir() if p.name.startswith("model")] == [weight_files[0]]
    ours, theirs = _tensors(exported), _tensors(converted)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((converted / name).read_text()) == json.loads((exported / name).read_text()), name
    for path in exported.iterdir():
        if not path.name.startswith("model") and path.name not in ("config.json", "generation_config.json"):
            assert (converted / path.name).read_bytes() == path.read_bytes(), path.name


def test_converter_bad_input_exits_2(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"),
                             str(tmp_path / "missing"), str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def test_export_never_replaces_a_directory_that_is_not_an_export(tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.usage_errors import UsageError
    from fsdp2_backend.checkpoint.hf_export import export_hf

    (tmp_path / "iter_0000010").mkdir()  # e.g. the output directory itself, holding checkpoints
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config())
    with pytest.raises(UsageError, match="holds directories"):
        export_hf(model, tmp_path)
    assert (tmp_path / "iter_0000010").is_dir()
    export_hf(model, tmp_path / "hf")
    export_hf(model, tmp_path / "hf")  # an earlier export is replaced
    assert (tmp_path / "hf" / "config.json").is_file() and not (tmp_path / "hf.tmp").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_moe_export_and_converter_write_per_expert_hf_layout(tmp_path):
    """The project's grouped-GEMM Qwen3-MoE keeps stacked experts in memory; both exports must write
    transformers' per-expert files, which plain transformers loads back to the same logits."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from fsdp2_backend.models.qwen3_moe.modeling import build_qwen3_moe
    from fsdp2_backend.training.checkpoint import CheckpointManager
    from fsdp2_backend.checkpoint.hf_export import convert_checkpoint, export_hf

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = build_qwen3_moe(config).eval()
    export_hf(model, tmp_path / "hf")
    CheckpointManager(tmp_path / "ckpt").save(1, model)
    convert_checkpoint(tmp_path / "ckpt", tmp_path / "converted")

    ours, theirs = _tensors(tmp_path / "hf"), _tensors(tmp_path / "converted")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in ours
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    batch = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "converted")).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=batch).logits, model(input_ids=batch).logits, atol=1e-6, rtol=0)

    # one shard at a time under a size limit (what a converting process holds): the same tensors, split into
    # files of whole layers (2 layers + the rest), with transformers' index
    convert_checkpoint(tmp_path / "ckpt", tmp_path / "shards", shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    sharded = _tensors(tmp_path / "shards")
    assert sharded.keys() == ours.keys() and all(torch.equal(sharded[k], ours[k]) for k in ours)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())

    convert_checkpoint(tmp_path / "ckpt", tmp_path / "bf16", dtype=torch.bfloat16)
    halved = _tensors(tmp_path / "bf16")
    assert all(halved[k].dtype == torch.bfloat16 and torch.equal(halved[k], ours[k].bfloat16()) for k in ours)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
