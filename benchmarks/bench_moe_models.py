"""Per-model MoE training throughput and memory on 2 CPU ranks (no EP vs EP 2), and gpt_oss's attention with
sinks: ours (SDPA, the sinks as a key column) vs transformers' eager attention at 4k.

    python -m benchmarks.bench_moe_models [--steps 3] [--seq 256] [--attn-seq 4096] [--skip-train | --skip-attn]

Models: qwen3_moe, gpt_oss, minimax_m27 and step35 (the model ids of this project), tiny configs of the same
shape (2 layers, both sparse, hidden 128, 8 experts top 2), Megatron's router with an aux loss (`configure_moe`,
as the model ids' own configure functions call it; every model's output carries `aux_loss`, already in its
`loss`). Each keeps its own features: gpt_oss sliding + full attention with sinks; minimax_m27 q/k norm,
partial RoPE and sigmoid routing with the selection bias; step35 full + sliding attention (more heads on the
sliding layer), the head-wise attention gate, a shared expert and sigmoid routing with the selection bias.
Per layout: tokens/s over both ranks (best step after a warm-up step) and a rank's peak RSS during the timed
steps, as `bench_moe.py` measures them (whose helpers are reused). Attention: forward + backward of one layer's
attention core (B 1, 8 heads, head dim 64, sliding window off and 128), fp32, best of `--repeats`, and the peak
memory each path allocates (torch's CPU profiler).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


from benchmarks.bench_moe import _reset_peak_rss, _status_mb  # the same RSS measurement

EXPERTS = "model.layers.{*}.mlp.experts"


def _model(name: str, args):
    from types import SimpleNamespace

    from fsdp2_backend.models.qwen3_moe.modeling import configure_moe

    common = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, num_experts_per_tok=2, max_position_embeddings=args.seq,
                  tie_word_embeddings=False)
    if name == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        from fsdp2_backend.models.qwen3_moe.modeling import build_qwen3_moe

        model = build_qwen3_moe(Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                                               **common))
    elif name == "gpt_oss":
        from transformers import GptOssConfig

        from fsdp2_backend.models.gpt_oss.modeling import build_gpt_oss

        model = build_gpt_oss(GptOssConfig(intermediate_size=64, num_local_experts=8, sliding_window=128,
                                           layer_types=["sliding_attention", "full_attention"], **common))
    elif name == "minimax_m27":
        from transformers import MiniMaxM2Config

        from fsdp2_backend.models.minimax_m27.modeling import build_minimax_m2

        model = build_minimax_m2(MiniMaxM2Config(intermediate_size=64, num_local_experts=8, rotary_dim=16,
                                                 bos_token_id=None, eos_token_id=None, **common))
    else:  # step35: Step-3.5's own config.json keys, as tests/models/test_step35.py; both layers sparse (none dense)
        from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig

        from fsdp2_backend.models.step35.modeling import build_step35

        model = build_step35(Step3p7TextConfig(
            intermediate_size=256, moe_num_experts=8, moe_intermediate_size=64, share_expert_dim=64,
            moe_layers_enum="0,1", layer_types=["full_attention", "sliding_attention"], sliding_window=128,
            attention_other_setting={"attention_type": "sliding_attention", "num_attention_heads": 8,
                                     "num_attention_groups": 2, "head_dim": 32, "true_head_dim": 32},
            rope_theta=[10000.0, 500.0], partial_rotary_factors=[0.5, 1.0], use_head_wise_attn_gate=True,
            use_moe_router_bias=True, need_fp32_gate=True, moe_router_activation="sigmoid",
            moe_router_scaling_factor=2.5, pad_token_id=0, **common))
    fields = SimpleNamespace(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                             moe_router_enable_expert_bias=False, moe_router_bias_update_rate=1e-3)
    configure_moe(model, moe_grouped_gemm=True, fix_router=False, model_args=fields)
    return model


def _rank(rank, world_size, name, ep, args, out_dir):
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from fsdp2_backend.config import ParallelArguments
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.parallel.expert_parallel import apply_expert_parallel

    torch.set_num_threads(1)
    parallel = ParallelArguments(ep_size=ep, param_dtype="fp32", ep_modules=[EXPERTS], ep_fsdp_modules=[EXPERTS])
    ctx = ParallelContext.create(parallel)
    torch.manual_seed(0)
    model = _model(name, args)
    ignored = apply_expert_parallel(model, SimpleNamespace(parallel=parallel), ctx) if ep > 1 else set()
    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.fsdp_mesh, ignored_params=ignored or None)
    fully_shard(model, mesh=ctx.fsdp_mesh, ignored_params=ignored or None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.steps + 1):
        if step == 1:
            _reset_peak_rss()
        ids = torch.randint(0, 1024, (1, args.seq), generator=g)
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        out = model(input_ids=ids, labels=ids, use_cache=False)
        assert out.aux_loss is not None, f"{name}: no Megatron aux loss"  # (already added to out.loss)
        out.loss.backward()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    step = min(times[1:])
    Path(out_dir, f"{rank}.json").write_text(json.dumps(dict(tokens_per_s=world_size * args.seq / step,
                                                             peak_rss_mb=_status_mb("VmHWM"))))


def bench_training(args):
    from tests.support.launchers import run_distributed

    print(f"\n2 gloo ranks, 1 thread each, 1x{args.seq} tokens per rank, grouped GEMM, Megatron aux loss")
    print(f"{'model':<11} {'layout':<6} {'tokens/s':>9} {'vs no EP':>9} {'peak RSS MB':>12}")
    for name in ("qwen3_moe", "gpt_oss", "minimax_m27", "step35"):
        rows = {}
        for ep in (1, 2):
            with tempfile.TemporaryDirectory() as out:
                run_distributed(_rank, 2, name, ep, args, out)
                ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
            rows[ep] = (min(r["tokens_per_s"] for r in ranks), max(r["peak_rss_mb"] for r in ranks))
        for ep, (tps, rss) in rows.items():
            print(f"{name:<11} {'no EP' if ep == 1 else 'EP 2':<6} {tps:>9.0f} {tps / rows[1][0]:>8.2f}x {rss:>12.0f}")


def _peak_alloc_mb(fn) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    peak = current = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.cpu_memory_usage
        peak = max(peak, current)
    return peak / 2**20


def bench_attention(args):
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from fsdp2_backend.kernels.sink_attention import transformers_sink_attention

    s, h, d = args.attn_seq, 8, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, s, d, generator=g).requires_grad_() for _ in range(3))
    sinks = torch.randn(h, generator=g).requires_grad_()
    module = SimpleNamespace(num_key_value_groups=1, sinks=sinks, training=True)
    print(f"\nattention with sinks, forward + backward, B 1, {h} heads, head dim {d}, seq {s}, fp32, "
          f"{torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'window':<7} {'path':<22} {'ms':>9} {'vs eager':>9} {'peak alloc MB':>14}")
    for window in (None, 128):
        pos = torch.arange(s)
        allowed = pos[:, None] >= pos[None, :]
        if window:
            allowed &= (pos[:, None] - pos[None, :]) < window
        float_mask = torch.zeros(s, s).masked_fill_(~allowed, float("-inf"))[None, None]

        def eager():
            out, _ = eager_attention_forward(module, q, k, v, float_mask, scaling=d ** -0.5)
            out.square().mean().backward()

        def ours():
            out, _ = transformers_sink_attention(module, q, k, v, None, scaling=d ** -0.5, sliding_window=window,
                                                 s_aux=sinks)
            out.square().mean().backward()

        results = {}
        for label, fn in (("transformers eager", eager), ("ours (sdpa + sink col)", ours)):
            fn()
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - start)
            results[label] = (best, _peak_alloc_mb(fn))
        base = results["transformers eager"][0]
        for label, (sec, mem) in results.items():
            print(f"{str(window):<7} {label:<22} {sec * 1e3:>9.1f} {base / sec:>8.2f}x {mem:>14.0f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--attn-seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-attn", action="store_true")
    args = parser.parse_args()
    if not args.skip_attn:
        bench_attention(args)
    if not args.skip_train:
        bench_training(args)


if __name__ == "__main__":
    main()
