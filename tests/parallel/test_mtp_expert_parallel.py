"""MTP with expert parallel: the qwen3_next and deepseek_v4 model ids with one MTP depth (their MTP layers are
sparse: stacked experts; DeepSeek-V4's runs over the mHC streams, models/deepseek_v4/mtp.py), on 2 gloo ranks at
EP 2 (the engine's `build._with_mtp` + `apply_parallelism`), give one process's losses (both ranks' micro-batches,
lm loss + factor × MTP loss) over 3 steps; the MTP layer's experts are sharded like the main layers (two of the four
experts per rank)."""
import pytest
import torch

from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_next_config

STEPS, LR, SEQ, MBS, FACTOR = 3, 5e-3, 16, 2, 0.3


def _config(ep_size, model_id):
    from fsdp2_backend.config import Config

    config = Config()
    config.model.model_id, config.model.mtp_num_layers, config.model.mtp_loss_scaling_factor = model_id, 1, FACTOR
    config.optimization.gdn_chunk_size = 8
    config.optimization.moe_grouped_gemm = True
    config.parallel.param_dtype, config.parallel.ep_size = "fp32", ep_size
    return config


def _model(config):
    from fsdp2_backend.build import _with_mtp
    from fsdp2_backend.models.registry import model_spec

    torch.manual_seed(0)
    if config.model.model_id == "deepseek_v4":  # a hash-routed layer, then a top-k one; the MTP layer: top-k
        from tests.support.tiny_models import tiny_newer_config

        return _with_mtp(model_spec("deepseek_v4").build(tiny_newer_config("deepseek_v4")), config)
    # two layers, the last one dense: the MTP layer is still full attention with the sparse MoE (its layout)
    model = model_spec("qwen3_next").build(tiny_next_config(
        output_router_logits=False, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        mlp_only_layers=[1]))
    return _with_mtp(model, config)


def _batch(step, rank, vocab):
    from fsdp2_backend.models.mtp import mtp_batch

    g = torch.Generator().manual_seed(1000 * (step % 2) + rank)  # two batches in turn: the loss must fall
    text = torch.randint(0, vocab, (MBS, SEQ + 1), generator=g)
    mask = torch.ones(MBS, SEQ)
    mask[rank, 3 + step] = 0
    return mtp_batch(dict(input_ids=text[:, :-1], labels=text[:, 1:], loss_mask=mask,
                          position_ids=torch.arange(SEQ).expand(MBS, SEQ)), 1)


def _loss(model, batch, scale):
    """(lm loss + FACTOR × MTP loss of this micro-batch, detached); backward with gradient weight `scale`."""
    import torch.nn.functional as F

    from fsdp2_backend.models.mtp import mtp_forward

    out, sums, counts = mtp_forward(model, batch, 1, lambda s, c: FACTOR * s[0] / c[0], loss_scale=scale)
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten()
    lm = (ce * mask).sum() / mask.sum()
    (lm * scale).backward()
    return float(lm.detach() + FACTOR * sums[0] / counts[0])


def _reference(model_id):
    from fsdp2_backend.parallel.apply import _model_switches

    model, config = _model(_config(1, model_id))
    _model_switches(model, config, "cpu")  # the model id's switches, as the engine applies them
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(sum(_loss(model, _batch(step, r, model.config.vocab_size), 0.5) for r in range(2)) / 2)
        opt.step()
    return losses


def _ranks(rank, world_size, out_dir, model_id):
    import json

    import torch.distributed as dist

    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.parallel.apply import apply_parallelism

    model, config = _model(_config(2, model_id))
    assert "mtp.layers.{*}.transformer_layer.mlp.experts" in config.parallel.ep_modules
    model = apply_parallelism(model, config, ParallelContext.create(config.parallel))
    experts = model.mtp.layers[0].transformer_layer.mlp.experts
    assert experts.gate_up_proj.to_local().shape[0] == 2  # two of the four experts per rank, as the main layers'
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        batch = _batch(step, rank, model.config.vocab_size)
        total = torch.tensor(_loss(model, batch, 1 / world_size))  # SUMmed gradients: the 1/dp here
        opt.step()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    if rank == 0:
        with open(f"{out_dir}/losses.json", "w") as f:
            json.dump(losses, f)


@pytest.mark.parametrize("model_id", ["qwen3_next", "deepseek_v4"])
def test_mtp_with_ep2_equals_one_process(tmp_path, model_id):
    import json

    run_distributed(_ranks, 2, str(tmp_path), model_id)
    got = json.loads((tmp_path / "losses.json").read_text())
    want = _reference(model_id)
    assert want[-1] < want[0]  # it trains
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
