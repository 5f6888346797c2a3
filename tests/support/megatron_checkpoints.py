"""megatron-core 0.16.1 as the maker of real Megatron checkpoints: a 1-rank gloo group with the CUDA calls made
CPU-safe (the `megatron` fixture), a tiny Qwen3-like GPT built by megatron-core (`megatron_gpt`), its logits, its
save in Megatron-LM's formats (`save_megatron_checkpoint`: torch_dist, legacy torch, torch_dcp) with an args
namespace, and transformers' logits of a converted directory (`hf_logits`)."""
from __future__ import annotations

import argparse
import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.support.launchers import init_one_rank_group

VOCAB, SEQ = 128, 12


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's parallel state on a 1-rank gloo group (torn down after the module's tests)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        mp.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        init_one_rank_group()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        parallel_state.initialize_model_parallel()
        mp.setattr(get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def megatron_gpt(qk_layernorm: bool, tied: bool, seed: int, parallel_output: bool = True):
    """megatron-core's GPTModel (local spec) and the args namespace Megatron-LM would save with it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            ffn_hidden_size=96, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            qk_layernorm=qk_layernorm, layernorm_epsilon=1e-6, hidden_dropout=0.0,
                            attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
                            bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    torch.manual_seed(seed)
    model = GPTModel(cfg, get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="rope", rotary_base=10000,
                     share_embeddings_and_output_weights=tied, parallel_output=parallel_output)
    with torch.no_grad():  # norms start at 1: make them differ so a misplaced norm shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    args = argparse.Namespace(
        num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, kv_channels=16, normalization="RMSNorm", layernorm_epsilon=1e-6, swiglu=True,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=qk_layernorm, position_embedding_type="rope",
        rotary_base=10000, rotary_percent=1.0, max_position_embeddings=64, seq_length=SEQ,
        untie_embeddings_and_output_weights=not tied, padded_vocab_size=VOCAB, num_experts=None)
    return model.eval(), args


def megatron_logits(model, tokens):
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]  # True = masked, Megatron's way
    with torch.no_grad():
        return model(tokens, torch.arange(SEQ)[None].expand_as(tokens), attention_mask=mask)


def save_megatron_checkpoint(model, args, root, fmt: str) -> None:
    it_dir = root / "iter_0000005"
    if fmt == "torch_dist":
        from megatron.core import dist_checkpointing

        it_dir.mkdir(parents=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 5,
                                 "checkpoint_version": 3.0}, str(it_dir))
    elif fmt == "torch_dcp":  # Megatron-LM's save_checkpoint for --ckpt-format torch_dcp: DCP of the legacy dict
        from torch.distributed.checkpoint import FileSystemWriter, save

        it_dir.mkdir(parents=True)
        save({"args": args, "checkpoint_version": 3.0, "iteration": 5, "model": model.state_dict_for_save_checkpoint()},
             storage_writer=FileSystemWriter(str(it_dir)))
    else:
        (it_dir / "mp_rank_00").mkdir(parents=True)
        torch.save({"model": model.state_dict(), "args": args, "iteration": 5, "checkpoint_version": 3.0},
                   it_dir / "mp_rank_00" / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("5")


def hf_logits(out_dir, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model, model(tokens).logits


def megatron_enums(args):
    """The non-builtin values Megatron-LM's saved args hold (tests/data/megatron_genuine_args/*/args.json lists
    them): its AttnBackend and ModelType enums, read back as inert stand-ins, megatron never imported at load time
    (megatron_compat/checkpoint/safe_pickle.py); ``exit_signal`` (a signal.Signals); the torch dtypes."""
    import signal

    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    args.attention_backend, args.model_type = AttnBackend.auto, ModelType.encoder_or_decoder
    args.exit_signal, args.params_dtype, args.main_grads_dtype = signal.SIGTERM, torch.float32, torch.float32


def _split_fc1(name: str, value):
    """{name_w: gate, name_v: up} for a gated fc1 (handle_swiglu_in_state_dict's split), else {name: value}."""
    if ".linear_fc1.weight" in name or ".linear_fc1.bias" in name:
        gate, up = value.chunk(2, dim=0)
        return {f"{name}_w": gate.clone(), f"{name}_v": up.clone()}
    return {name: value}


def fsdp_dtensor_save(it_dir, args, model, iteration, optimizer_state=None, scheduler=None, rng=None):
    """Megatron-LM's save_checkpoint for --ckpt-format fsdp_dtensor, one rank: ``optimizer_state`` is
    {Megatron parameter name: {exp_avg, exp_avg_sq, step}} (torch AdamW's per-parameter state)."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    args.ckpt_format, args.use_megatron_fsdp = "fsdp_dtensor", True
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": {}}
    for name, value in model.state_dict().items():
        if "_extra_state" not in name:  # handle_fp8_extra_state_case drops them
            state["model"].update(_split_fc1(f"module.{name}", value.detach().clone()))
    if optimizer_state is not None:
        opt = {}
        for name, entry in optimizer_state.items():
            for kind in ("exp_avg", "exp_avg_sq"):  # the moments split like the weights, the step copied
                for half, value in _split_fc1(name, entry[kind]).items():
                    opt.setdefault(f"module.module.{half}", {"step": entry["step"].clone()})[kind] = value.clone()
        meta = {f"module.module.{n}": {"wd_mult": 0.0 if n.endswith("norm.weight") else 1.0, "lr_mult": 1.0}
                for n in optimizer_state}
        state["optimizer"] = {"state": opt, "param_to_group_meta": meta}
        state["opt_param_scheduler"] = scheduler
    if rng is not None:
        state["rng_state"] = {"(0, 0)": [rng]}
    it_dir.mkdir(parents=True)
    save(state, storage_writer=FileSystemWriter(str(it_dir)))
    (it_dir.parent / "latest_checkpointed_iteration.txt").write_text(str(iteration))
