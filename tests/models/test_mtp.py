"""Multi-token prediction (models/mtp.py) on one real rank: the logged `mtp_1 loss` and the MTP gradients equal a
reference written here with plain torch ops from the module's weights (independent of the module's forward),
starting from transformers' own final hidden states; Megatron's label / mask rolling; config and flag checks."""
import math

import pytest
import torch
import torch.nn.functional as F

from fsdp2_backend.config import Config
from tests.support.tiny_models import tiny_qwen3_config

SEQ, MBS, VOCAB, FACTOR = 16, 2, 128, 0.3


def _batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)
    mask = torch.ones(MBS, SEQ)
    mask[0, 5] = 0  # a masked label: rolled with the labels
    return dict(tokens=text[:, :-1], labels=text[:, 1:], loss_mask=mask,
                position_ids=torch.arange(SEQ).expand(MBS, SEQ))


@pytest.fixture()
def trainer(tmp_path):
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.build import TrainJob, _with_mtp
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism
    from fsdp2_backend.training.optimizer import build_optimizer
    from fsdp2_backend.training.scheduler import ParamScheduler, scheduler_steps
    from fsdp2_backend.training.trainer import Trainer

    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=VOCAB, num_hidden_layers=1)).save_pretrained(tmp_path)
    config = Config()
    config.model.model_name_or_path = str(tmp_path)
    config.model.mtp_num_layers, config.model.mtp_loss_scaling_factor = 1, FACTOR
    config.parallel.param_dtype = "fp32"
    config.training.per_device_train_batch_size = MBS
    config.training.max_steps, config.training.lr, config.training.lr_scheduler_type = 2, 1e-3, "constant"
    ctx = ParallelContext.create(config.parallel)
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(*_with_mtp(m, config), ctx))
    optimizer = build_optimizer(model, lr=config.training.lr, weight_decay=0.0)
    scheduler = ParamScheduler(optimizer, **scheduler_steps(config.training, MBS))

    def batches():
        while True:
            yield _batch()

    job = TrainJob(config=config, ctx=ctx, model=model, optimizer=optimizer, scheduler=scheduler,
                   train_batches=batches(), train_iters=2, micro_batches=1)
    yield Trainer(job)
    ctx.close()


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):  # x [B, S, heads, d]
    d = x.size(-1)
    freqs = pos[..., None].float() / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, :, None], torch.cat([freqs, freqs], -1).sin()[:, :, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


def _qwen3_layer(x, w, pos, cfg):
    """A Qwen3 decoder layer by hand: pre-norm GQA attention with q/k RMSNorm and rope, pre-norm SwiGLU MLP."""
    B, S, _ = x.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = _rms(x, w["input_layernorm.weight"])
    q = _rms((h @ w["self_attn.q_proj.weight"].T).view(B, S, nh, hd), w["self_attn.q_norm.weight"])
    k = _rms((h @ w["self_attn.k_proj.weight"].T).view(B, S, nkv, hd), w["self_attn.k_norm.weight"])
    v = (h @ w["self_attn.v_proj.weight"].T).view(B, S, nkv, hd)
    q, k = _rope(q, pos).transpose(1, 2), _rope(k, pos).transpose(1, 2)
    k, v = k.repeat_interleave(nh // nkv, 1), v.transpose(1, 2).repeat_interleave(nh // nkv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, nh * hd)
    x = x + attn @ w["self_attn.o_proj.weight"].T
    h = _rms(x, w["post_attention_layernorm.weight"])
    mlp = F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)
    return x + mlp @ w["mlp.down_proj.weight"].T


def _reference(model, batch):
    """(mtp_1 mean loss, lm mean loss, reference MTP weights with grads of the training loss) from a plain copy."""
    from transformers import Qwen3ForCausalLM

    state = {k: v.detach().full_tensor().clone() for k, v in model.state_dict().items()}
    plain = Qwen3ForCausalLM(model.config)
    plain.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")})
    weights = {k[len("mtp.layers.0."):]: v.requires_grad_() for k, v in state.items() if k.startswith("mtp.layers.0.")}
    ids, labels, mask, pos = batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]
    hidden = plain.model(input_ids=ids, position_ids=pos).last_hidden_state.detach()  # transformers' final norm
    lm = F.cross_entropy(plain.lm_head(hidden).flatten(0, 1), labels.flatten(), reduction="none")
    lm = (lm * mask.flatten()).sum() / mask.sum()
    # Megatron's roll by one more position, zero-filled: token t+1's embedding, label t+2, mask of label t+2.
    ids1, labels1, mask1 = (torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], 1) for t in (ids, labels, mask))
    emb = state["model.embed_tokens.weight"][ids1]
    x = torch.cat([_rms(emb, weights["enorm.weight"]), _rms(hidden, weights["hnorm.weight"])], -1)
    x = x @ weights["eh_proj.weight"].T
    layer_w = {k[len("transformer_layer."):]: v for k, v in weights.items() if k.startswith("transformer_layer.")}
    x = _rms(_qwen3_layer(x, layer_w, pos, model.config), weights["final_layernorm.weight"])
    ce = F.cross_entropy((x @ state["lm_head.weight"].T).flatten(0, 1), labels1.flatten(), reduction="none")
    mtp = (ce * mask1.flatten()).sum() / mask1.sum()
    (FACTOR * mtp).backward()  # the lm loss does not reach the MTP weights
    return mtp.item(), lm.item(), weights


def test_mtp_loss_and_gradients_equal_a_hand_written_reference(trainer, capsys):
    from fsdp2_backend.training.logging import parse_train_line
    from fsdp2_backend.training.loss import GlobalBatchLoss

    model = trainer.model
    mtp_ref, lm_ref, weights = _reference(model, _batch())
    # the training term: gradients of the MTP weights from one micro-batch's backward
    accounting = GlobalBatchLoss(num_microbatches=1, dp_size=1, calculate_per_token_loss=False)
    loss_sum, count, _ = trainer._forward_loss(_batch(), accounting)
    accounting.backward_loss(loss_sum, count).backward()
    for name, ref in weights.items():
        got = model.mtp.layers[0].get_parameter(name).grad
        torch.testing.assert_close(got.full_tensor(), ref.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert trainer._finish_mtp(1)["mtp_1 loss"] == pytest.approx(mtp_ref, rel=1e-5)  # one micro-batch
    trainer.optimizer.zero_grad(set_to_none=True)
    # the log line of a training step carries Megatron's `mtp_1 loss` next to the lm loss
    trainer.train()
    lines = [parse_train_line(line) for line in capsys.readouterr().out.splitlines()]
    first = next(line for line in lines if line and line["iteration"] == 1)
    assert first["losses"]["lm loss"] == pytest.approx(lm_ref, rel=1e-5)
    assert first["losses"]["mtp_1 loss"] == pytest.approx(mtp_ref, rel=1e-5)


def test_roll_left_is_megatrons_roll_tensor():
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    from fsdp2_backend.models.mtp import roll_left

    x = torch.arange(24).view(2, 12)
    expected = x
    for k in (1, 2, 3):
        expected, _ = roll_tensor(expected.clone(), shifts=-1, dims=-1)
        assert torch.equal(roll_left(x, k), expected)


def test_flags_map_and_bad_settings_are_refused():
    from fsdp2_backend.config.validation import validate

    config = Config()
    config.model.mtp_num_layers, config.parallel.tp_size = 0, 1
    with pytest.raises(Exception, match="model.mtp_num_layers"):
        validate(config, world_size=1)
    config.model.mtp_num_layers, config.optimization.chunk_loss_size = 1, 8
    with pytest.raises(Exception, match="model.mtp_num_layers: not available with optimization.chunk_loss_size"):
        validate(config, world_size=1)


def test_megatron_flags_map_to_the_model_fields():
    from megatron_compat.translate import translate_megatron
    from tests.support.megatron_lines import TRANSLATE_BASE_FLAGS

    fields = translate_megatron(TRANSLATE_BASE_FLAGS + ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.25"]).fields
    assert fields["model"]["mtp_num_layers"] == 2 and fields["model"]["mtp_loss_scaling_factor"] == 0.25
    assert translate_megatron(TRANSLATE_BASE_FLAGS).fields["model"].get("mtp_num_layers") is None
