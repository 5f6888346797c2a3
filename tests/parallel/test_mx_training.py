"""MXFP8 quantised training through the engine (`parallel.quantize` + FSDP2's low-precision all-gather).

- 1 rank vs FSDP over 2 ranks with low-precision all-gather (on-demand and all) give the same losses, and the
  high-precision gather gives them too; the quantised run is not the unquantised one;
- each weight is quantised once per step (row-wise and column-wise) across micro-batches and re-gathers;
- the low-precision all-gather really moves fewer bytes; weights whose shard is not whole blocks gather in
  high precision;
- the full state dict and the HF export hold plain unquantised weights;
- 50 steps of a tiny Qwen3 and Qwen3-MoE: the quantised loss stays within a few percent of the bf16 one, and
  differs from it; `quant_ignored_modules` (lm_head, the MoE router) stay high precision.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fsdp2_backend.config import Config
from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_qwen3_config
from tests.support.trainer_parity import ConstantLR, masked_samples, rank_micro_batches

STEPS = 3


def _train(model_dir, steps, *, quant, lp=True, mode="on-demand", dtype="fp32", model_id=None, global_batch=8,
           export_dir=None):
    from fsdp2_backend.build import TrainJob
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism
    from fsdp2_backend.parallel.quantize import mx_weights
    from fsdp2_backend.training.trainer import Trainer

    config = Config()
    config.model.model_name_or_path, config.model.model_id = model_dir, model_id
    config.parallel.param_dtype = dtype
    config.training.per_device_train_batch_size = 2
    if quant:
        config.model.quant_recipe_name = "mxfp8"
        config.model.enable_fsdp_low_precision_all_gather = lp
        config.model.fsdp_low_precision_all_gather_mode = mode
        if model_id:
            config.model.quant_converters = ["quantize.linear.mx", "quantize.moe.mx"]
    ctx = ParallelContext.create(config.parallel)
    dp = ctx.dp_size
    micro_batches = global_batch // (2 * dp)
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(m, config, ctx))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    batches = rank_micro_batches(_samples_for(steps, global_batch), dp, ctx.dp_rank, 2)
    gathered = []
    real_all_gather = torch.distributed.all_gather_single

    def counting_all_gather(output, tensor, *args, **kwargs):  # FSDP2's all-gather: count the bytes it moves
        gathered.append(output.numel() * output.element_size())
        return real_all_gather(output, tensor, *args, **kwargs)

    torch.distributed.all_gather_single = counting_all_gather
    try:
        trainer = Trainer(TrainJob(config=config, ctx=ctx, model=model, optimizer=optimizer, scheduler=ConstantLR(),
                                   train_batches=batches, train_iters=steps, micro_batches=micro_batches))
        losses = trainer.train().losses
    finally:
        torch.distributed.all_gather_single = real_all_gather
    weights = {n: [w.settings.quantizations, w.settings.low_precision_gather] for n, w in mx_weights(model)}
    result = dict(losses=losses, weights=weights, gathered_bytes=sum(gathered))
    if export_dir:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from fsdp2_backend.checkpoint.hf_export import export_hf

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        result["state_dict_types"] = sorted({type(v).__name__ for v in full.values()})
        export_hf(model, export_dir)
        if ctx.rank == 0:
            torch.save({k: v.clone() for k, v in full.items()}, f"{export_dir}.full.pt")
    ctx.close()
    return result


def _samples_for(steps, per_step):
    samples = masked_samples(32, 32, seed=11, varying_mask=True)  # test_fsdp_parity's samples
    return (samples * (steps * per_step // len(samples) + 1))[:steps * per_step]


def _parity_worker(rank, world_size, model_dir, out_path, export_dir):
    results = {"on-demand": _train(model_dir, STEPS, quant=True, export_dir=f"{export_dir}{world_size}")}
    if world_size == 1:  # the unquantised run, and one rank's gather (high precision: nothing to communicate)
        results["bf"] = _train(model_dir, STEPS, quant=False)
    else:
        results["all"] = _train(model_dir, STEPS, quant=True, mode="all")
        results["hp"] = _train(model_dir, STEPS, quant=True, lp=False)
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(results, handle)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("mx_model")
    torch.manual_seed(5)
    Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=512)).save_pretrained(path)
    return str(path)


def test_one_rank_and_two_rank_low_precision_all_gather_agree(model_dir, tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    export = str(tmp_path / "hf")
    _parity_worker(0, 1, model_dir, str(one), export)
    run_distributed(_parity_worker, 2, model_dir, str(two), export)
    one, two = json.loads(one.read_text()), json.loads(two.read_text())
    reference = one["on-demand"]["losses"]
    assert len(reference) == STEPS
    for run in (two["on-demand"], two["all"], two["hp"]):
        for step, (x, y) in enumerate(zip(reference, run["losses"])):
            assert abs(x - y) <= 1e-5 * abs(x), f"step {step}: {x} vs {y}"
    # The recipe is applied: every step's loss differs from the unquantised run's (same ranks, same data).
    assert all(abs(q - b) > 1e-5 for q, b in zip(reference, one["bf"]["losses"]))
    assert reference[-1] < reference[0]
    # Quantised once per step: row-wise + column-wise, whatever the micro-batches and re-gathers.
    weights = two["on-demand"]["weights"]
    assert len(weights) == 14 and all(count == 2 * STEPS for count, _ in weights.values()), weights
    # On 2 ranks q_proj (64 rows: 32 per shard) gathers quantised; k_proj (32 rows: 16 per shard) cannot.
    assert weights["model.layers.0.self_attn.q_proj.weight"][1] is True
    assert weights["model.layers.0.self_attn.k_proj.weight"][1] is False
    hp_bytes, lp_bytes = two["hp"]["gathered_bytes"], two["on-demand"]["gathered_bytes"]
    assert lp_bytes < hp_bytes and two["all"]["gathered_bytes"] > lp_bytes
    # Checkpoint state and the HF export hold the plain weights.
    assert two["on-demand"]["state_dict_types"] == ["Tensor"]
    _export_holds_unquantised_weights(f"{export}2")


def _export_holds_unquantised_weights(export_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    full = torch.load(f"{export_dir}.full.pt")
    exported = {}  # every rank wrote a shard of whole layers (model-0000i-of-0000N.safetensors)
    for shard in sorted(Path(export_dir).glob("*.safetensors")):
        exported.update(load_file(shard))
    q = exported["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float32
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"])
    # Not a dequantised MXFP8 copy: quantising it again changes it.
    from fsdp2_backend.kernels.mx import mx_fake_quantize

    assert not torch.equal(q, mx_fake_quantize(q))
    AutoModelForCausalLM.from_pretrained(export_dir)  # loads with plain transformers


def _moe_dir(path):
    from tests.support.tiny_models import tiny_moe_config
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(5)
    Qwen3MoeForCausalLM(tiny_moe_config(vocab_size=512)).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_fifty_quantised_steps_stay_within_a_few_percent_of_bf16(kind, model_dir, tmp_path):
    path = model_dir if kind == "qwen3" else _moe_dir(tmp_path / "moe")
    model_id = None if kind == "qwen3" else "qwen3_moe"
    bf16 = _train(path, 50, quant=False, dtype="bf16", model_id=model_id, global_batch=2)["losses"]
    mx = _train(path, 50, quant=True, dtype="bf16", model_id=model_id, global_batch=2)
    assert bf16[-1] < 0.8 * bf16[0]  # it learns
    # One micro-batch of 2 a step makes single-step losses noisy (and MoE routing diverges): compare 10-step means.
    for start in range(0, 50, 10):
        a, b = (sum(run[start:start + 10]) / 10 for run in (mx["losses"], bf16))
        assert abs(a - b) <= 0.05 * b, f"steps {start}-{start + 9}: mxfp8 {a} vs bf16 {b}\n{mx['losses']}\n{bf16}"
    assert sum(abs(a - b) for a, b in zip(mx["losses"], bf16)) > 1e-3  # the recipe is really applied
    # MoE: the experts run the MX grouped GEMM (their weights are not wrapped), the router stays high precision.
    names = set(mx["weights"])
    assert not any("lm_head" in n or n.endswith("mlp.gate.weight") for n in names)


def test_ignored_modules_stay_high_precision_and_state_dict_is_plain():
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.parallel.mx.weight import MXTrainingWeight
    from fsdp2_backend.parallel.quantize import apply_quantization

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=512))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = Config()
    config.model.quant_recipe_name = "mxfp8"
    config.model.quant_ignored_modules = ["*lm_head", "*.mlp"]
    converted = apply_quantization(model, config)
    assert converted and all("mlp" not in n and "lm_head" not in n for n in converted)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.weight, MXTrainingWeight)
    for linear in (model.lm_head, layer.mlp.up_proj):
        assert type(linear.weight.data) is torch.Tensor
        x = torch.randn(3, linear.in_features)
        assert torch.equal(linear(x), F.linear(x, linear.weight))  # plain high-precision GEMM
    x = torch.randn(3, 64)
    assert not torch.equal(layer.self_attn.q_proj(x), F.linear(x, layer.self_attn.q_proj.weight.hp_data()))
    after = model.state_dict()
    assert all(type(v) is torch.Tensor for v in after.values())
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_cache_lives_until_the_weight_is_written():
    from fsdp2_backend.parallel.mx.weight import MXSettings, MXTrainingWeight

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False)
    settings = MXSettings()
    linear.weight = torch.nn.Parameter(MXTrainingWeight(linear.weight.data, settings))
    optimizer = torch.optim.AdamW(linear.parameters(), lr=0.1)
    x = torch.randn(8, 64, requires_grad=True)  # as inside a model: the input gradient needs W column-wise
    for _ in range(3):  # three micro-batches: row-wise and column-wise once
        linear(x).square().sum().backward()
    assert settings.quantizations == 2
    first = linear(x)
    optimizer.step()  # the update invalidates the cache
    assert type(optimizer.state[linear.weight]["exp_avg"]) is torch.Tensor
    second = linear(x)
    assert settings.quantizations == 3 and not torch.equal(first, second)
