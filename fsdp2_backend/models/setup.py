"""The run's tokenizer and parallelised model, from the config and the ParallelContext, in one call."""
from __future__ import annotations

from typing import NamedTuple

from torch import nn

from fsdp2_backend.config import Config
from fsdp2_backend.distributed.context import ParallelContext
from fsdp2_backend.models.fused_ops import apply_fused_ops
from fsdp2_backend.models.loading import create_model, load_hf_config, weights_available
from fsdp2_backend.models.registry import model_spec
from fsdp2_backend.models.tokenizer import load_tokenizer, model_vocab_size, noise_init_rows
from fsdp2_backend.parallel.apply import apply_parallelism


class ModelBundle(NamedTuple):
    model: nn.Module
    tokenizer: object
    hf_config: object


def setup_model_and_tokenizer(config: Config, ctx: ParallelContext) -> ModelBundle:
    """Tokenizer, then the HF config with its vocabulary sized for it, then the parallelised model."""
    tokenizer = load_tokenizer(config.model)
    hf_config = load_hf_config(config.model)
    from_checkpoint = weights_available(config.model)
    config_vocab = hf_config.vocab_size
    if not from_checkpoint and config.model.architecture and not config.model.architecture.get("vocab_size"):
        config_vocab = None  # Megatron sizes a from-scratch model by its tokenizer
    hf_config.vocab_size = model_vocab_size(config.model, config_vocab, tokenizer, from_checkpoint=from_checkpoint,
                                            tp_size=ctx.layout.tp)
    spec = model_spec(config.model.model_id) if config.model.model_id else None

    def parallelize(model: nn.Module) -> nn.Module:
        # Kernel choices first: context parallel, applied below, wraps the attention chosen here.
        apply_fused_ops(model, config.optimization, ctx.device.type)
        if spec is not None and spec.configure is not None:
            spec.configure(model, config)  # the run's switches, before any stage wraps modules
        return apply_parallelism(model, config, ctx)

    model = create_model(config.model, hf_config, seed=config.training.seed, device=ctx.device.torch_device,
                         parallelize=parallelize, new_rows=noise_init_rows(config.training.seed))
    return ModelBundle(model=model, tokenizer=tokenizer, hf_config=hf_config)
