"""Continues a Megatron-LM run in this engine: puts what `megatron_compat.checkpoint.resume.read_megatron_state`
read from a Megatron-LM checkpoint (plain full tensors in HF names, the scheduler's and loss scaler's state, the
iteration, consumed samples and RNG state) into the built, parallelised run. Nothing here reads Megatron's files;
the reader is handed in by the build (`build.py`), so training never imports megatron_compat.

- Weights and Adam moments go through torch's ``set_state_dict`` with full tensors, so any FSDP / TP layout takes
  them; the Adam step is one counter for every parameter (Megatron's), in our optimizer's own dtypes.
- ``opt_param_scheduler`` loads into our ParamScheduler (same keys, counted in samples).
- fp16's grad scaler (scale, growth and hysteresis trackers) maps onto our dynamic loss scaler.
- RNG: Python's ``random``, numpy's and torch's CPU generator, and the CUDA one when this run is on CUDA.
"""
from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch

from fsdp2_backend.distributed.console import print_rank0
from fsdp2_backend.usage_errors import UsageError


def apply_megatron_state(state: Any, model, optimizer=None, scheduler=None, train_state=None,
                         loss_scaler=None) -> None:
    """Sets ``state`` (a MegatronState) into the run (collective: every rank sets its shards)."""
    _set_states(model, optimizer if state.moments is not None else None, dict(state.weights), state.config,
                state.moments, state.step)
    if state.moments is not None:
        if scheduler is not None and state.scheduler is not None:
            scheduler.load_state_dict(state.scheduler)
        if loss_scaler is not None and loss_scaler.dynamic and state.grad_scaler is not None:
            loss_scaler.load_state_dict(state.grad_scaler)
    if train_state is not None and not state.finetune:
        train_state.iteration = state.iteration
        train_state.consumed_train_samples = state.consumed_train_samples
        train_state.consumed_valid_samples = state.consumed_valid_samples
    if state.rng is not None:
        random.setstate(state.rng["random_rng_state"])
        np.random.set_state(state.rng["np_rng_state"])
        torch.set_rng_state(state.rng["torch_rng_state"])
        if torch.cuda.is_available() and torch.cuda.is_initialized() and "cuda_rng_state" in state.rng:
            torch.cuda.set_rng_state(state.rng["cuda_rng_state"])
    print_rank0(f"  successfully loaded checkpoint from {state.where.parent} at iteration {state.iteration}"
                + (" (weights only: --finetune)" if state.finetune else ""))


def _set_states(model, optimizer, hf_weights: dict, config, moments: Optional[dict], step: Optional[int]) -> None:
    """Full (unsharded) tensors in HF names into the model and, with ``moments`` ({exp_avg / exp_avg_sq: {HF name:
    tensor}}), the optimizer: torch's ``set_state_dict`` shards them onto whatever FSDP / TP layout the run has."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    expected = set(model.state_dict())
    if config.tie_word_embeddings and "lm_head.weight" in expected:
        hf_weights["lm_head.weight"] = hf_weights["model.embed_tokens.weight"]
    missing, extra = sorted(expected - set(hf_weights)), sorted(set(hf_weights) - expected)
    mtp = sorted({int(k.split(".")[2]) for k in extra if k.startswith("mtp.layers.")})
    if mtp and not missing and all(k.startswith("mtp.layers.") for k in extra):  # trained MTP layers this run lacks
        built = len({k.split(".")[2] for k in expected if k.startswith("mtp.layers.")})
        raise UsageError(f"--mtp-num-layers: the Megatron-LM checkpoint has {len(mtp)} MTP layer(s), this run builds "
                         f"{built} — give --mtp-num-layers {len(mtp)} as its run did (Megatron-LM, too, loads every "
                         f"saved layer)")
    if missing or extra:
        raise UsageError(f"the Megatron-LM checkpoint does not fill this model: missing {missing[:3]}, unexpected "
                         f"{extra[:3]} — drop the model flags that add layers (e.g. --mtp-num-layers)")
    full = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        set_model_state_dict(model, hf_weights, options=full)
        return
    # The structure (FQN keys, our param groups); its state dicts are the optimizer's own: build new ones.
    _, current = get_state_dict(model, optimizer)
    optim_sd = {"state": {}, "param_groups": [dict(group) for group in current["param_groups"]]}
    for fqn in current["state"]:
        if fqn not in moments["exp_avg"]:
            raise UsageError(f"the Megatron-LM checkpoint has no Adam state for {fqn} — resume with --no-load-optim")
        own = current["state"][fqn]  # our optimizer's dtypes (fp32, or bf16 states under --o2-optimizer)
        optim_sd["state"][fqn] = {
            "step": torch.tensor(float(step), dtype=own["step"].dtype if torch.is_tensor(own.get("step"))
                                 else torch.float32),
            **{kind: moments[kind][fqn].to(own[kind].dtype if kind in own else torch.float32) for kind in moments}}
    set_state_dict(model, optimizer, model_state_dict=hf_weights, optim_state_dict=optim_sd, options=full)


__all__ = ["apply_megatron_state"]
