"""MTP under tensor parallel: the qwen3 model id with one MTP depth, on 2 gloo ranks at TP 2 with sequence parallel
(the engine's `build._with_mtp` + `apply_parallelism`: the MTP layer's attention and MLP get the tp plan, its
norms and eh_proj run on sequence shards), gives one process's losses (lm loss + factor x MTP loss) over 3 steps."""
import torch

from tests.support.launchers import run_distributed

STEPS, LR, SEQ, MBS, FACTOR = 3, 5e-3, 16, 2, 0.3


def _config(tp_size):
    from fsdp2_backend.config import Config

    config = Config()
    config.model.model_id, config.model.mtp_num_layers, config.model.mtp_loss_scaling_factor = "qwen3", 1, FACTOR
    config.parallel.param_dtype, config.parallel.tp_size = "fp32", tp_size
    config.parallel.sequence_parallel = tp_size > 1
    return config


def _model(config):
    from transformers import Qwen3Config

    from fsdp2_backend.build import _with_mtp
    from fsdp2_backend.models.registry import model_spec

    torch.manual_seed(0)
    hf_config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                            tie_word_embeddings=False)
    hf_config._attn_implementation = "sdpa"
    return _with_mtp(model_spec("qwen3").build(hf_config), config)


def _batch(step):
    from fsdp2_backend.models.mtp import mtp_batch

    g = torch.Generator().manual_seed(1000 * (step % 2))  # two batches in turn: the loss must fall
    text = torch.randint(0, 128, (MBS, SEQ + 1), generator=g)
    mask = torch.ones(MBS, SEQ)
    mask[1, 3 + step] = 0
    return mtp_batch(dict(input_ids=text[:, :-1], labels=text[:, 1:], loss_mask=mask,
                          position_ids=torch.arange(SEQ).expand(MBS, SEQ)), 1)


def _loss(model, batch):
    """(lm loss + FACTOR x MTP loss, detached), after its backward."""
    import torch.nn.functional as F

    from fsdp2_backend.models.mtp import mtp_forward

    out, sums, counts = mtp_forward(model, batch, 1, lambda s, c: FACTOR * s[0] / c[0])
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten()
    lm = (ce * mask).sum() / mask.sum()
    lm.backward()
    return float(lm.detach() + FACTOR * sums[0] / counts[0])


def _train(model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(_loss(model, _batch(step)))
        opt.step()
    return losses


def _ranks(rank, world_size, out_dir):
    import json

    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.parallel.apply import apply_parallelism

    model, config = _model(_config(2))
    model = apply_parallelism(model, config, ParallelContext.create(config.parallel))
    assert model.mtp.layers[0].transformer_layer.self_attn.q_proj.weight.to_local().shape[0] == 32  # half the rows
    losses = _train(model)  # both tp ranks read the same batch (dp 1)
    if rank == 0:
        with open(f"{out_dir}/losses.json", "w") as f:
            json.dump(losses, f)


def test_mtp_with_tp2_sequence_parallel_equals_one_process(tmp_path):
    import json

    run_distributed(_ranks, 2, str(tmp_path))
    got = json.loads((tmp_path / "losses.json").read_text())
    want = _train(_model(_config(1))[0])
    assert want[-1] < want[0]  # it trains
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
