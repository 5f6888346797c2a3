"""MindSpeed-LLM's launchers and YAMLs as test cases: the verbatim copies under tests/data/mindspeed_fsdp2/ (`DATA`,
one folder per commit, `FALLBACK`), the launchers in scope mapped to their YAML (`LAUNCHERS`, `MAPPED`), the
published config.json of the real models they name (`REAL_MODELS`), a YAML's paths replaced by local ones
(`with_paths`), and the module-scoped `assets` fixture (tokenizer, parquet data, model directories)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.tiny_models import tiny_model_dir, train_bytelevel_tokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "mindspeed_fsdp2"


COMMITS = ("f88dd26d", "head", "v26.1.0")  # v26.1.0: the release (branch and tag 26.1.0), besides master


# Published Hugging Face config.json values of the models the launchers name, written as the hub's files are
# (transformers 4.51 keys: num_experts, rope_theta), not re-serialised by the installed transformers.
QWEN3_DENSE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
                   attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, head_dim=128, hidden_act="silu",
                   initializer_range=0.02, max_position_embeddings=40960, rms_norm_eps=1e-06, rope_scaling=None,
                   rope_theta=1000000, sliding_window=None, torch_dtype="bfloat16", transformers_version="4.51.0",
                   use_cache=True, use_sliding_window=False, vocab_size=151936)
QWEN3_MOE = dict(QWEN3_DENSE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1,
                 mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False, router_aux_loss_coef=0.001,
                 tie_word_embeddings=False)
REAL_MODELS = {
    "Qwen3-1.7B": dict(QWEN3_DENSE, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       max_window_layers=28, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-8B": dict(QWEN3_DENSE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     max_window_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen3-14B": dict(QWEN3_DENSE, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      max_window_layers=40, num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen3-32B": dict(QWEN3_DENSE, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      max_window_layers=64, num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen3-30B-A3B": dict(QWEN3_MOE, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          max_window_layers=48, num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768),
    "Qwen3-235B-A22B": dict(QWEN3_MOE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                            max_window_layers=94, num_attention_heads=64, num_key_value_heads=4, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=1536),
}
# MindSpeed's CI runs a 2-layer cut of Qwen3-30B-A3B (/data/ci/models/Qwen3-30B-A3B/hf/Qwen3-30B-A3B-layer2/).
REAL_MODELS["Qwen3-30B-A3B-layer2"] = dict(REAL_MODELS["Qwen3-30B-A3B"], num_hidden_layers=2, max_window_layers=2)


# Fields holding a path on the user's machine: (group, field).
PATH_FIELDS = (("model", "model_name_or_path"), ("model", "tokenizer_name_or_path"), ("data", "dataset"),
               ("training", "output_dir"))


def in_scope(name: str) -> bool:
    name = name.lower()
    return (("qwen3_" in name or "qwen3-30b" in name) and "qwen3_next" not in name and "qwen3-next" not in name
            and ("pretrain" in name or "tune_" in name))


# Where a commit's unchanged files are copied: head's and the release's files that are not in their folder are
# f88dd26d's (byte for byte: checked against the release branch's files).
FALLBACK = {"f88dd26d": ("f88dd26d",), "head": ("head", "f88dd26d"), "v26.1.0": ("v26.1.0", "f88dd26d")}


def yaml_file_at(commit: str, repo_path: str):
    """The copied YAML a launcher runs: its commit's copy, else the same file of the next folder (FALLBACK);
    None when none has it."""
    name = repo_path[2:] if repo_path.startswith("./") else repo_path
    name = name.replace("/", "__")
    for where in FALLBACK[commit]:
        if (DATA / where / name).is_file():
            return DATA / where / name
    return None


def _launchers():
    """(commit, launcher, entry, yaml file or None) for every launcher in scope."""
    table = json.loads((DATA / "launchers.json").read_text())
    out = []
    for commit in COMMITS:
        for launcher, entry in sorted(table[commit].items()):
            if in_scope(launcher) or in_scope(entry["yaml"]):
                out.append((commit, launcher, entry, yaml_file_at(commit, entry["yaml"])))
    return out


LAUNCHERS = _launchers()


MAPPED = [case for case in LAUNCHERS if case[3] is not None]


def real_model_name(yaml_name: str) -> str:
    """The model a YAML is written for, from its file name."""
    name = yaml_name.lower()
    if "qwen3-30b" in name and "tests__pipeline" in name:
        return "Qwen3-30B-A3B-layer2"
    for key, model in (("235b", "Qwen3-235B-A22B"), ("30b", "Qwen3-30B-A3B"), ("32b", "Qwen3-32B"),
                       ("14b", "Qwen3-14B"), ("8b", "Qwen3-8B"), ("1point7b", "Qwen3-1.7B"), ("1p7b", "Qwen3-1.7B")):
        if key in name:
            return model
    raise AssertionError(f"no model known for {yaml_name}")


def with_paths(yaml_file: Path, args, paths):
    """The launcher's arguments with each path replaced where the launcher gives it, and the paths the YAML
    itself holds overridden after them (as a user pointing the files at their own machine would)."""
    args = list(args)
    in_yaml = yaml.safe_load(yaml_file.read_text(encoding="utf-8")) or {}
    for (group, field), value in zip(PATH_FIELDS, paths):
        flag = f"--{group}.{field}"
        if flag in args:
            args[args.index(flag) + 1] = value
        elif field in (in_yaml.get(group) or {}):
            args += [flag, value]
    return args


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny tokenizer, a parquet file of raw text ("text" column, like the alpaca parquet's) and lazily built
    model directories: `real(name)` (the real model's config.json + the tokenizer) and `tiny(family)`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fsdp2_backend.cli.demo_assets import stdlib_texts

    root = tmp_path_factory.mktemp("mindspeed_assets")
    parquet = root / "train-00000-of-00001.parquet"
    pq.write_table(pa.table({"text": stdlib_texts(max_files=64, max_chars=2000)}), str(parquet))
    tokenizer = train_bytelevel_tokenizer(root / "tokenizer", vocab_size=300)
    built = {}

    def real(name):
        if name not in built:
            path = root / name
            path.mkdir()
            (path / "config.json").write_text(json.dumps(REAL_MODELS[name], indent=2) + "\n")
            tokenizer.save_pretrained(str(path))
            built[name] = str(path)
        return built[name]

    def tiny(family):
        key = f"tiny-{family}"
        if key not in built:
            path = root / key
            if family == "qwen3":
                tiny_model_dir(path, seed=0, vocab_size=300)
            else:
                tiny_qwen3_moe_dir(path, seed=0, vocab_size=300)
            built[key] = str(path)
        return built[key]

    return {"root": root, "parquet": str(parquet), "real": real, "tiny": tiny}


def tiny_qwen3_moe_dir(path, seed: int, vocab_size: int = 300) -> str:
    """An HF directory holding a locally trained tokenizer and a seeded tiny Qwen3-MoE (4 experts, top 2)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    tokenizer = train_bytelevel_tokenizer(path, vocab_size=vocab_size)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                            mlp_only_layers=[], norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                            tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return str(path)


def merge_like_mindspeed(src: Path, dst: Path, fuse_dim: str) -> None:
    """Per-expert `model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight` → merged `experts.gate_up_proj` /
    `experts.down_proj`, as the script's fuse_layer does; everything else copied."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    tensors = per_expert(tensors)
    expert = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    layers, out = {}, {}
    for key, value in tensors.items():
        m = expert.match(key)
        if m:
            layers.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), {})[m.group(3)] = value
        else:
            out[key] = value
    assert layers, "the source holds no per-expert keys"
    for layer, experts in layers.items():
        n = max(experts) + 1
        gate = torch.stack([experts[e]["gate_proj"] for e in range(n)])
        up = torch.stack([experts[e]["up_proj"] for e in range(n)])
        down = torch.stack([experts[e]["down_proj"] for e in range(n)])
        gate_up, down = torch.cat([gate, up], dim=1).transpose(1, 2), down.transpose(1, 2)
        if fuse_dim == "2d":
            gate_up, down = gate_up.reshape(-1, gate_up.shape[-1]), down.reshape(-1, down.shape[-1])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up.contiguous().clone()
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = down.contiguous().clone()
    save_file(out, str(dst / "model-00001-of-00001.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {key: "model-00001-of-00001.safetensors" for key in out}}))


def per_expert(tensors):
    """The HF LongCat checkpoint's per-expert keys (what the script reads) from the stacked tensors transformers'
    save writes for this tiny model (`gate_up_proj` [E, 2I, H]: each expert's gate rows, then its up rows)."""
    out = {}
    for key, value in tensors.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base, inter = key[:-len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = value[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = value[e, inter:]
        elif key.endswith("mlp.experts.down_proj"):
            for e in range(value.shape[0]):
                out[f"{key[:-len('down_proj')]}{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out
