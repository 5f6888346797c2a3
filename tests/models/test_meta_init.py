"""Meta-device initialisation gives the weights of a normal initialisation, sharded over 2 gloo ranks
(FSDP 2, and TP 2 with FSDP 1).

References are independent: HF's own `initialize_weights` from the same seed (from scratch) and HF's
`from_pretrained` (loading), both on one unsharded model in this process.
"""
import os

import pytest
import torch

from fsdp2_backend.config import Config
from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_qwen3_config

SEED = 1234


def _full_state(model):
    from torch.distributed.tensor import DTensor

    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
             for k, v in model.state_dict().items()}
    state.update({f"buffer:{k}": b.detach().cpu().clone() for k, b in model.named_buffers()})
    return state


def _build(config):
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism

    ctx = ParallelContext.create(config.parallel)
    model = create_model(config.model, load_hf_config(config.model), seed=SEED, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(m, config, ctx))
    return ctx, model


def _worker(rank, world_size, model_dir, out_dir):
    for name, scratch, tp in (("scratch", True, 1), ("loaded", False, 1), ("scratch_tp2", True, 2)):
        config = Config()
        config.model.model_name_or_path = model_dir
        config.model.train_from_scratch = scratch
        config.model.init_model_with_meta_device = True
        config.parallel.param_dtype = "fp32"
        config.parallel.tp_size = tp
        ctx, model = _build(config)
        assert ctx.fsdp_mesh.size() == 2 // tp
        assert any(p.to_local().numel() < p.numel() for p in model.parameters()), "not sharded"
        state = _full_state(model)
        if rank == 0:
            torch.save(state, os.path.join(out_dir, f"{name}.pt"))


def _reference_scratch(model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(SEED)
    model.initialize_weights()
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(7)
    Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=250, num_hidden_layers=2)).save_pretrained(path)
    return str(path)


def test_meta_device_init_matches_normal_init_on_two_ranks(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run_distributed(_worker, 2, model_dir, str(tmp_path))
    references = {"scratch": _reference_scratch(model_dir),
                  "loaded": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)}
    references["scratch_tp2"] = references["scratch"]  # tensor-parallel shards hold the same weights
    for name, reference in references.items():
        got = torch.load(tmp_path / f"{name}.pt")
        want = {k: v for k, v in reference.state_dict().items()}
        want.update({f"buffer:{k}": b for k, b in reference.named_buffers()})
        assert set(got) == set(want), name
        for key, value in want.items():
            assert torch.equal(got[key], value), f"{name}: {key} differs"
    # The seeded init really is random, not the loaded weights.
    assert not torch.equal(references["scratch"].lm_head.weight, references["loaded"].lm_head.weight)


def test_normal_path_seeded_init_matches_hf(model_dir):
    from fsdp2_backend.models.loading import build_model, load_hf_config, seeded_initialize

    config = Config()
    config.model.model_name_or_path = model_dir
    model = build_model(config.model, load_hf_config(config.model), on_meta=False)
    seeded_initialize(model, SEED)
    want = _reference_scratch(model_dir).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key
