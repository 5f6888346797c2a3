"""Megatron-LM checkpoints written by megatron-core 0.16.1 itself convert to an HF directory with equal logits.

megatron-core builds a tiny Qwen3-like GPT (GQA, q/k layer norms, SwiGLU, RMSNorm, RoPE) on CPU (1-rank gloo
group; `torch.cuda.current_device` / `synchronize` made CPU-safe and the dropout RNG fork a no-op — dropout is 0)
and saves it with `dist_checkpointing.save` (torch_dist), as a legacy `mp_rank_00/model_optim_rng.pt` and as
Megatron-LM's `--ckpt-format torch_dcp` (its save_checkpoint's torch.distributed.checkpoint.save of the legacy
dict: megatron-core has no writer for it), with
a Megatron-style `args` namespace; `tools/convert_checkpoint.py` converts each, and transformers' model from the
output gives megatron-core's logits on the same tokens.
"""
import contextlib
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.support.launchers import run_distributed
from tests.support.megatron_checkpoints import (SEQ, VOCAB, hf_logits, megatron_enums, megatron_gpt, megatron_logits,
                                                save_megatron_checkpoint)
from tests.support.megatron_checkpoints import megatron  # noqa: F401  (pytest fixture)

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


@pytest.mark.parametrize("fmt,qk_layernorm,tied", [("torch_dist", True, False), ("torch", True, False),
                                                   ("torch_dist", False, True), ("torch_dcp", True, True)])
def test_megatron_checkpoint_converts_with_equal_logits(megatron, tmp_path, fmt, qk_layernorm, tied):
    from fsdp2_backend.checkpoint import formats
    from fsdp2_backend.checkpoint.resume_point import resume_point
    from fsdp2_backend.cli.convert_checkpoint import main as convert

    model, args = megatron_gpt(qk_layernorm, tied, seed=3)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = megatron_logits(model, tokens)
    megatron_enums(args)
    save_megatron_checkpoint(model, args, tmp_path / "mg", fmt)
    convert([str(tmp_path / "mg"), str(tmp_path / "hf")])
    hf_model, got = hf_logits(tmp_path / "hf", tokens)
    assert hf_model.config.model_type == ("qwen3" if qk_layernorm else "llama")
    assert hf_model.config.tie_word_embeddings == tied
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # --load of the Megatron-LM directory itself resumes from its iteration directory (tests/megatron_compat/test_megatron_resume.py)
    resume = resume_point(str(tmp_path / "new"), str(tmp_path / "mg"))
    assert resume.checkpoint == tmp_path / "mg" / "iter_0000005"
    assert resume.format is {"torch_dist": formats.MEGATRON_TORCH_DIST, "torch": formats.MEGATRON_LEGACY,
                             "torch_dcp": formats.MEGATRON_TORCH_DCP}[fmt]


def test_a_checkpoint_it_cannot_convert_is_one_error_line_exit_2(megatron, tmp_path):
    """An MLA run's args (and a missing checkpoint) are declined by the tool: exit 2, one error line (MoE ones
    convert: tests/megatron_compat/test_megatron_import_moe.py)."""
    import subprocess
    import sys

    from tests.support.launchers import REPO

    model, args = megatron_gpt(True, False, seed=4)
    args.multi_latent_attention = True
    save_megatron_checkpoint(model, args, tmp_path / "mg", "torch")
    for source, words in ((tmp_path / "mg", "multi-latent attention (--multi-latent-attention)"), (tmp_path / "nothing", "no complete")):
        result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"), str(source),
                                 str(tmp_path / "hf")], capture_output=True, text=True)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("error: ") and words in result.stderr and "Traceback" not in result.stderr


def test_qkv_split_matches_hand_written_interleaving():
    """linear_qkv rows [g0: q0 q1 k0 v0 | g1: q2 q3 k1 v1] (head_dim rows each) become q, k and v."""
    from transformers import AutoConfig

    from megatron_compat.checkpoint.convert import to_hf_state_dict

    hd, hidden = 2, 8
    heads = {name: torch.full((hd, hidden), float(i)) for i, name in
             enumerate(["q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1"])}
    qkv = torch.cat([heads[n] for n in ["q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1"]])
    state = {"embedding.word_embeddings.weight": torch.zeros(5, hidden), "decoder.final_layernorm.weight":
             torch.ones(hidden), "decoder.layers.0.self_attention.linear_qkv.weight": qkv,
             "decoder.layers.0.self_attention.linear_proj.weight": torch.zeros(hidden, 4 * hd),
             "decoder.layers.0.mlp.linear_fc1.weight": torch.cat([torch.zeros(4, hidden), torch.ones(4, hidden)]),
             "decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(hidden, 4)}
    config = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2, head_dim=hd,
                                  hidden_size=hidden, num_hidden_layers=1, tie_word_embeddings=True)
    out = to_hf_state_dict(state, config)
    cat = lambda *names: torch.cat([heads[n] for n in names])  # noqa: E731
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight"], cat("q0", "q1", "q2", "q3"))
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"], cat("k0", "k1"))
    assert torch.equal(out["model.layers.0.self_attn.v_proj.weight"], cat("v0", "v1"))
    assert torch.equal(out["model.layers.0.mlp.gate_proj.weight"], torch.zeros(4, hidden))
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], torch.ones(4, hidden))


def _tp2_rank(rank, world_size, root):
    """One rank of megatron-core at tensor-parallel 2: its logits (gathered) and a torch_dist save."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.cuda.current_device = lambda: "cpu"  # this process is a throwaway rank: patched for its lifetime
    torch.cuda.synchronize = lambda *a, **k: None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    model, args = megatron_gpt(qk_layernorm=True, tied=False, seed=5, parallel_output=False)
    args.tensor_model_parallel_size = 2
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    logits = megatron_logits(model, tokens)
    it_dir = os.path.join(root, "mg", "iter_0000005")
    os.makedirs(it_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 5}, it_dir)
    legacy = os.path.join(root, "legacy", "iter_0000005", f"mp_rank_{rank:02d}")  # Megatron's legacy TP save
    os.makedirs(legacy)
    torch.save({"model": model.state_dict(), "args": args, "iteration": 5}, os.path.join(legacy, "model_optim_rng.pt"))
    if rank == 0:
        torch.save({"tokens": tokens, "logits": logits}, os.path.join(root, "reference.pt"))
        with open(os.path.join(root, "mg", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("5")
    parallel_state.destroy_model_parallel()


def test_a_tensor_parallel_checkpoint_converts_with_equal_logits(tmp_path):
    """A TP=2 save (qkv, fc1 gate/up, proj, fc2, embedding and output layer sharded per rank), in torch_dist
    (global tensors) and in the legacy format (mp_rank_00, mp_rank_01: merged here), reads as one model."""
    from fsdp2_backend.cli.convert_checkpoint import main as convert

    run_distributed(_tp2_rank, 2, str(tmp_path))
    reference = torch.load(tmp_path / "reference.pt")
    for fmt in ("mg", "legacy"):
        convert([str(tmp_path / fmt), str(tmp_path / f"hf_{fmt}")])
        _, got = hf_logits(tmp_path / f"hf_{fmt}", reference["tokens"])
        torch.testing.assert_close(got, reference["logits"], rtol=0, atol=1e-5, msg=fmt)

