"""The triton gated delta rule (`kernels.gated_delta_rule_triton`: fused recurrent forward and backward kernels) on
CPU tensors under the triton interpreter, in a fresh process: values, final states and
gradients against the float64 sequential oracle of `tests/kernels/test_gated_delta_rule.py` — lengths not a multiple of
any block, value dims split over several programs, grouped value heads with q/k l2 norm, packed documents with
per-document initial states, fp32 and bf16 inputs; and the dispatch's choice on each device.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fsdp2_backend.kernels.gated_delta_rule import gdn_implementation

REPO = Path(__file__).resolve().parents[2]

CHECK = r"""
import torch
from tests.support.kernel_references import gdn_grads as _grads, gdn_inputs as _inputs
from tests.support.kernel_references import sequential_gated_delta_rule as oracle
from fsdp2_backend.kernels.gated_delta_rule_triton import triton_chunk_gated_delta_rule as gdn

def close(a, b, tol, msg=""):
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol, msg=msg)

# unpacked, initial + final state; dv 40 = two value blocks of 32 (the second partly masked), dk 6 masked in 8
for batch, length, heads, dk, dv, chunk in [(2, 13, 3, 8, 6, 4), (1, 11, 2, 6, 40, 8)]:
    inputs = _inputs(batch, length, heads, dk, dv, torch.float32, seed=length)
    init = (torch.randn(batch, heads, dk, dv, generator=torch.Generator().manual_seed(1)) * 0.1).requires_grad_()
    out, final = gdn(*inputs, chunk_size=chunk, initial_state=init, output_final_state=True)
    want, want_final = oracle(*inputs, initial_state=init)
    close(out, want, 2e-5, "out"); close(final, want_final, 2e-5, "final")
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    loss = lambda o, f: (o.double() * weight.double()).sum() + f.double().pow(2).sum()
    got = torch.autograd.grad(loss(out, final), inputs + [init])
    exp = torch.autograd.grad(loss(want, want_final), inputs + [init])
    for name, a, b in zip("q k v g beta h0".split(), got, exp):
        close(a, b, 5e-5, f"grad of {name}")

# grouped value heads (4 value heads on 2 key heads) with the q/k l2 norm in the kernel
q, k, v, g, beta = _inputs(1, 10, 4, 8, 8, torch.float32, seed=5, k_heads=2)
out, _ = gdn(q, k, v, g, beta, chunk_size=4, use_qk_l2norm_in_kernel=True)
qn, kn = (torch.nn.functional.normalize(x.double(), dim=-1, eps=0).repeat_interleave(2, dim=2) for x in (q, k))
want, _ = oracle(qn, kn, v, g, beta)
close(out, want, 2e-5, "grouped")
weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
for a, b in zip(_grads(out, [q, k, v, g, beta], weight), _grads(want, [q, k, v, g, beta], weight.double())):
    close(a, b, 5e-5, "grouped grads")

# packed documents (lengths 3, 9, 1, 6, 5 over two rows of 12), one initial state per document; the loss reads
# the final states too, so the backward's final-state and initial-state gradients are checked per document
inputs = _inputs(2, 12, 2, 8, 4, torch.float32, seed=6)
cu = torch.tensor([0, 3, 12, 13, 19, 24], dtype=torch.int32)
init = (torch.randn(5, 2, 8, 4, generator=torch.Generator().manual_seed(7)) * 0.1).requires_grad_()
out, finals = gdn(*inputs, chunk_size=4, cu_seqlens=cu, initial_state=init, output_final_state=True)
flat_out = out.reshape(24, 2, 4)
flat = [x.reshape(1, 24, *x.shape[2:]) for x in inputs]
weight = torch.randn(flat_out.shape, generator=torch.Generator().manual_seed(8))
got = torch.autograd.grad((flat_out * weight).sum() + finals.pow(2).sum(), inputs + [init])
exp = [torch.zeros_like(x, dtype=torch.float64) for x in inputs + [init]]
for d in range(5):
    a, b = int(cu[d]), int(cu[d + 1])
    want, want_final = oracle(*[x[:, a:b] for x in flat], initial_state=init[d:d + 1])
    close(flat_out[a:b], want[0], 2e-5, f"doc {d}"); close(finals[d], want_final[0], 2e-5, f"final {d}")
    loss = (want[0] * weight[a:b].double()).sum() + want_final.pow(2).sum()
    for acc, grad in zip(exp, torch.autograd.grad(loss, inputs + [init], allow_unused=True)):
        if grad is not None:
            acc += grad
for name, a, b in zip("q k v g beta h0".split(), got, exp):
    close(a, b, 5e-5, f"packed grad of {name}")

# grouped value heads (6 on 2 key heads: three value heads add into each key head's dq / dk), packed documents,
# initial and final states, three value blocks (dv 72 = 32 + 32 + 8)
q, k, v, g, beta = _inputs(1, 9, 6, 4, 72, torch.float32, seed=9, k_heads=2)
cu = torch.tensor([0, 5, 9], dtype=torch.int32)
init = (torch.randn(2, 6, 4, 72, generator=torch.Generator().manual_seed(10)) * 0.1).requires_grad_()
out, finals = gdn(q, k, v, g, beta, chunk_size=4, cu_seqlens=cu, initial_state=init, output_final_state=True)
weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(11))
leaves = [q, k, v, g, beta, init]
got = torch.autograd.grad((out * weight).sum() + (finals * 0.5).pow(2).sum(), leaves)
exp = [torch.zeros_like(x, dtype=torch.float64) for x in leaves]
for d in range(2):
    a, b = int(cu[d]), int(cu[d + 1])
    qd, kd = (x[:, a:b].repeat_interleave(3, dim=2) for x in (q, k))
    want, want_final = oracle(qd, kd, v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=init[d:d + 1])
    close(out[:, a:b], want, 2e-5, f"grouped doc {d}")
    loss = (want * weight[:, a:b].double()).sum() + (want_final * 0.5).pow(2).sum()
    for acc, grad in zip(exp, torch.autograd.grad(loss, leaves, allow_unused=True)):
        if grad is not None:
            acc += grad
for name, a, b in zip("q k v g beta h0".split(), got, exp):
    close(a, b, 5e-5, f"grouped packed grad of {name}")

# bf16 inputs: fp32 inside, one bf16 rounding of the output
inputs = _inputs(1, 9, 2, 16, 16, torch.bfloat16, seed=3)
out, _ = gdn(*inputs, chunk_size=4)
want, _ = oracle(*inputs)
assert out.dtype == torch.bfloat16
torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=8e-3)
weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
for a, b in zip(_grads(out, inputs, weight), _grads(want, inputs, weight.double())):
    assert a.dtype == torch.bfloat16
    torch.testing.assert_close(a.double(), b.double(), atol=3e-2, rtol=2e-2)
print("ok")
"""


def test_triton_gdn_matches_the_oracle_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_dispatch_by_device():
    assert gdn_implementation("cuda", use_triton_gdn=True) == "triton"  # ours, or fla's when importable
    assert gdn_implementation("cpu", use_triton_gdn=True) == "torch"  # never the interpreter in a run
    assert gdn_implementation("cuda") == "torch"


def test_the_log_line_names_the_kernel_that_runs():
    from fsdp2_backend.config import OptimizationArguments
    from fsdp2_backend.models.qwen3_next.modeling import build_qwen3_next
    from fsdp2_backend.parallel.kernel_swaps import apply_fused_ops
    from fsdp2_backend.kernels.gated_delta_rule import fla_importable
    from tests.support.tiny_models import tiny_next_config

    model = build_qwen3_next(tiny_next_config())
    lines = {}
    for device in ("cuda", "cpu"):
        lines[device] = []
        apply_fused_ops(model, OptimizationArguments(use_triton_gdn=True), device, log=lines[device].append)
    assert not fla_importable()  # this project never installs flash-linear-attention
    assert lines["cuda"] == ["use_triton_gdn: this project's triton gated delta rule (kernels/gated_delta_rule_"
                             "triton.py; flash-linear-attention not installed) and triton causal conv1d in 3 Gated "
                             "DeltaNet layers on cuda"]
    assert lines["cpu"][0].startswith("use_triton_gdn: no triton Gated DeltaNet kernel on cpu")
