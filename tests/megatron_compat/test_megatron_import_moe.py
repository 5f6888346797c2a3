"""Megatron-LM MoE checkpoints written by megatron-core 0.16.1 itself convert to an HF directory with equal logits.

megatron-core builds tiny MoE GPTModels on CPU (test_megatron_import's 1-rank harness; the all-gather token
dispatcher, as its all-to-all one needs CUDA streams) and saves them with `dist_checkpointing.save` (torch_dist)
and as a legacy `mp_rank_00/model_optim_rng.pt`:

- Qwen3-MoE-like: q/k layer norms, every layer MoE, `SequentialMLP` experts (local spec: layers stacked in torch_dist);
- Qwen2-MoE-like: a gated shared expert, the first layer dense (`moe_layer_freq=[0, 1, 1]`), the pre-softmax router;
- the legacy `GroupedMLP` (`mlp.experts.weight1/weight2`, transposed per expert), run by megatron-core's own module;
- Mixtral-like (no q/k norms, no shared expert).

`tools/convert_checkpoint.py` converts each; transformers' model from the output gives megatron-core's logits on the
same tokens (fp32, 1e-5). Mutations of the expert layout (experts permuted, gate/up swapped, GroupedMLP's weight1 read
untransposed) must fail that check. An expert-parallel (EP=2) save converts too, in both formats (the one 2-process
test). `--load` of a megatron-core MoE run (torch_dist and legacy; transformers' model, and this project's
stacked-expert model under `--moe-grouped-gemm`) prints megatron-core's losses of the next two iterations (1e-5).

Runtime stand-ins, in this test only (no file edited): megatron-core's router GEMM names `te_general_gemm` without
Transformer Engine installed, so the module attribute is set to None (its own non-TE branch then runs); the legacy
`GroupedMLP` needs the `grouped_gemm` CUDA package, whose `gmm` is replaced by a sequential per-expert matmul (the
oracle: rows of expert e times its weight), and its forward asserts bf16, so its config says bf16 after the model is
built (the weights stay fp32).
"""
import re
import types
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_checkpoints import SEQ, VOCAB, hf_logits, megatron_logits, save_megatron_checkpoint
from tests.support.megatron_checkpoints import megatron  # noqa: F401  (pytest fixture)

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

E, TOPK, H, F_DENSE, F_EXPERT, F_SHARED = 4, 2, 64, 96, 32, 48


def _gmm_reference(a, b, batch_sizes, trans_b=False):
    """grouped_gemm's gmm, sequentially: the rows of expert e (batch_sizes[e] of them) times b[e]."""
    outs, start = [], 0
    for e, n in enumerate(batch_sizes.tolist()):
        w = b[e].t() if trans_b else b[e]
        outs.append(a[start:start + n] @ w)
        start += n
    return torch.cat(outs)


@pytest.fixture(scope="module")
def moe_megatron(megatron):  # noqa: F811 (the fixture imported above)
    import megatron.core.transformer.moe.grouped_gemm_util as gg
    import megatron.core.transformer.moe.moe_utils as moe_utils

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
        mp.setattr(gg, "grouped_gemm", types.SimpleNamespace(), raising=False)
        mp.setattr(gg, "ops", types.SimpleNamespace(gmm=_gmm_reference), raising=False)
        yield


def _megatron_moe_gpt(kind: str, seed: int):
    """megatron-core's MoE GPTModel of one `kind` and the args namespace Megatron-LM would save with it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    qk = kind in ("qwen3_moe", "grouped")
    shared = kind == "qwen2_moe"
    freq = [0, 1, 1] if shared else 1
    grouped = kind == "grouped"
    options = dict(num_moe_experts=E, moe_router_topk=TOPK, moe_ffn_hidden_size=F_EXPERT, moe_layer_freq=freq,
                   moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                   moe_router_pre_softmax=shared, moe_grouped_gemm=grouped, moe_use_legacy_grouped_gemm=grouped,
                   moe_shared_expert_intermediate_size=F_SHARED if shared else None, moe_shared_expert_gate=shared)
    cfg = TransformerConfig(num_layers=3, hidden_size=H, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            ffn_hidden_size=F_DENSE, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=shared,
                            qk_layernorm=qk, layernorm_epsilon=1e-6, hidden_dropout=0.0, attention_dropout=0.0,
                            use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
                            apply_rope_fusion=False, persist_layer_norm=False, **options)
    if shared:  # a mixed dense / MoE pattern: the block spec (torch_dist then keys each layer apart)
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    else:  # one layer spec: torch_dist stacks the layers under one key
        spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=grouped, qk_layernorm=qk,
                                        moe_use_legacy_grouped_gemm=grouped, normalization="RMSNorm")
    torch.manual_seed(seed)
    model = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="rope",
                     rotary_base=10000, share_embeddings_and_output_weights=False)
    cfg.bf16 = grouped  # GroupedMLP's forward asserts it; nothing else reads it after construction
    with torch.no_grad():  # norms start at 1: make them differ so a misplaced norm shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif "router" in name:  # a decisive router: logits differ clearly between experts
                param.normal_(0, 1.0)
    import argparse

    args = argparse.Namespace(
        num_layers=3, hidden_size=H, ffn_hidden_size=F_DENSE, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, kv_channels=16, normalization="RMSNorm", layernorm_epsilon=1e-6, swiglu=True,
        add_bias_linear=False, add_qkv_bias=shared, qk_layernorm=qk, position_embedding_type="rope",
        rotary_base=10000, rotary_percent=1.0, max_position_embeddings=64, seq_length=SEQ,
        untie_embeddings_and_output_weights=True, padded_vocab_size=VOCAB, **options, num_experts=E)
    del args.num_moe_experts
    return model.eval(), args


KINDS = {"qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe", "grouped": "qwen3_moe", "mixtral": "mixtral"}


@pytest.mark.parametrize("kind,fmt", [("qwen3_moe", "torch_dist"), ("qwen3_moe", "torch"), ("qwen2_moe", "torch_dist"),
                                      ("qwen2_moe", "torch"), ("grouped", "torch_dist"), ("grouped", "torch"),
                                      ("mixtral", "torch_dist")])
def test_megatron_moe_checkpoint_converts_with_equal_logits(moe_megatron, tmp_path, kind, fmt):
    from fsdp2_backend.cli.convert_checkpoint import main as convert

    model, args = _megatron_moe_gpt(kind, seed=3)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = megatron_logits(model, tokens)
    save_megatron_checkpoint(model, args, tmp_path / "mg", fmt)
    convert([str(tmp_path / "mg"), str(tmp_path / "hf")])
    hf_model, got = hf_logits(tmp_path / "hf", tokens)
    assert hf_model.config.model_type == KINDS[kind]
    if kind == "qwen2_moe":
        assert hf_model.config.mlp_only_layers == [0] and not hf_model.config.norm_topk_prob
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    print(f"\n{kind} {fmt}: max |logit diff| = {(got - expected).abs().max().item():.2e}")


@pytest.mark.parametrize("mutation", ["experts_permuted", "gate_up_swapped", "grouped_not_transposed"])
def test_a_wrong_expert_layout_fails_the_comparison(moe_megatron, tmp_path, mutation):
    """The logit comparison above sees the expert layout: the same conversion with experts 0 and 1 exchanged, the
    fc1 gate and up halves exchanged, or GroupedMLP's weight1 read without its transpose, gives other logits."""
    from transformers import AutoModelForCausalLM

    from megatron_compat.checkpoint.convert import hf_config_from_args, to_hf_state_dict
    from megatron_compat.checkpoint.moe import normalize_experts

    model, args = _megatron_moe_gpt("grouped" if mutation == "grouped_not_transposed" else "qwen3_moe", seed=4)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    expected = megatron_logits(model, tokens)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    config = hf_config_from_args(args, state)
    hf_state = to_hf_state_dict(normalize_experts(state), config)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    if mutation == "experts_permuted":
        hf_state[name] = hf_state[name][[1, 0, 2, 3]]
    elif mutation == "gate_up_swapped":
        gate, up = hf_state[name].chunk(2, dim=1)
        hf_state[name] = torch.cat([up, gate], dim=1)
    else:
        weight1 = state["decoder.layers.1.mlp.experts.weight1"]  # [H, E * 2F] split as if [H, E, 2F]
        hf_state[name] = weight1.reshape(H, E, -1).permute(1, 2, 0).contiguous()
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.load_state_dict(hf_state, strict=True)
    with torch.no_grad():
        got = hf(tokens).logits
    assert (got - expected).abs().max().item() > 1e-3


def test_te_grouped_mlp_keys_read_as_the_sequential_ones(moe_megatron):
    """TEGroupedMLP (Transformer Engine's GroupedLinear: `linear_fc1.weight{e}`, not buildable here without TE) saves
    each expert's fc1 / fc2 under `mlp.experts.linear_fc{1,2}.weight{e}` in the SequentialMLP's own [2F, H] / [H, F]
    layout: renamed so, a SequentialMLP state dict converts to the same HF tensors; and at expert-parallel rank 1 of
    2 the local experts 0, 1 are global experts 2, 3."""
    from megatron_compat.checkpoint.convert import hf_config_from_args, to_hf_state_dict
    from megatron_compat.checkpoint.moe import normalize_experts

    model, args = _megatron_moe_gpt("qwen3_moe", seed=5)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    te_state = {re.sub(r"\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r".\2.weight\1", k): v
                for k, v in state.items()}
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight3" in te_state
    config = hf_config_from_args(args, state)
    ours, reference = to_hf_state_dict(normalize_experts(te_state), config), to_hf_state_dict(
        normalize_experts(state), config)
    assert sorted(ours) == sorted(reference)
    for name, value in reference.items():
        assert torch.equal(ours[name], value), name
    rank1 = normalize_experts({"x.mlp.router.weight": torch.zeros(E, H),
                               "x.mlp.experts.linear_fc1.weight1": torch.ones(2)}, ep_rank=1, ep_size=2)
    assert "x.mlp.experts.local_experts.3.linear_fc1.weight" in rank1


def _megatron_moe_run(root, kind: str, fmt: str):
    """megatron-core trains the MoE model of `kind` K iterations on its own GPTDataset batches (DDP, its Adam, its
    scheduler, clipping: test_megatron_resume's stack), saves root/mg as Megatron-LM does (torch_dist with the
    distributed optimizer saved fully_reshardable, or legacy with the plain one), and trains 2 more: the reference
    losses."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from tests.support.megatron_reference import write_corpus
    from tests.support.megatron_training import (GBS, K, CpuForCuda, megatron_gpt_dataset, megatron_training_stack,
                                                 megatron_training_step, save_like_megatron_lm)

    prefix = write_corpus(str(root / "data" / "text_document"), 120, seed=7, vocab_size=VOCAB - 1)
    data = megatron_gpt_dataset(prefix, str(root / "mcore_cache"))
    model, args = _megatron_moe_gpt(kind, seed=11)
    distributed = fmt == "torch_dist"
    model.train()
    losses = {}
    with CpuForCuda():
        ddp, optimizer, scheduler = megatron_training_stack(model, distributed)
        for iteration in range(1, K + 3):
            samples = [data[(iteration - 1) * GBS + j] for j in range(GBS)]
            batch = {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask",
                                                                             "position_ids")}
            losses[iteration] = megatron_training_step(ddp, optimizer, scheduler, batch)
            if iteration == K:
                args.consumed_train_samples, args.consumed_valid_samples = K * GBS, 0
                save_like_megatron_lm(root / "mg", fmt, model, optimizer, scheduler, args,
                                       dist_checkpointing, ShardedObject)
    return prefix, losses


@pytest.mark.parametrize("kind,fmt,extra", [("qwen3_moe", "torch_dist", ()), ("qwen2_moe", "torch", ()),
                                            ("qwen3_moe", "torch_dist", ("--moe-grouped-gemm",)),
                                            ("grouped", "torch_dist", ())])
def test_load_resumes_a_megatron_core_moe_run_as_megatron_core_continues_it(moe_megatron, tmp_path, kind, fmt, extra):
    """`--load` of the MoE checkpoint: our engine's loss at iteration K+1 (the converted weights and router) and at
    K+2 (one Adam step from the converted moments of router, experts, shared expert and the rest) equal
    megatron-core's. Without MoE flags the model is transformers' own; `--moe-grouped-gemm` selects this project's
    stacked-expert model (model_id qwen3_moe): the same parameter names, so the same state lands on it."""
    from tests.support.launchers import run_pretrain
    from tests.support.megatron_training import K, printed_steps, resume_flags

    prefix, reference = _megatron_moe_run(tmp_path, kind, fmt)
    _, log = run_pretrain(resume_flags(tmp_path, prefix, *extra), tmp_path / "out", ranks=1)
    got = printed_steps(log)
    assert sorted(got) == [K + 1, K + 2], log[-2000:]
    for iteration in (K + 1, K + 2):
        assert got[iteration][2] == pytest.approx(reference[iteration], abs=1e-5), (iteration, log[-2000:])
    print(f"\nMoE {kind} {fmt} {extra}: |loss - megatron-core| at K+1, K+2 = "
          f"{[abs(got[i][2] - reference[i]) for i in (K + 1, K + 2)]}")


def _ep2_rank(rank, world_size, root):
    """One rank of megatron-core at expert-parallel 2 (2 of the 4 experts each): its logits and its saves, legacy
    under Megatron-LM's `mp_rank_00_{ep:03d}` name and torch_dist (global expert tensors)."""
    import contextlib
    import os

    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.cuda.current_device = lambda: "cpu"  # this process is a throwaway rank: patched for its lifetime
    torch.cuda.synchronize = lambda *a, **k: None
    moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    model, args = _megatron_moe_gpt("qwen3_moe", seed=6)
    args.expert_model_parallel_size = 2
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    logits = megatron_logits(model, tokens)
    it_dir = os.path.join(root, "mg", "iter_0000005")
    os.makedirs(it_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 5}, it_dir)
    legacy = os.path.join(root, "legacy", "iter_0000005", f"mp_rank_00_{rank:03d}")
    os.makedirs(legacy)
    torch.save({"model": model.state_dict(), "args": args, "iteration": 5}, os.path.join(legacy, "model_optim_rng.pt"))
    if rank == 0:
        torch.save({"tokens": tokens, "logits": logits}, os.path.join(root, "reference.pt"))
    parallel_state.destroy_model_parallel()


def test_an_expert_parallel_checkpoint_converts_with_equal_logits(tmp_path):
    """An EP=2 save: torch_dist (global expert tensors) and legacy (`mp_rank_00_000`, `mp_rank_00_001`, local expert
    indices 0, 1 on each: global 2, 3 on the second) read as the one model megatron-core ran."""
    from tests.support.launchers import run_distributed
    from fsdp2_backend.cli.convert_checkpoint import main as convert

    run_distributed(_ep2_rank, 2, str(tmp_path))
    reference = torch.load(tmp_path / "reference.pt")
    for fmt in ("mg", "legacy"):
        convert([str(tmp_path / fmt), str(tmp_path / f"hf_{fmt}")])
        _, got = hf_logits(tmp_path / f"hf_{fmt}", reference["tokens"])
        torch.testing.assert_close(got, reference["logits"], rtol=0, atol=1e-5, msg=fmt)
    # `--load` of the legacy EP split is one line (its per-rank optimizer state is not mapped): convert it instead
    from megatron_compat.checkpoint.resume import megatron_architecture
    from fsdp2_backend.usage_errors import UsageError

    with pytest.raises(UsageError, match="split over 2 expert-parallel ranks"):
        megatron_architecture(str(tmp_path / "legacy" / "iter_0000005"))


@pytest.mark.parametrize("option,value,words", [
    ("moe_router_score_function", "sigmoid", "sigmoid router scores"),
    ("moe_router_enable_expert_bias", True, "an expert bias"),
    ("moe_router_topk_scaling_factor", 2.5, "a top-k scaling factor"),
    ("moe_shared_expert_gate", False, "without --moe-shared-expert-gate")])
def test_what_the_hf_moe_layouts_cannot_hold_is_declined_in_one_line(moe_megatron, option, value, words):
    """Routers other than softmax top-k, and an ungated shared expert, have no counterpart in the HF models: one
    UsageError naming the flag, not a model that computes something else."""
    from megatron_compat.checkpoint.convert import hf_config_from_args
    from fsdp2_backend.usage_errors import UsageError

    model, args = _megatron_moe_gpt("qwen2_moe" if option == "moe_shared_expert_gate" else "qwen3_moe", seed=7)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    setattr(args, option, value)
    with pytest.raises(UsageError, match=re.escape(words)):
        hf_config_from_args(args, state)


@pytest.mark.parametrize("freq", [1, 2, 3, [0, 1, 1], [1, 0, 1, 0, 1]])
def test_the_moe_layer_pattern_is_megatron_cores(moe_megatron, freq):
    """Which layers are MoE: megatron-core's block spec (MoELayer or MLP per layer) for --moe-layer-freq."""
    import argparse

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_compat.checkpoint.moe import moe_layer_pattern

    layers = len(freq) if isinstance(freq, list) else 5
    cfg = TransformerConfig(num_layers=layers, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
                            moe_layer_freq=freq, use_cpu_initialization=True)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    reference = [layer.submodules.mlp.module is MoELayer for layer in spec.layer_specs]
    assert moe_layer_pattern(argparse.Namespace(moe_layer_freq=freq), layers) == reference
