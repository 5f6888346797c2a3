"""Fused-kernel flags: the torch references against transformers' own RMSNorm / RoPE, the triton RMSNorm kernel
against the reference under the triton interpreter, and a model with every flag on against the same model with
them off (CPU: the same logits, one log line per flag). Reference: HF transformers' Qwen3 / Llama modules.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp2_backend.config import Config, OptimizationArguments
from fsdp2_backend.parallel.kernel_swaps import ROTARY_GLOBAL, apply_fused_ops
from fsdp2_backend.kernels import rotary
from fsdp2_backend.kernels.rmsnorm import rms_norm, rms_norm_implementation, rms_norm_reference
from tests.support.tiny_models import tiny_model_dir, tiny_qwen3_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[2]
ALL_ON = dict(use_fused_rmsnorm=True, use_fused_rotary_pos_emb=True, use_flash_attn=True, use_triton_gdn=True,
              use_triton_rmsnormgated=True, gdn_chunk_size=32)
FLAG_PREFIXES = ("use_fused_rmsnorm:", "use_fused_rotary_pos_emb:", "use_flash_attn:", "use_triton_gdn:",
                 "use_triton_rmsnormgated:", "gdn_chunk_size=32:")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_reference_rmsnorm_equals_hf_module(family, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    module = {"qwen3": Qwen3RMSNorm, "llama": LlamaRMSNorm}[family](48, eps=1e-5).to(dtype)
    nn.init.normal_(module.weight, 1.0, 0.1)
    x = torch.randn(3, 5, 48, dtype=dtype, requires_grad=True)
    expected = module(x)
    got = rms_norm_reference(x, module.weight, module.variance_epsilon)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    grad = torch.randn_like(expected)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, (x, module.weight), grad),
                                                  torch.autograd.grad(expected, (x, module.weight), grad)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_reference_rope_equals_hf_function(unsqueeze_dim, dtype):
    from transformers.models.qwen3 import modeling_qwen3

    config = tiny_qwen3_config()
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 10, config.head_dim
    shape = (b, h, s, d) if unsqueeze_dim == 1 else (b, s, h, d)
    q, k = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    positions = torch.arange(s).expand(b, s)
    cos, sin = modeling_qwen3.Qwen3RotaryEmbedding(config)(q, positions)
    expected = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    for fn in (rotary.apply_rotary_pos_emb_reference, rotary.apply_rotary_pos_emb):  # the dispatcher on CPU too
        got = fn(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        assert all(torch.equal(a, e) for a, e in zip(got, expected))


def test_dispatch_by_device():
    """CPU runs the reference (exactly); CUDA would run the triton RMSNorm kernel (triton imports here) and the
    RoPE reference (no triton RoPE kernel); NPU without torch_npu runs the reference."""
    assert rms_norm_implementation("cpu") == "torch" and rms_norm_implementation("npu") == "torch"
    assert rms_norm_implementation("cuda") == "triton"
    assert {rotary.rotary_implementation(d) for d in ("cpu", "cuda", "npu")} == {"torch"}
    x, w = torch.randn(4, 32), torch.randn(32)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


TRITON_CHECK = r"""
import torch
from fsdp2_backend.kernels.rmsnorm import rms_norm_reference
from fsdp2_backend.kernels.rmsnorm_triton import triton_rms_norm

torch.manual_seed(0)
# rows > the backward's program count (4 here) exercise its row loop; 48 and 100 are not powers of two (masking)
for shape, dtype, tol in [((2, 7, 48), torch.float32, 1e-5), ((37, 100), torch.float32, 1e-5),
                          ((5, 64), torch.float16, 2e-3), ((0, 16), torch.float32, 0.0)]:
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype).requires_grad_()
    got, ref = triton_rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, ref.dtype)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    grad = torch.randn_like(ref)
    for a, b, name in zip(torch.autograd.grad(got, (x, w), grad), torch.autograd.grad(ref, (x, w), grad), "xw"):
        torch.testing.assert_close(a, b, rtol=4 * tol, atol=4 * tol, msg=f"d{name} {shape} {dtype}")
print("ok")
"""


def test_triton_rmsnorm_matches_reference_under_interpreter():
    """The kernel itself (forward and backward), on CPU tensors under TRITON_INTERPRET=1 in a fresh interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def _logits_and_grads(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_all_flags_on_cpu_give_the_same_model_and_say_so_once_per_flag():
    from transformers import Qwen3ForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    torch.manual_seed(0)
    plain = Qwen3ForCausalLM(tiny_qwen3_config())
    fused = Qwen3ForCausalLM(tiny_qwen3_config())
    fused.load_state_dict(plain.state_dict())
    lines = []
    apply_fused_ops(fused, OptimizationArguments(**ALL_ON), "cpu", log=lines.append)
    assert len(lines) == len(FLAG_PREFIXES) and all(any(l.startswith(p) for l in lines) for p in FLAG_PREFIXES), lines
    text = "\n".join(lines)
    assert "use_fused_rmsnorm: no fused kernel on cpu — running the torch reference" in text
    assert "use_fused_rotary_pos_emb: no fused kernel on cpu — running the torch reference" in text
    assert "use_flash_attn: no flash attention kernel on cpu — running the model's 'sdpa' attention" in text
    assert sum("no Gated DeltaNet layers — no effect" in line for line in lines) == 3

    # the swaps are real: every RMSNorm and every attention module of this model runs our kernels' entry points
    norms = [m for m in fused.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert norms and all("forward" in vars(m) for m in norms)
    attentions = [m for m in fused.modules() if isinstance(m, modeling_qwen3.Qwen3Attention)]
    assert attentions and all(
        inspect.unwrap(m.forward).__globals__[ROTARY_GLOBAL] is rotary.apply_rotary_pos_emb for m in attentions)
    # ...and nothing else changed: HF's module global and the other model are untouched
    assert modeling_qwen3.apply_rotary_pos_emb is not rotary.apply_rotary_pos_emb
    assert not any("forward" in vars(m) for m in plain.modules())

    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    logits, grads = _logits_and_grads(fused, ids)
    ref_logits, ref_grads = _logits_and_grads(plain, ids)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_flags_off_change_nothing_and_log_nothing():
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(tiny_qwen3_config())
    lines = []
    apply_fused_ops(model, OptimizationArguments(), "cpu", log=lines.append)
    assert lines == [] and not any("forward" in vars(m) for m in model.modules())


class OffsetRMSNorm(nn.Module):
    """A Gemma-style norm (scales by 1 + weight): the same attribute names, other math."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_rmsnorm_with_other_math_keeps_its_forward():
    model = nn.Sequential(OffsetRMSNorm(8))
    lines = []
    apply_fused_ops(model, OptimizationArguments(use_fused_rmsnorm=True), "cuda", log=lines.append)
    assert "forward" not in vars(model[0])
    assert lines == ["use_fused_rmsnorm: no plain RMSNorm modules in Sequential — no effect"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("qwen3_fused"), seed=3)


def test_engine_setup_applies_the_flags_once_on_a_meta_device_build(hf_dir, capsys):
    """Through the engine's `build_model` (FSDP on one rank, meta-device init): the same logits as
    transformers' own model of the directory, and the log lines once each on stdout."""
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.build import build_model
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.checkpoint.resume_point import ResumePoint

    config = Config()
    config.model.model_name_or_path = hf_dir
    config.model.init_model_with_meta_device = True
    config.parallel.param_dtype = "fp32"
    for key, value in ALL_ON.items():
        setattr(config.optimization, key, value)
    ctx = ParallelContext.create(config.parallel)
    try:
        capsys.readouterr()
        _, model, _ = build_model(config, ctx, ResumePoint(None, False, ""))
        out = capsys.readouterr().out
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        ids = torch.randint(0, 300, (2, 12))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)
    finally:
        ctx.close()
    for prefix in FLAG_PREFIXES:
        assert sum(line.startswith(prefix) for line in out.splitlines()) == 1, (prefix, out)


def _ulysses_worker(rank, world_size, out_path):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.parallel.context_parallel.attention import (ATTENTION_NAME, SPEC_ATTRIBUTE,
                                                                  enable_context_parallel)
    from fsdp2_backend.parallel.context_parallel.batch import cp_token_mean, shard_batch_for_cp, shift_labels

    def loss_sum(model, batch):
        logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="sum")

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    reference = Qwen3ForCausalLM(tiny_qwen3_config())
    model = Qwen3ForCausalLM(tiny_qwen3_config())
    model.load_state_dict(reference.state_dict())
    apply_fused_ops(model, OptimizationArguments(**ALL_ON), "cpu", log=lambda line: None)
    enable_context_parallel(model, mesh, "ulysses")  # after the kernel choices, as setup does
    attention = next(m for m in model.modules() if hasattr(m, SPEC_ATTRIBUTE))
    assert model.config._attn_implementation == ATTENTION_NAME  # context parallel's attention wins
    assert getattr(attention, SPEC_ATTRIBUTE).inner_attention == "sdpa"

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    full = {"input_ids": ids, "labels": shift_labels(ids)}
    ref_loss = loss_sum(reference, full) / (full["labels"] != -100).sum()
    ref_loss.backward()
    local = shard_batch_for_cp(full, rank, world_size, "ulysses")
    loss = cp_token_mean(loss_sum(model, local), (local["labels"] != -100).sum(), mesh.get_group())
    loss.backward()
    reported = loss.detach().clone()
    dist.all_reduce(reported)
    assert abs(reported.item() - ref_loss.item()) < 1e-5, (reported.item(), ref_loss.item())
    for (name, ref_p), p in zip(reference.named_parameters(), model.parameters()):
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, ref_p.grad, atol=1e-5, rtol=0, msg=name)
    if rank == 0:
        Path(out_path).write_text("ok")


def test_flags_compose_with_ulysses_context_parallel(tmp_path):
    """2 gloo ranks: every flag on, then Ulysses CP — loss and gradients equal one rank's plain model."""
    from tests.support.launchers import run_distributed

    out = tmp_path / "ok"
    run_distributed(_ulysses_worker, 2, str(out))
    assert out.read_text() == "ok"
