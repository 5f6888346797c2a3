"""MindSpeed's ChunkMBS (parallel/chunk_batch.py) on one real FSDP rank: each decoder layer runs its micro-batch in
slices of chunk_mbs samples (3 slices of a batch of 5 at chunk_mbs 2), under one all-gather per layer per forward,
with the logits and gradients of the unsliced model; and the two other honoured training fields: fused_adamw
(torch's fused kernel, the same update as AdamW) and deterministic (torch's deterministic algorithms)."""
import torch

from fsdp2_backend.config import Config
from tests.support.tiny_models import tiny_qwen3_config


def _model(chunk, ctx):
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.parallel.apply import apply_parallelism

    config = Config()
    config.parallel.param_dtype = "fp32"
    config.parallel.recompute = True  # slices run inside the recomputed forward's wrapper
    config.parallel.enable_chunk_batch = chunk
    config.parallel.chunk_mbs = 2
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=2))
    calls = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, args, kwargs: calls.append(args[0].shape[0]), with_kwargs=True)
        inner = layer.forward
        layer.forward = lambda *a, _inner=inner, **k: (calls.append(("slice", a[0].shape[0])), _inner(*a, **k))[1]
    return apply_parallelism(model, config, ctx), calls


def test_chunk_batch_slices_under_one_unshard_with_the_same_numbers():
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from fsdp2_backend.distributed.context import ParallelContext

    ctx = ParallelContext.create(Config().parallel)
    try:
        ids = torch.randint(0, 100, (5, 12), generator=torch.Generator().manual_seed(1))
        results = {}
        for chunk in (False, True):
            model, calls = _model(chunk, ctx)
            unshards = []
            original = FSDPParamGroup.unshard
            FSDPParamGroup.unshard = lambda self, *a, **k: (unshards.append(1), original(self, *a, **k))[1]
            try:
                logits = model(input_ids=ids, use_cache=False).logits  # as the trainer calls it
                logits.float().pow(2).mean().backward()
            finally:
                FSDPParamGroup.unshard = original
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            results[chunk] = (logits.detach(), grads, calls, len(unshards))
        plain, chunked = results[False], results[True]
        torch.testing.assert_close(chunked[0], plain[0], rtol=1e-5, atol=1e-6)
        for name in plain[1]:
            torch.testing.assert_close(chunked[1][name], plain[1][name], rtol=1e-4, atol=1e-6)
        # forward + recomputation: each layer's module call sees the whole batch, its forward 3 slices of 2, 2, 1
        assert [c for c in chunked[2] if isinstance(c, tuple)][:3] == [("slice", 2), ("slice", 2), ("slice", 1)]
        assert [c for c in plain[2] if isinstance(c, tuple)][:1] == [("slice", 5)]
        assert chunked[3] == plain[3]  # slicing adds no all-gather
    finally:
        ctx.close()


def test_fused_adamw_is_adamws_update_and_deterministic_switches():
    from fsdp2_backend.training.determinism import set_deterministic
    from fsdp2_backend.training.optimizer import build_optimizer

    params = {}
    for name in ("adamw", "fused_adamw"):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        optimizer = build_optimizer(model, name=name, lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            model(torch.ones(2, 8)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        params[name] = [p.detach().clone() for p in model.parameters()]
        inner = optimizer.optimizers[0] if hasattr(optimizer, "optimizers") else optimizer
        assert bool(inner.defaults.get("fused")) == (name == "fused_adamw")
    for a, b in zip(params["adamw"], params["fused_adamw"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        set_deterministic(False)
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)
