"""A model id is one `ModelSpec` (fsdp2_backend/models/<id>/spec.py) and one registry line: a toy id added by a spec
alone (`registry.register_spec`, no other file touched) is accepted by the config loader, validated, built and
trained at the layout its spec allows (TP 2 on 2 gloo ranks, against a 1-rank run of the same steps), and refused
with one `error:` line where its spec says no (a context-parallel kind it does not take). And no id is listed or
branched on in config/ or parallel/ outside the specs (the id tables there read the specs).
"""
import ast
import json
import os
from pathlib import Path

import pytest
import yaml

from fsdp2_backend.models.registry import model_spec, register_spec, registered_model_ids, specs
from fsdp2_backend.models.spec import ModelSpec
from tests.support.launchers import run_distributed


REPO = Path(__file__).resolve().parents[2]
TOY_ID = "toy_llama"
CONFIGURED = []  # (model class name, device type) per configure call, this process


def _build_toy(hf_config):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(hf_config)


def _configure_toy(model, config, device_type):
    CONFIGURED.append((type(model).__name__, device_type))


# Non-default declarations: tensor parallel yes, context parallel ring only (with its own reason), a note said.
TOY = ModelSpec(model_id=TOY_ID, hf_model_types=("llama",), build=_build_toy, configure=_configure_toy,
                cp_kinds=("ring",),
                notes={"cp": "parallel.cp_type: {cp_type} splits heads, which model_id {model_id} does not "
                             "declare — use ring"})
ARCHITECTURE = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128}


def _model_dir(tmp_path) -> str:
    """A seeded tiny Llama saved as an HF directory (both runs load the same weights)."""
    import torch

    path = tmp_path / "toy_model"
    if not path.exists():
        torch.manual_seed(11)
        _build_toy(_hf_config()).save_pretrained(path)
    return str(path)


def _yaml(tmp_path, **parallel) -> str:
    config = {"model": {"model_id": TOY_ID, "model_name_or_path": _model_dir(tmp_path),
                        "tokenizer_type": "NullTokenizer", "vocab_size": 127},  # + its end-of-document id
              "data": {"mock_data": True, "cutoff_len": 32, "data_manager_type": "mg"},
              "training": {"stage": "pt", "max_steps": 3, "per_device_train_batch_size": 2, "lr": 3e-3,
                           "seed": 7, "save_checkpoints": False, "output_dir": str(tmp_path / "out")},
              "parallel": {"param_dtype": "fp32", **parallel}}
    path = tmp_path / f"toy_{len(parallel)}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _load(path: str, world_size: int):
    from fsdp2_backend.launch import parse_command_line

    config, _ = parse_command_line([path], world_size)
    return config


def test_a_spec_alone_makes_an_id_the_loader_accepts_and_validation_reads(tmp_path):
    path = _yaml(tmp_path, tp_size=2, sequence_parallel=True)
    with pytest.raises(Exception, match="model_id"):  # not registered: the loader's choices lack it
        _load(path, 2)
    with register_spec(TOY):
        assert TOY_ID in registered_model_ids() and model_spec(TOY_ID) is TOY
        config = _load(path, 2)
        assert config.model.model_id == TOY_ID and config.parallel.tp_size == 2
        model = model_spec(TOY_ID).build(_hf_config())
        assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    assert TOY_ID not in registered_model_ids()


def _hf_config():
    from transformers import AutoConfig

    return AutoConfig.for_model(**ARCHITECTURE)


def test_a_layout_the_spec_declines_is_one_error_line(tmp_path, capsys, monkeypatch):
    from fsdp2_backend.launch import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = _yaml(tmp_path, cp_size=2, cp_type="ulysses")
    with register_spec(TOY), pytest.raises(SystemExit) as exit_:
        main([path, "--dry-run"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_.value.code == 2 and lines == ["error: parallel.cp_type: ulysses splits heads, which model_id toy_llama does "
                                   "not declare — use ring"], err
    with register_spec(TOY):  # ring, which the spec takes, validates
        assert _load(_yaml(tmp_path, cp_size=2, cp_type="ring"), 2).parallel.cp_type == "ring"


def _train(rank, world_size, path, out_dir):
    from fsdp2_backend.build import run_training

    with register_spec(TOY):
        config = _load(path, world_size)
        result = run_training(config)
    with open(os.path.join(out_dir, f"rank{rank}_of{world_size}.json"), "w") as handle:
        json.dump({"losses": result.losses, "configured": CONFIGURED}, handle)


def test_the_toy_id_trains_at_tp2_as_on_one_rank(tmp_path):
    run_distributed(_train, 1, _yaml(tmp_path), str(tmp_path))
    run_distributed(_train, 2, _yaml(tmp_path, tp_size=2, sequence_parallel=True), str(tmp_path))
    one = json.loads((tmp_path / "rank0_of1.json").read_text())
    two = [json.loads((tmp_path / f"rank{r}_of2.json").read_text()) for r in (0, 1)]
    assert len(one["losses"]) == 3 and one["losses"][-1] < one["losses"][0]  # it trains
    assert two[0]["losses"] == pytest.approx(one["losses"], rel=1e-4)  # TP 2 = 1 rank, step by step
    assert two[0]["configured"] == [["LlamaForCausalLM", "cpu"]]  # the spec's configure hook ran once a rank


def test_every_spec_names_code_that_exists():
    """Each registered spec's lazy hooks, MTP layout and context-parallel hook name a function or class that
    imports (a misspelt reference would fail only when a run reaches it)."""
    from fsdp2_backend.models.spec import resolve

    named = []
    for spec in specs():
        hooks = [getattr(spec, name) for name in ("build", "checkpoint_keys", "from_checkpoint", "configure",
                                                  "register_hf", "stored_layout")]
        named += [(spec.model_id, hook.reference) for hook in hooks if hook is not None]
        named += [(spec.model_id, spec.mtp_layout)] if spec.mtp_layout else []
        named += [(spec.model_id, f"fsdp2_backend.parallel.context_parallel.{spec.cp_hook}")] if spec.cp_hook else []
    assert len({model_id for model_id, _ in named}) == len(registered_model_ids())
    for model_id, reference in named:
        assert callable(resolve(reference)), (model_id, reference)


# Literals equal to an id's name that are not the id: (file, value) → what they are.
NOT_IDS = {("fsdp2_backend/config/mup_rules.py", "qwen3"): "an HF model type µP's name classes cover",
           ("fsdp2_backend/config/rules/data.py", "qwen3"): "a chat template's name (data.template)"}


def _id_literals(path: Path, ids) -> list:
    """Non-docstring string constants of `path` equal to a registered id."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    where = str(path.relative_to(REPO))
    return [f"{where}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in ids and id(node) not in docstrings
            and (where, node.value) not in NOT_IDS]


def test_no_id_is_listed_or_branched_on_outside_the_specs():
    """config/ and parallel/ read ids from the specs: no literal of a registered id (or another name of one) there.
    An id's own context-parallel hook (its spec's `cp_hook`) is the id's code and may name it."""
    ids = set(registered_model_ids()) | {name for spec in specs() for name in spec.aliases}
    hooks = {f"{spec.cp_hook.split(':')[0]}.py" for spec in specs() if spec.cp_hook}
    found = []
    for package in ("config", "parallel"):
        for path in sorted((REPO / "fsdp2_backend" / package).rglob("*.py")):
            if not (path.parent.name == "context_parallel" and path.name in hooks):
                found += _id_literals(path, ids)
    assert not found, "\n".join(found)
