"""`optimization.torch_compile` (each decoder block compiled once, parallel/compile.py) trains as eager does, in every
layout: the same layout run eager and compiled gives the same lm losses and gradient norms per step within 1e-5
relative (fp32), on 1 rank and on 2 gloo ranks for FSDP2, TP + sequence parallel, CP (Ulysses, ring), recompute
(full and selective), EP with grouped experts, float8 (tensorwise) linears and MTP. Inductor's CPU backend compiles
here (a C++ compiler is on the machine), so this runs the real compiled kernels; HSDP (2 replicas x FSDP 2) on 4
ranks.

Compiling costs tens of seconds on CPU, so the layouts share one 2-rank launch (the FX graph cache is shared by
the runs of one process) and each run is 3 steps. The eager run of each layout is the reference; that compiling
happened at all is checked too (the blocks carry a compiled call and dynamo counted graphs), so a silently
eager "compiled" run cannot pass.
"""
import functools
import json

import pytest
import torch
import torch.distributed as dist

from fsdp2_backend.config import Config
from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_qwen3_config
from tests.support.trainer_parity import ConstantLR, masked_samples, rank_micro_batches

STEPS, SEQ, MBS, GBS, VOCAB = 3, 32, 2, 4, 512
LAYOUTS = {  # name: (model, parallel fields)
    "fsdp2": ("dense", dict(fsdp_size=2)),
    "tp2_sp": ("dense", dict(tp_size=2, sequence_parallel=True)),
    "cp2_ulysses": ("dense", dict(cp_size=2, cp_type="ulysses")),
    "cp2_ring": ("dense", dict(cp_size=2, cp_type="ring")),
    "recompute_full": ("dense", dict(fsdp_size=2, recompute=True)),
    "recompute_selective": ("dense", dict(fsdp_size=2, recompute=True, recompute_modules=["*.self_attn"])),
    "ep2": ("moe", dict(ep_size=2)),
    # (model, parallel fields, model fields): float8 linears (scaled matmul inside the compiled block) and MTP (its
    # loss attached to the logits the compiled loss head writes its gradient over)
    "float8_fsdp2": ("dense", dict(fsdp_size=2), dict(quant_recipe_name="tensorwise",
                                                     quant_converters=["quantize.linear.float8"])),
    "mtp_fsdp2": ("dense", dict(fsdp_size=2), dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)),
}
FOUR_RANK_LAYOUTS = {"hsdp_2x2": ("dense", dict(fsdp_size=2))}  # 2 replicas of a 2-rank FSDP group




def _compiled(block):
    """The block's call is compiled, or (recomputed whole) the forward its checkpoint runs is."""
    forward = block.__dict__.get("forward")
    inner = forward.args[0] if isinstance(forward, functools.partial) else None
    return block._compiled_call_impl is not None or hasattr(inner, "_torchdynamo_orig_callable")


def _train(model_dir, compiled, model_id=None, model_fields=None, **parallel):
    from torch._dynamo.utils import counters

    from fsdp2_backend.build import TrainJob, _with_mtp
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism
    from fsdp2_backend.parallel.compile import decoder_blocks
    from fsdp2_backend.training.trainer import Trainer

    gbs = GBS * max(1, dist.get_world_size() // 2) if dist.is_initialized() else GBS  # a micro-batch per dp rank
    config = Config()
    config.model.model_name_or_path = model_dir
    config.model.model_id = model_id
    config.parallel.param_dtype = "fp32"
    config.training.per_device_train_batch_size = MBS
    config.training.max_grad_norm = 0.5
    config.optimization.torch_compile = compiled
    if model_id:
        config.optimization.moe_grouped_gemm = True
    for name, value in parallel.items():
        setattr(config.parallel, name, value)
    for name, value in (model_fields or {}).items():
        setattr(config.model, name, value)
    ctx = ParallelContext.create(config.parallel)
    # each layout starts as its own process would: dynamo's per-frame caches empty (the runs of one process share
    # transformers' layer wrapper, whose cache would otherwise fill up with every layout's variant); inductor's FX
    # graph cache is kept, so identical graphs are not compiled twice
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(*_with_mtp(m, config), ctx))
    blocks = decoder_blocks(model)
    assert blocks and all(_compiled(b) == compiled for _, b in blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    trainer = Trainer(TrainJob(config=config, ctx=ctx, model=model, optimizer=optimizer, scheduler=ConstantLR(),
                               train_batches=rank_micro_batches(masked_samples(gbs * STEPS, SEQ, seed=17), ctx.dp_size,
                                                                ctx.dp_rank, MBS),
                               train_iters=STEPS, micro_batches=gbs // (MBS * ctx.dp_size)))
    result = trainer.train()
    ctx.close()
    return {"losses": result.losses, "grad_norms": result.grad_norms,
            "graphs": counters["stats"]["unique_graphs"] - graphs_before}


def _worker(rank, world_size, dirs, layouts, out_path):
    results = {}
    for name in layouts:
        kind, parallel, *model_fields = {**LAYOUTS, **FOUR_RANK_LAYOUTS}[name] if world_size > 1 else ("dense", {})
        model_id = "qwen3_moe" if kind == "moe" else None
        results[name] = {mode: _train(dirs[kind], mode == "compiled", model_id, *model_fields, **parallel)
                         for mode in ("eager", "compiled")}
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(results, handle)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    from tests.support.tiny_models import tiny_moe_config

    dense, moe = tmp_path_factory.mktemp("dense"), tmp_path_factory.mktemp("moe")
    torch.manual_seed(5)
    Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=VOCAB)).save_pretrained(dense)
    Qwen3MoeForCausalLM(tiny_moe_config()).save_pretrained(moe)
    return {"dense": str(dense), "moe": str(moe)}


def _assert_same(results):
    for name, runs in results.items():
        eager, compiled = runs["eager"], runs["compiled"]
        assert eager["graphs"] == 0 and compiled["graphs"] > 0, (name, eager["graphs"], compiled["graphs"])
        for key in ("losses", "grad_norms"):
            assert len(eager[key]) == len(compiled[key]) == STEPS
            for step, (x, y) in enumerate(zip(eager[key], compiled[key])):
                assert abs(x - y) <= 1e-5 * abs(x), f"{name} {key} step {step}: eager {x} vs compiled {y}"


def test_compiled_blocks_train_as_eager_on_one_rank(model_dirs, tmp_path):
    out = tmp_path / "one.json"
    _worker(0, 1, model_dirs, ["one_rank"], str(out))
    _assert_same(json.loads(out.read_text()))


@pytest.mark.parametrize("ranks", [2, 4])  # 4: HSDP
def test_compiled_blocks_train_as_eager_in_every_multi_rank_layout(model_dirs, tmp_path, ranks):
    layouts = LAYOUTS if ranks == 2 else FOUR_RANK_LAYOUTS
    out = tmp_path / "runs.json"
    run_distributed(_worker, ranks, model_dirs, list(layouts), str(out))
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(layouts)
    _assert_same(results)
