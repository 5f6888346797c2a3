"""The one accelerator check: triton kernels for real, and the engine's throughput beside a bare FSDP2 loop.

    python benchmarks/gpu_check.py          # one CUDA GPU (benchmarks/gpu_check.sh runs it), well under 8 minutes
    python benchmarks/gpu_check.py --dry    # CPU, tiny shapes, seconds: the same steps, for CI

1. Triton kernels on the GPU (not the interpreter): RMSNorm, gated RMSNorm, the gated delta rule and the causal
   conv1d, forward and backward, fp32 and bf16, against their torch references (--dry: fp32 under the triton
   interpreter, TRITON_INTERPRET=1).
2. A Qwen3-1.7B-shaped model (hidden 2048, 16 heads / 8 KV heads of 128, SwiGLU 6144, vocab 151936; 8 of its 28
   layers) trained through the real entry point, pretrain_fsdp2.py, on one rank with Megatron flags: mock data,
   bf16, FSDP2, --use-flash-attn (SDPA) and --use-fused-rmsnorm, --log-throughput. Its log lines give tokens/s,
   TFLOP/s and MFU.
3. The same model (transformers' Qwen3ForCausalLM, SDPA) under a bare `fully_shard` loop (bf16 params, fp32
   reduce, AdamW) in this process: the same three figures, measured in the same run, and the ratio engine / bare.
3b. The engine run of 2. again with --optimization.torch_compile (each decoder block compiled once,
   parallel/compile.py): the same three figures, its first logging interval (which holds the compile) left out,
   and the ratio compiled / eager.
4. Offload: the engine run of 2. again for 4 steps with --optimizer-cpu-offload and --cpu-offloading-num-layers
   (every layer): the device's peak memory with and without (the log lines' figure), and tokens/s.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fsdp2_backend.training.logging import parse_train_line  # noqa: E402
from fsdp2_backend.training.throughput import model_flops_per_token, peak_device_flops  # noqa: E402

SHAPES = {  # Qwen3-1.7B's layer shape; --dry: a tiny one
    "gpu": dict(layers=8, hidden=2048, ffn=6144, heads=16, kv_heads=8, head_dim=128, vocab=151936, seq=4096,
                mbs=2, iters=30, log_interval=5),
    "dry": dict(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=256, seq=64, mbs=2,
                iters=4, log_interval=1),
}


def check_kernels(device: str = "cuda", shape=(4, 512, 256), dtypes=(torch.float32, torch.bfloat16)) -> None:
    from fsdp2_backend.kernels.rmsnorm import rms_norm_reference
    from fsdp2_backend.kernels.rmsnorm_gated import rms_norm_gated_reference
    from fsdp2_backend.kernels.rmsnorm_gated_triton import triton_rms_norm_gated
    from fsdp2_backend.kernels.rmsnorm_triton import triton_rms_norm

    torch.manual_seed(0)
    cases = [("rmsnorm", triton_rms_norm, rms_norm_reference,
              lambda x: (x, torch.randn(x.shape[-1], device=device)), {}),
             ("rmsnorm_gated", triton_rms_norm_gated, rms_norm_gated_reference,
              lambda x: (x, torch.randn_like(x), torch.randn(x.shape[-1], device=device)), {"group_size": 64})]
    for name, kernel, reference, make, kwargs in cases:
        for dtype in dtypes:
            args = [a.to(dtype) for a in make(torch.randn(*shape, device=device))]  # bf16 weights, as FSDP's
            outs = []
            for fn in (kernel, reference):
                leaves = [a.detach().clone().requires_grad_() for a in args]
                out = fn(*leaves, 1e-6, **kwargs)
                out.float().pow(2).sum().backward()
                outs.append([out.float()] + [leaf.grad.float() for leaf in leaves])
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            for got, want in zip(*outs):
                err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
                assert err < tol, f"{name} {dtype}: relative error {err:.2e}"
            where = torch.cuda.get_device_name() if device == "cuda" else "the triton interpreter (cpu)"
            print(f"kernel {name} {str(dtype)[6:]}: triton on {where} matches the torch reference (forward and "
                  "backward)")


def check_gdn(device: str = "cuda", length: int = 1000, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """The triton gated delta rule (kernels/gated_delta_rule_triton.py) against the torch chunked reference: two
    rows packed as three documents (one crossing the row boundary), grouped value heads, initial / final states."""
    from fsdp2_backend.kernels.gated_delta_rule import chunk_gated_delta_rule_reference
    from fsdp2_backend.kernels.gated_delta_rule_triton import triton_chunk_gated_delta_rule

    gen = torch.Generator(device=device).manual_seed(0)
    dk = dv = 128 if device == "cuda" else 8
    cu = torch.tensor([0, length // 3, length + 7, 2 * length], dtype=torch.int32, device=device)
    for dtype in dtypes:
        base = [torch.randn(2, length, 2, dk, generator=gen, device=device),
                torch.nn.functional.normalize(torch.randn(2, length, 2, dk, generator=gen, device=device), dim=-1),
                torch.randn(2, length, 4, dv, generator=gen, device=device),
                -torch.rand(2, length, 4, generator=gen, device=device) * 0.5,
                torch.rand(2, length, 4, generator=gen, device=device)]
        init = torch.randn(3, 4, dk, dv, generator=gen, device=device) * 0.1
        outs = []
        for fn in (triton_chunk_gated_delta_rule, chunk_gated_delta_rule_reference):
            leaves = [x.to(dtype).requires_grad_() for x in base] + [init.clone().requires_grad_()]
            out, final = fn(*leaves[:5], chunk_size=16, initial_state=leaves[5], output_final_state=True,
                            cu_seqlens=cu)
            (out.float().pow(2).sum() + final.pow(2).sum()).backward()
            outs.append([out.float(), final] + [leaf.grad.float() for leaf in leaves])
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for got, want in zip(*outs):
            err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
            assert err < tol, f"gated_delta_rule {dtype}: relative error {err:.2e}"
        where = torch.cuda.get_device_name() if device == "cuda" else "the triton interpreter (cpu)"
        print(f"kernel gated_delta_rule {str(dtype)[6:]}: triton on {where} matches the torch reference (forward "
              "and backward)")


def check_conv1d(device: str = "cuda", length: int = 1000, channels: int = 1536,
                 dtypes=(torch.float32, torch.bfloat16)) -> None:
    """The triton causal conv1d (kernels/causal_conv1d_triton.py, SiLU) against the torch reference: two rows
    packed as three documents (one crossing the row boundary), with bias; output, dx, dweight, dbias."""
    from fsdp2_backend.kernels.causal_conv1d import causal_conv1d_reference
    from fsdp2_backend.kernels.causal_conv1d_triton import triton_causal_conv1d

    gen = torch.Generator(device=device).manual_seed(0)
    cu = torch.tensor([0, length // 3, length + 7, 2 * length], dtype=torch.int32, device=device)
    base = [torch.randn(2, length, channels, generator=gen, device=device),
            torch.randn(channels, 4, generator=gen, device=device) * 0.5,
            torch.randn(channels, generator=gen, device=device)]
    for dtype in dtypes:
        outs = []
        for fn in (triton_causal_conv1d, causal_conv1d_reference):
            leaves = [x.to(dtype).requires_grad_() for x in base]
            out = fn(*leaves, "silu", cu)
            out.float().pow(2).sum().backward()
            outs.append([out.float()] + [leaf.grad.float() for leaf in leaves])
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for got, want in zip(*outs):
            err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
            assert err < tol, f"causal_conv1d {dtype}: relative error {err:.2e}"
        where = torch.cuda.get_device_name() if device == "cuda" else "the triton interpreter (cpu)"
        print(f"kernel causal_conv1d {str(dtype)[6:]}: triton on {where} matches the torch reference (forward and "
              "backward)")


def engine_run(shape: dict, dry: bool, extra: str = "", iters: int = 0) -> dict:
    s = dict(shape, iters=iters or shape["iters"])
    flags = (f"--num-layers {s['layers']} --hidden-size {s['hidden']} --ffn-hidden-size {s['ffn']} "
             f"--num-attention-heads {s['heads']} --group-query-attention --num-query-groups {s['kv_heads']} "
             f"--kv-channels {s['head_dim']} --qk-layernorm --seq-length {s['seq']} "
             f"--max-position-embeddings {s['seq']} --micro-batch-size {s['mbs']} --global-batch-size {s['mbs']} "
             f"--train-iters {s['iters']} --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 1 "
             f"--mock-data --tokenizer-type NullTokenizer --vocab-size {s['vocab']} --swiglu --normalization RMSNorm "
             "--disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights "
             "--attention-dropout 0 --hidden-dropout 0 --eval-iters 0 --bf16 --use-flash-attn --use-fused-rmsnorm "
             f"--log-throughput --log-interval {s['log_interval']} {extra}").split()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=420)
    if proc.returncode != 0:
        sys.exit(f"engine run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    lines = [parse_train_line(line) for line in proc.stdout.splitlines()]
    lines = [line for line in lines if line is not None]
    steady = lines[1:] or lines  # the first interval holds compilation and allocator warm-up
    return {"tokens/s": statistics.median(line["tokens_per_sec_per_device"] for line in steady),
            "TFLOP/s": statistics.median(line["tflops"] for line in steady),
            "MFU %": steady[-1]["mfu_percent"], "peak GiB": max(line["peak_memory_gib"] or 0 for line in lines)}


# --optimizer-cpu-offload: parameters, gradients and AdamW state on the host (FSDP2 CPUOffloadPolicy), the step
# there; --cpu-offloading-num-layers: every layer's saved activations on the host
COMPILE = "--optimization.torch_compile True"  # regional compilation of the decoder blocks
OFFLOAD = "--optimizer-cpu-offload --cpu-offloading-num-layers {layers}"


def bare_run(shape: dict, device: torch.device) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = shape
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("GPU_CHECK_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    config = Qwen3Config(hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                         vocab_size=s["vocab"], max_position_embeddings=s["seq"], tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, s["vocab"], (s["mbs"], s["seq"]), device=device)
    times = []
    for _ in range(s["iters"]):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    step = statistics.median(times[1:] or times)
    tokens = s["mbs"] * s["seq"]
    flops = model_flops_per_token(config, s["seq"]) * tokens / step
    peak = peak_device_flops(device)
    return {"tokens/s": tokens / step, "TFLOP/s": flops / 1e12, "MFU %": 100 * flops / peak if peak else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes (also GPU_CHECK_DRY=1)")
    dry = parser.parse_args().dry or os.environ.get("GPU_CHECK_DRY") == "1"
    if not dry and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device — run it on a GPU machine, or --dry on CPU")
    device = torch.device("cpu" if dry else "cuda")
    shape = SHAPES["dry" if dry else "gpu"]
    started = time.time()
    if dry:  # the same checks under the triton interpreter (fp32 only: its bf16 math is not the GPU's)
        check_kernels("cpu", shape=(2, 4, 128), dtypes=(torch.float32,))
        check_gdn("cpu", length=12, dtypes=(torch.float32,))
        check_conv1d("cpu", length=12, channels=12, dtypes=(torch.float32,))
    else:
        check_kernels()
        check_gdn()
        check_conv1d()
    engine = engine_run(shape, dry)
    compiled = engine_run(shape, dry, COMPILE)
    # a few steps suffice for the memory figure (the host-side AdamW step is slow on a 1.7B-shaped model)
    offloaded = engine_run(shape, dry, OFFLOAD.format(layers=shape["layers"]), iters=min(shape["iters"], 4))
    bare = bare_run(shape, device)
    print(f"model: Qwen3-1.7B-shaped, {shape['layers']} layers, seq {shape['seq']}, micro-batch {shape['mbs']}, "
          f"on {torch.cuda.get_device_name() if not dry else 'cpu (dry)'}")
    for name, figures in (("engine (pretrain_fsdp2.py)", engine), ("engine, compiled blocks", compiled),
                          ("bare fully_shard loop", bare)):
        mfu = "n/a" if figures["MFU %"] is None else f"{figures['MFU %']:.1f}"
        print(f"{name:<28} tokens/s {figures['tokens/s']:>12.1f}   TFLOP/s {figures['TFLOP/s']:>8.2f}   MFU % {mfu}")
    print(f"engine / bare tokens/s: {engine['tokens/s'] / bare['tokens/s']:.2f}")
    print(f"compiled / eager tokens/s: {compiled['tokens/s'] / engine['tokens/s']:.2f}; "
          f"compiled / bare tokens/s: {compiled['tokens/s'] / bare['tokens/s']:.2f}")
    print(f"offload: device peak memory GiB {engine['peak GiB']:.2f} without, {offloaded['peak GiB']:.2f} with "
          f"{OFFLOAD.format(layers=shape['layers'])} (tokens/s {engine['tokens/s']:.1f} vs "
          f"{offloaded['tokens/s']:.1f})")
    print(f"gpu_check: done in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
