"""FP8 training recipes under tensor and context parallel (fsdp2_backend/parallel/float8_tp.py): TP 2, TP 2 with
sequence parallel, TP 2 × FSDP 2, CP 2 and TP 2 × CP 2 on gloo give the 1-rank losses of the same recipe (1e-4
relative: the scales are the whole tensors'); the delayed recipe (parallel/float8_delayed.py, non-default history
settings) too, its amaxes reduced over every rank; a delayed checkpoint (weights and amax histories) saved at TP 2
resumes at 1 rank with the losses of an uninterrupted 1-rank run.

The model (hidden 128, 4 heads of 32, MLP 256) makes both blockwise paths run: gate/up (256 rows → 128 per rank)
and down (256 inputs → 128) keep whole 128-blocks per shard, q/o (128 → 64 per rank) split blocks across ranks."""
import json

import torch

from fsdp2_backend.config import Config
from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_qwen3_config
from tests.support.trainer_parity import ConstantLR, masked_samples, rank_micro_batches

STEPS, GBS, MBS, SEQ = 4, 4, 2, 16
RECIPES = (("tensorwise", "hybrid"), ("rowwise", "e4m3"), ("blockwise", "e4m3"), ("delayed", "hybrid"))
# Under context parallel a blockwise 128-token block lies on one rank: 2 chunks of seq / (2 cp) tokens per rank.
SEQ_OF = {"tensorwise": SEQ, "rowwise": SEQ, "blockwise": 2 * 2 * 128, "delayed": SEQ}




def _train(model_dir, recipe, fp8_format, tp=1, sp=False, steps=(0, STEPS), save=None, load=None, cp=1, seq=SEQ):
    """Losses of steps [first, last) of one run; `save` / `load`: a checkpoint directory after / before them."""
    from fsdp2_backend.build import TrainJob
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.float8_delayed import delayed_scaling
    from fsdp2_backend.parallel.apply import apply_parallelism
    from fsdp2_backend.training.checkpoint import CheckpointManager, load_checkpoint
    from fsdp2_backend.training.trainer import Trainer

    config = Config()
    config.model.model_name_or_path = model_dir
    config.parallel.param_dtype = "fp32"
    config.parallel.tp_size, config.parallel.sequence_parallel, config.parallel.cp_size = tp, sp, cp
    config.data.cutoff_len = seq
    config.training.per_device_train_batch_size = MBS
    config.model.quant_recipe_name, config.model.quant_fp8_format = recipe, fp8_format
    config.model.quant_converters = ["quantize.linear.float8"]
    config.model.quant_fp8_amax_history_len, config.model.quant_fp8_amax_compute_algo = 3, "max"
    config.model.quant_fp8_margin = 1
    ctx = ParallelContext.create(config.parallel)
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(m, config, ctx))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # AdamW would hide a wrong clipping norm
    extra = {"fp8_delayed": delayed_scaling(model)} if recipe == "delayed" else None
    if load:
        load_checkpoint(load, model, optimizer, no_load_rng=True, extra_states=extra)
    first, last = steps
    batches = rank_micro_batches(masked_samples(GBS * STEPS, seq, seed=7)[first * GBS:last * GBS], ctx.dp_size,
                                 ctx.dp_rank, MBS)
    trainer = Trainer(TrainJob(config=config, ctx=ctx, model=model, optimizer=optimizer, scheduler=ConstantLR(),
                               train_batches=batches, train_iters=last - first,
                               micro_batches=GBS // (MBS * ctx.dp_size)))
    losses = trainer.train().losses
    if save:
        CheckpointManager(save).save(last, model, optimizer, extra_states=extra)
    ctx.close()
    return losses


def _layouts(rank, world_size, model_dir, out_path):
    results = {}
    for recipe, fmt in RECIPES:
        results[f"{recipe} tp2"] = _train(model_dir, recipe, fmt, tp=2)
        if world_size == 2:
            results[f"{recipe} tp2 sp"] = _train(model_dir, recipe, fmt, tp=2, sp=True)
            results[f"{recipe} cp2"] = _train(model_dir, recipe, fmt, cp=2, seq=SEQ_OF[recipe])
    if world_size == 4:  # Megatron's functional test layout, tp × cp
        results["tensorwise tp2 cp2"] = _train(model_dir, "tensorwise", "hybrid", tp=2, cp=2)
    if world_size == 2:  # the checkpoint half of the resume check
        results["saved"] = _train(model_dir, "delayed", "hybrid", tp=2, steps=(0, 2), save=out_path + ".ckpt")
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(results, handle)


def test_fp8_recipes_under_tensor_parallel_equal_one_rank(tmp_path):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(3)
    Qwen3ForCausalLM(tiny_qwen3_config(hidden_size=128, intermediate_size=256, head_dim=32,
                                       max_position_embeddings=512)).save_pretrained(
        tmp_path / "model")
    model = str(tmp_path / "model")
    one = {recipe: _train(model, recipe, fmt) for recipe, fmt in RECIPES}
    one["plain"] = _train(model, None, "e4m3")
    one["blockwise 512"] = _train(model, "blockwise", "e4m3", seq=SEQ_OF["blockwise"])
    run_distributed(_layouts, 2, model, str(tmp_path / "two.json"))
    run_distributed(_layouts, 4, model, str(tmp_path / "four.json"))  # tp 2 × fsdp 2
    two = json.loads((tmp_path / "two.json").read_text())
    four = json.loads((tmp_path / "four.json").read_text())
    for recipe, _ in RECIPES:
        want = torch.tensor(one[recipe])
        assert len(want) == STEPS
        assert (want - torch.tensor(one["plain"])).abs().min() > 1e-5, recipe  # the recipe is applied
        for got in (two[f"{recipe} tp2"], two[f"{recipe} tp2 sp"], four[f"{recipe} tp2"]):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=0,
                                       msg=f"{recipe}: {got} {want.tolist()}")
        want_cp = one["blockwise 512"] if recipe == "blockwise" else one[recipe]
        torch.testing.assert_close(torch.tensor(two[f"{recipe} cp2"]), torch.tensor(want_cp), rtol=1e-4, atol=0,
                                   msg=f"{recipe} cp2: {two[f'{recipe} cp2']} {want_cp}")
    torch.testing.assert_close(torch.tensor(four["tensorwise tp2 cp2"]), torch.tensor(one["tensorwise"]), rtol=1e-4,
                               atol=0)
    # saved at tp 2 after two steps, resumed at 1 rank for the last two: the uninterrupted 1-rank losses
    resumed = _train(model, "delayed", "hybrid", steps=(2, STEPS), load=str(tmp_path / "two.json.ckpt" /
                                                                           "iter_0000002"))
    torch.testing.assert_close(torch.tensor(two["saved"] + resumed), torch.tensor(one["delayed"]), rtol=1e-4,
                               atol=0)
    ratios = {f"{recipe} {layout}{suffix}": max(abs(a / b - 1) for a, b in zip(got, one[recipe]))
              for source, suffix in ((two, ""), (four, " on 4 ranks")) for key, got in source.items() if key != "saved"
              for recipe, layout in [key.split(" ", 1)] if recipe in one and layout != "cp2"}
    print("FP8 max |loss / 1-rank loss - 1|:", json.dumps(ratios))
