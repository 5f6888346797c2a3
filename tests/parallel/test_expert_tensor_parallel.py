"""Expert parallel under tensor parallel (Megatron's `--expert-tensor-parallel-size 1`): on 2 gloo ranks, TP 2 x
EP 2 (the ep group is the two tp ranks, as Megatron carves it from tp x dp), the tiny qwen3_moe trained through the
engine's `apply_parallelism` gives one process's losses over 3 steps, with and without sequence parallel; the
experts are sharded two per rank and not tensor-parallel, attention is."""
import torch

from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_moe_config

STEPS, LR = 3, 5e-3


def _config(tp, ep, sequence_parallel):
    from fsdp2_backend.config import Config

    config = Config()
    config.model.model_id = "qwen3_moe"
    config.optimization.moe_grouped_gemm = True
    config.parallel.param_dtype, config.parallel.tp_size, config.parallel.ep_size = "fp32", tp, ep
    config.parallel.sequence_parallel = sequence_parallel
    return config


def _model():
    from fsdp2_backend.models.qwen3_moe.modeling import build_qwen3_moe

    torch.manual_seed(0)
    hf_config = tiny_moe_config(output_router_logits=False)
    hf_config._attn_implementation = "sdpa"
    return build_qwen3_moe(hf_config)


def _batch(step):
    g = torch.Generator().manual_seed(1000 * (step % 2))  # two batches in turn: the loss must fall
    ids = torch.randint(0, 128, (2, 16), generator=g)
    return dict(input_ids=ids, labels=ids)


def _reference():
    from fsdp2_backend.parallel.apply import _model_switches

    model = _model()
    _model_switches(model, _config(1, 1, False), "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(**_batch(step)).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _ranks(rank, world_size, out_dir):
    import json

    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.parallel.apply import apply_parallelism

    results = {}
    for sequence_parallel in (True, False):
        config = _config(2, 2, sequence_parallel)
        model = apply_parallelism(_model(), config, ParallelContext.create(config.parallel))
        layer = model.model.layers[0]
        assert layer.mlp.experts.gate_up_proj.to_local().shape[0] == 2  # two of the four experts per rank
        assert layer.self_attn.q_proj.weight.to_local().shape[0] == 32  # half of the 4 x 16 query rows
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            loss = model(**_batch(step)).loss  # both tp ranks read the same batch (dp 1)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        results[str(sequence_parallel)] = losses
    if rank == 0:
        with open(f"{out_dir}/losses.json", "w") as f:
            json.dump(results, f)


def test_tp2_with_ep2_equals_one_process(tmp_path):
    import json

    run_distributed(_ranks, 2, str(tmp_path))
    got = json.loads((tmp_path / "losses.json").read_text())
    want = _reference()
    assert want[-1] < want[0]  # it trains
    for sequence_parallel in ("True", "False"):
        torch.testing.assert_close(torch.tensor(got[sequence_parallel]), torch.tensor(want), rtol=1e-5, atol=0)
