"""FP8 training recipes (tensorwise with E5M2 gradients, rowwise, blockwise) through the engine's quantize stage:
FSDP over 2 gloo ranks gives one process's losses (the same micro-batches, gradient accumulation there), each recipe
differs from the unquantised run, and a blockwise model keeps the linears that are not whole 128x128 blocks (and
lm_head, model.quant_ignored_modules) in high precision; the state dict holds plain weights."""
import json

import torch

from fsdp2_backend.config import Config
from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_qwen3_config
from tests.support.trainer_parity import ConstantLR, masked_samples, rank_micro_batches

STEPS, GBS = 2, 4
RUNS = (("tensorwise", "hybrid"), ("rowwise", "e4m3"), ("blockwise", "e4m3"), (None, "e4m3"))


def _train(model_dir, recipe, fp8_format):
    from fsdp2_backend.build import TrainJob
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism
    from fsdp2_backend.training.trainer import Trainer

    config = Config()
    config.model.model_name_or_path = model_dir
    config.parallel.param_dtype = "fp32"
    config.training.per_device_train_batch_size = 2
    if recipe:
        config.model.quant_recipe_name, config.model.quant_fp8_format = recipe, fp8_format
        config.model.quant_converters = ["quantize.linear.float8"]
    ctx = ParallelContext.create(config.parallel)
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(m, config, ctx))
    converted = sorted(name for name, m in model.named_modules()
                       if "forward" in vars(m) and getattr(vars(m)["forward"], "func", None).__name__ == "_float8_forward")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    samples = masked_samples(32, 32, seed=11, varying_mask=True)[:STEPS * GBS]  # test_fsdp_parity's samples
    batches = rank_micro_batches(samples, ctx.dp_size, ctx.dp_rank, 2)
    trainer = Trainer(TrainJob(config=config, ctx=ctx, model=model, optimizer=optimizer, scheduler=ConstantLR(),
                               train_batches=batches, train_iters=STEPS, micro_batches=GBS // (2 * ctx.dp_size)))
    losses = trainer.train().losses
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    ctx.close()
    return dict(losses=losses, converted=converted, plain=all(type(v) is torch.Tensor for v in state.values()))


def _worker(rank, world_size, model_dir, out_path):
    results = {str(recipe): _train(model_dir, recipe, fmt) for recipe, fmt in RUNS}
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(results, handle)


def test_two_ranks_equal_one_for_each_fp8_recipe(tmp_path):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(5)
    # hidden 128: q/o/gate/up/down are whole 128x128 blocks, k/v (64 rows) are not
    Qwen3ForCausalLM(tiny_qwen3_config(hidden_size=128, intermediate_size=256, head_dim=32)).save_pretrained(
        tmp_path / "model")
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    _worker(0, 1, str(tmp_path / "model"), str(one))
    run_distributed(_worker, 2, str(tmp_path / "model"), str(two))
    one, two = json.loads(one.read_text()), json.loads(two.read_text())
    plain = one["None"]["losses"]
    for recipe, _ in RUNS[:3]:
        want, got = one[recipe]["losses"], two[recipe]["losses"]
        assert len(want) == STEPS
        # FSDP's clipping norm is summed over the shards, one process's over whole tensors: the last bit of the
        # clipped gradients differs, which a recipe can turn into another FP8 value a step later (blockwise: 4e-6)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0,
                                   msg=f"{recipe} {got} {want}")
        assert all(abs(q - p) > 1e-6 for q, p in zip(want, plain)), recipe  # the recipe is applied
        assert all(abs(q - p) < 0.05 * p for q, p in zip(want, plain)), recipe
        assert two[recipe]["plain"]
    assert len(one["tensorwise"]["converted"]) == 14 and "lm_head" not in one["tensorwise"]["converted"]
    blockwise = one["blockwise"]["converted"]
    assert "model.layers.0.self_attn.q_proj" in blockwise and "model.layers.0.self_attn.k_proj" not in blockwise
    assert len(blockwise) == 10
