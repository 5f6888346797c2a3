"""`optimization.chunk_loss_size` through the real trainer: per-step losses, grad norms and validation losses equal
the full-logits run's (fp32, 1e-6 relative) on 1 rank (own-unit lm head, tied embeddings, MoE with aux loss) and
on 2 FSDP ranks (dp 2, and cp 2 where batches are sequence-sharded first); bad settings are declined."""
import json

import pytest
import torch

from fsdp2_backend.config import Config
from fsdp2_backend.usage_errors import UsageError
from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_qwen3_config

STEPS, SEQ, MBS, VOCAB, CHUNK = 3, 16, 2, 128, 5  # 32 tokens per micro-batch: 6 chunks of 5 and one of 2


def _batches(seed, dp=1, rank=0):
    """Micro-batches with varying loss masks; with dp ranks, rank r takes its slice of each group."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        text = torch.randint(0, 24, (MBS * dp, SEQ + 1), generator=gen)
        mask = (torch.rand(MBS * dp, SEQ, generator=gen) > 0.3).float()
        part = slice(rank * MBS, (rank + 1) * MBS)
        yield dict(tokens=text[part, :-1], labels=text[part, 1:], loss_mask=mask[part],
                   position_ids=torch.arange(SEQ).expand(MBS, SEQ))


class _ConstantLR:
    def step(self, increment):
        pass


def _train(model_dir, chunk, cp=1):
    """Losses, grad norms and one validation loss of a short run on this process's ranks (dp x cp)."""
    from fsdp2_backend.build import TrainJob
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism
    from fsdp2_backend.training.trainer import Trainer

    config = Config()
    config.model.model_name_or_path = model_dir
    config.parallel.param_dtype = "fp32"
    config.training.per_device_train_batch_size = MBS
    config.training.eval_iters = 2
    config.optimization.chunk_loss_size = chunk
    config.parallel.cp_size = cp
    ctx = ParallelContext.create(config.parallel)
    try:
        model = create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                             parallelize=lambda m: apply_parallelism(m, config, ctx))
        # SGD, not Adam: Adam's per-element normalisation would blow fp32 summation-order noise of near-zero
        # gradient elements up to visible differences, which says nothing about the chunked loss
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        trainer = Trainer(TrainJob(config=config, ctx=ctx, model=model, optimizer=optimizer, scheduler=_ConstantLR(),
                                   train_batches=_batches(1, ctx.dp_size, ctx.dp_rank), train_iters=STEPS,
                                   micro_batches=2))
        aux = trainer._forward_loss(next(_batches(3)))[2]
        losses, norms = [], []
        for _ in range(STEPS):
            step = trainer.train_step()
            losses.append(step.loss)
            norms.append(step.grad_norm)
        valid = trainer.evaluate(_batches(2, ctx.dp_size, ctx.dp_rank))
        names = sorted(name for name, _ in model.named_parameters())
        return {"losses": losses, "grad_norms": norms, "valid": valid, "aux": aux is not None, "names": names}
    finally:
        ctx.close()


def _assert_same(full, chunked):
    for key in ("losses", "grad_norms"):
        assert len(full[key]) == len(chunked[key]) == STEPS
        for step, (x, y) in enumerate(zip(full[key], chunked[key])):
            assert abs(x - y) <= 1e-6 * abs(x), f"{key} step {step}: full {x} vs chunked {y}"
    assert chunked["valid"] == pytest.approx(full["valid"], rel=1e-6)
    assert full["aux"] == chunked["aux"]
    assert full["names"] == chunked["names"]
    assert full["losses"][-1] < full["losses"][0]  # it trains, so later steps test the updated weights


def _save(tmp_path, model):
    model.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_equals_full_loss_one_rank(tmp_path, tied):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model_dir = _save(tmp_path, Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=VOCAB, tie_word_embeddings=tied)))
    _assert_same(_train(model_dir, None), _train(model_dir, CHUNK))


def test_chunked_loss_keeps_moe_aux_loss(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    from tests.support.tiny_models import tiny_moe_config

    torch.manual_seed(0)
    model_dir = _save(tmp_path, Qwen3MoeForCausalLM(tiny_moe_config(num_hidden_layers=1, router_aux_loss_coef=0.5)))
    full, chunked = _train(model_dir, None), _train(model_dir, CHUNK)
    assert full["aux"] and chunked["aux"]
    _assert_same(full, chunked)


def _worker(rank, world_size, model_dir, out_path):
    results = {"full": _train(model_dir, None), "chunked": _train(model_dir, CHUNK),
               "cp_full": _train(model_dir, None, cp=2), "cp_chunked": _train(model_dir, CHUNK, cp=2)}
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(results, handle)


def test_chunked_loss_equals_full_loss_two_fsdp_ranks(tmp_path):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model_dir = _save(tmp_path / "model", Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=VOCAB, num_hidden_layers=1)))
    out = tmp_path / "two.json"
    run_distributed(_worker, 2, model_dir, str(out))
    results = json.loads(out.read_text())
    _assert_same(results["full"], results["chunked"])  # dp 2
    _assert_same(results["cp_full"], results["cp_chunked"])  # cp 2: each rank's loss from its sequence share


@pytest.fixture(scope="module")
def pretrain_model_dir(tmp_path_factory):
    from tests.support.tiny_models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("decline_model"), seed=0, num_hidden_layers=1)


@pytest.mark.parametrize("chunk, tp, message", [
    (0, 1, "not a positive number"), (-4, 1, "not a positive number"), (8, 2, "tensor parallel")])
def test_bad_chunk_settings_are_declined(pretrain_model_dir, chunk, tp, message):
    """Config validation declines them (before anything is built); the same config without them is accepted."""
    from fsdp2_backend.config.validation import validate

    config = Config()
    config.model.model_name_or_path = pretrain_model_dir
    config.training.stage, config.data.data_manager_type = "pt", "mg"
    config.data.mock_data = True
    config.training.save_checkpoints = False
    config.optimization.chunk_loss_size = chunk
    config.parallel.tp_size = tp
    with pytest.raises(UsageError, match=message):
        validate(config, world_size=tp)
    config.optimization.chunk_loss_size = None
    validate(config, world_size=tp)
