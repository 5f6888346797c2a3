"""Qwen3-Next under parallel layouts in-process: its config, tiny model, optimizer and the parallelised model for a
layout, shared by the Qwen3-Next parallel and packed context-parallel tests."""
from __future__ import annotations

import torch

from tests.support.tiny_models import tiny_next_config

STEPS, SAVE_AFTER, LR, SEQ, CHUNK = 8, 4, 5e-3, 16, 8


def next_config(**parallel):
    from fsdp2_backend.config import Config

    config = Config()
    config.model.model_id = "qwen3_next"
    config.optimization.gdn_chunk_size = CHUNK
    config.optimization.moe_grouped_gemm = True
    config.parallel.param_dtype = "fp32"
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    return config


def next_model(config, aux=True):
    from fsdp2_backend.models.registry import model_spec

    torch.manual_seed(0)
    model = model_spec("qwen3_next").build(tiny_next_config(output_router_logits=aux))
    return model


def next_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def configure_next(model, config):
    from fsdp2_backend.models.registry import model_spec

    model_spec("qwen3_next").configure(model, config, "cpu")


def next_parallel_model(config, aux=True):
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.parallel.apply import apply_parallelism

    ctx = ParallelContext.create(config.parallel)
    model = apply_parallelism(next_model(config, aux), config, ctx)
    return model, next_optimizer(model), ctx
