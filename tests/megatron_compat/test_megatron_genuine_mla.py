"""A DeepSeek-style Megatron-LM checkpoint (multi-latent attention, MoE with a sigmoid router, expert bias and a
shared expert, one MTP layer) carrying the args namespace Megatron-LM's own parser made
(`tests/data/megatron_genuine_args/deepseek_mla`) converts to an HF DeepSeek-V3 directory and continues under
`--load`, in torch_dist and legacy formats.

megatron-core 0.16.1 builds exactly the model those args describe on CPU, fp32 (test_megatron_import's 1-rank
harness): `MLATransformerConfig` from the namespace's own values (2 layers, `--moe-layer-freq [0, 1]`: a dense
first layer, then 8 experts top-2; q_lora 32, kv_lora 16, qk 16 + rope 8, v 16; YaRN with the args' factor 1), the
local MLA spec (`get_gpt_decoder_block_spec`) and the MTP block spec (`get_gpt_mtp_block_spec`, which runs on CPU).
Conversion: transformers' `DeepseekV3ForCausalLM` from `tools/convert_checkpoint.py`'s output gives megatron-core's
eval loss of the main model on the same tokens (1e-6 relative), and the directory holds the MTP layer as
DeepSeek-V3's trailing layer. Continuation: megatron-core trains K iterations (its DDP, Adam, scheduler,
`finalize_model_grads`, which updates the expert bias, and the MTP loss in the backward), saves as Megatron-LM does
(torch_dist with the distributed optimizer; legacy with the plain one) and trains 2 more; our `--load` (torch_dist on
2 ranks, legacy on 1) prints its next two lm losses (the main model's loss: what both print as "lm loss"; the MTP
loss enters both backwards) and ends with megatron-core's expert biases (main and MTP layer). The torch_dist save
is `fully_reshardable` (--dist-ckpt-optim-fully-reshardable); the genuine args' own default, `dp_reshardable`, is
saved too and reads back as the same state.

Hand-made parts, each because no real tool makes it here:
- The saved namespace is the genuine one with one field changed, `qk_layernorm=True`: the genuine run has no
  `--qk-layernorm`, so its MLA latents are not normalised, which transformers' DeepSeek-V3 cannot express
  (`q_a_layernorm` / `kv_a_layernorm` always apply); that exact namespace is declined in one line (tested below).
  Megatron-LM's own `parse_args` cannot be run here (megatron-core ships no `megatron.training`).
- The continuation runs are fp32: their saved namespaces say so (`bf16` False, `params_dtype` float32, and for the
  legacy save `use_distributed_optimizer` False), as the parser would for the line without those flags.
- Dropouts are 0 in the reference model (the args' 0.1 stays saved): the continuation run gives
  `--hidden-dropout 0 --attention-dropout 0`, so both sides are deterministic.
- Runtime stand-ins for megatron-core on CPU (no file edited), besides test_megatron_import's: the local
  `DotProductAttention` of 0.16.1 refuses the `k_channels` / `v_channels` keywords MLA passes (only Transformer
  Engine's takes them), so the spec's core attention is a subclass that drops them (its math is width-generic;
  the args' v_head_dim equals kv_channels, so its output width is right); `multi_latent_attention.HAVE_TE` is
  False (the module sees a stubbed Transformer Engine and `isinstance`s against a mock); the router's
  `te_general_gemm` is None (test_megatron_import_moe's stand-in).
- The reference model's initial norms, router weights and expert biases are drawn away from their defaults, and its
  q-up / kv-down projections scaled, so that a misplaced tensor or the rope layout shows in the loss.
- Single tests hand-set what no genuine run here has (each docstring says why): YaRN factors, non-default dropouts,
  two legacy TP shard dicts, a tiny model lacking MTP layers.
"""
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.support.megatron_checkpoints import save_megatron_checkpoint
from tests.support.megatron_checkpoints import megatron  # noqa: F401  (pytest fixture)
from tests.support.megatron_training import (GBS, K, CpuForCuda, hf_weights, megatron_gpt_dataset,
                                             megatron_training_stack, printed_steps, resume_flags,
                                             save_like_megatron_lm)
from tests.support.megatron_checkpoints import SEQ
from tests.support.megatron_training import save_like_megatron_lm_distopt as _save_dp_reshardable
from tests.support.megatron_genuine import genuine_args, listing, megatron_padded_vocab

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


@pytest.fixture(scope="module")
def mla_megatron(megatron):  # noqa: F811 (the fixture imported above)
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
        mp.setattr(mla, "HAVE_TE", False)
        yield


def _args(qk_layernorm: bool = True, **run):
    args = genuine_args("deepseek_mla", **run)
    args.padded_vocab_size = megatron_padded_vocab(args)
    args.qk_layernorm = qk_layernorm  # the one hand-set field (module docstring)
    return args


def _mcore_mla_gpt(args, seed: int):
    """megatron-core's GPTModel of the namespace `args` (its own values), eval mode, dropout 0."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class MLACoreAttention(DotProductAttention):
        def __init__(self, *a, k_channels=None, v_channels=None, **kw):
            super().__init__(*a, **kw)

    a = args
    assert a.v_head_dim == a.kv_channels  # the stand-in's output width (module docstring)
    cfg = MLATransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        ffn_hidden_size=a.ffn_hidden_size, kv_channels=a.kv_channels, multi_latent_attention=True,
        q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_head_dim=a.qk_head_dim,
        qk_pos_emb_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim, qk_layernorm=a.qk_layernorm,
        rotary_scaling_factor=a.rotary_scaling_factor, mscale=a.mscale, mscale_all_dim=a.mscale_all_dim,
        rotary_base=a.rotary_base, normalization=a.normalization, layernorm_epsilon=a.layernorm_epsilon,
        gated_linear_unit=a.swiglu, activation_func=F.silu, add_bias_linear=a.add_bias_linear,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        num_moe_experts=a.num_experts, moe_router_topk=a.moe_router_topk, moe_ffn_hidden_size=a.moe_ffn_hidden_size,
        moe_layer_freq=a.moe_layer_freq, moe_router_score_function=a.moe_router_score_function,
        moe_router_enable_expert_bias=a.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=a.moe_router_bias_update_rate,
        moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, mtp_num_layers=a.mtp_num_layers,
        mtp_loss_scaling_factor=a.mtp_loss_scaling_factor)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=a.normalization)
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = MLACoreAttention
    mtp = get_gpt_mtp_block_spec(cfg, spec.layer_specs[-1], use_transformer_engine=False)
    torch.manual_seed(seed)
    model = GPTModel(cfg, spec, vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=a.rotary_base,
                     share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
                     mtp_block_spec=mtp)
    with torch.no_grad():  # norms start at 1, the bias at 0: make them differ so a misplaced one shows
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("norm.weight") or "layer_norm_weight" in name:
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("router.weight"):
                tensor.normal_(0, 0.5)
            elif name.endswith("expert_bias"):
                tensor.normal_(0, 0.05)
            elif name.endswith(("linear_q_up_proj.weight", "linear_kv_down_proj.weight")):
                tensor.mul_(8)  # sharper attention: the rope channels' layout shows in the loss
    return model.eval()


def _main_loss(logits_or_losses, labels=None) -> float:
    """The mean main-model loss: of megatron-core's per-token losses, or of transformers' logits against
    Megatron's labels (already shifted: no shift here)."""
    if labels is None:
        return logits_or_losses.float().mean().item()
    return F.cross_entropy(logits_or_losses.float().flatten(0, 1), labels.flatten()).item()


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_genuine_mla_checkpoint_converts_to_deepseek_v3_with_megatron_cores_loss(mla_megatron, tmp_path, fmt):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.cli.convert_checkpoint import main as convert

    args = _args(consumed_train_samples=40)
    model = _mcore_mla_gpt(args, seed=3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.padded_vocab_size, (2, SEQ), generator=g)
    labels = torch.randint(0, args.padded_vocab_size, (2, SEQ), generator=g)
    with torch.no_grad():
        expected = _main_loss(model(tokens, torch.arange(SEQ)[None].expand_as(tokens),
                                    attention_mask=torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None],
                                    labels=labels))
    save_megatron_checkpoint(model, args, tmp_path / "mg", fmt)
    convert([str(tmp_path / "mg"), str(tmp_path / "hf")])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    config = hf.config
    assert (config.model_type, config.first_k_dense_replace, config.n_routed_experts, config.n_shared_experts,
            config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim, config.num_nextn_predict_layers,
            config.vocab_size) == ("deepseek_v3", 1, 8, 1, 32, 16, 8, 1, 1024)
    with torch.no_grad():
        got = _main_loss(hf(tokens).logits, labels)
    assert got == pytest.approx(expected, rel=1e-6), (got, expected)
    hf.config.rope_interleave = False  # the comparison sees the rope layout: rotate-half without de-interleaving
    with torch.no_grad():
        wrong = _main_loss(hf(tokens).logits, labels)
    assert abs(wrong - expected) > 1e-4 * expected, (wrong, expected)
    hf.config.rope_interleave = True
    bias = model.state_dict()["decoder.layers.1.mlp.router.expert_bias"]
    assert torch.equal(hf.model.layers[1].mlp.gate.e_score_correction_bias, bias)
    # the MTP layer: DeepSeek-V3's layer N (enorm, hnorm, eh_proj, shared_head.norm, its decoder layer's keys)
    keys = {}
    for path in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.2.")})
    reference = model.state_dict()
    for ours, theirs in (("eh_proj.weight", "mtp.layers.0.eh_proj.weight"),
                         ("shared_head.norm.weight", "mtp.layers.0.final_layernorm.weight"),
                         ("self_attn.q_a_layernorm.weight", "mtp.layers.0.transformer_layer.self_attention."
                                                            "q_layernorm.weight"),
                         ("mlp.gate.e_score_correction_bias", "mtp.layers.0.transformer_layer.mlp.router.expert_bias"),
                         ("mlp.experts.3.down_proj.weight", None)):
        assert f"model.layers.2.{ours}" in keys, sorted(keys)[:8]
        if theirs:
            assert torch.equal(keys[f"model.layers.2.{ours}"], reference[theirs]), ours
    # and this project's MTP layer reads it back from there (an HF --load with --mtp-num-layers 1)
    from fsdp2_backend.models.mtp import attach_mtp, load_mtp_weights

    attach_mtp(hf, 1, seed=0)
    assert load_mtp_weights(hf, str(tmp_path / "hf")) > 0
    mtp = hf.mtp.layers[0]
    assert torch.equal(mtp.hnorm.weight, reference["mtp.layers.0.hnorm.weight"])
    assert torch.equal(mtp.transformer_layer.self_attn.kv_b_proj.weight,
                       reference["mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight"])
    assert torch.equal(mtp.transformer_layer.mlp.experts.down_proj, torch.stack(
        [reference[f"mtp.layers.0.transformer_layer.mlp.experts.local_experts.{e}.linear_fc2.weight"]
         for e in range(8)]))
    print(f"\n{fmt}: |HF loss - megatron-core loss| / loss = {abs(got - expected) / expected:.1e}")


def test_the_exact_genuine_namespace_is_declined_for_its_unnormalised_latents(mla_megatron):
    """Without --qk-layernorm (the genuine run's args as parsed) megatron-core's MLA has no latent norms, which
    transformers' DeepSeek-V3 always applies: one UsageError naming the flag, not a model that computes otherwise."""
    from fsdp2_backend.usage_errors import UsageError
    from megatron_compat.checkpoint.convert import hf_config_from_args

    args = _args(qk_layernorm=False)
    model = _mcore_mla_gpt(args, seed=4)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert not any("layernorm" in k and "self_attention" in k for k in state)  # megatron-core built none
    with pytest.raises(UsageError, match=re.escape("--qk-layernorm")):
        hf_config_from_args(args, state)


def test_training_settings_in_the_saved_args_decline_nothing():
    """A run trained with --hidden-dropout 0.05 (hand-set: a non-default value; HF DeepSeek-V3 has no hidden
    dropout) converts all the same: dropouts and the init std are how it trained, not what its weights compute."""
    from megatron_compat.checkpoint.convert import hf_config_from_args

    args = _args()
    args.hidden_dropout, args.attention_dropout, args.init_method_std = 0.05, 0.2, 0.006
    shapes = {"embedding.word_embeddings.weight": (1024, 64),
              "decoder.layers.0.self_attention.linear_kv_down_proj.weight": (24, 64)}
    config = hf_config_from_args(args, {k: torch.empty(s, device="meta") for k, s in shapes.items()})
    assert (config.model_type, config.attention_dropout) == ("deepseek_v3", 0.0)


def _training_step(ddp, optimizer, scheduler, batch) -> float:
    """One Megatron-LM iteration: the main loss's mean (MTP's loss joins the backward inside the model), then
    `finalize_model_grads` (gradient sync and the expert-bias update), the optimizer and the scheduler."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = ddp(batch["tokens"], batch["position_ids"], attention_mask=mask, labels=batch["labels"],
                 loss_mask=batch["loss_mask"])
    loss = (losses.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    finalize_model_grads([ddp])
    assert optimizer.step()[0]
    scheduler.step(increment=GBS)
    return loss.item()


def _model_flags() -> list:
    """The genuine run's model flags (its command line up to --mtp-num-layers, and --max-position-embeddings):
    what its script gives again when it continues; the training flags (batch, schedule, precision) are the test's."""
    line = listing("deepseek_mla")["command_line"]
    at = line.index("--max-position-embeddings")
    return line[:line.index("--mtp-num-layers") + 2] + line[at:at + 2]


_RUNS: dict = {}


def _megatron_run(tmp_path_factory, fmt: str):
    """megatron-core trains K iterations, saves (genuine args) and trains 2 more, once per format."""
    if fmt in _RUNS:
        return _RUNS[fmt]
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from tests.support.megatron_reference import write_corpus

    root = tmp_path_factory.mktemp(f"mla_{fmt}")
    prefix = write_corpus(str(root / "data" / "text_document"), 120, seed=7, vocab_size=1000)
    data = megatron_gpt_dataset(prefix, str(root / "mcore_cache"))
    args = _args()
    # the parser's namespace for the same line without --bf16 (this run is fp32), and without
    # --use-distributed-optimizer for the legacy save (Megatron-LM's legacy format holds the plain optimizer's state)
    args.bf16, args.params_dtype = False, torch.float32
    args.use_distributed_optimizer = fmt == "torch_dist"
    model = _mcore_mla_gpt(args, seed=11).train()
    losses = {}
    with CpuForCuda():
        ddp, optimizer, scheduler = megatron_training_stack(model, fmt == "torch_dist")
        for iteration in range(1, K + 3):
            samples = [data[(iteration - 1) * GBS + j] for j in range(GBS)]
            batch = {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask",
                                                                             "position_ids")}
            losses[iteration] = _training_step(ddp, optimizer, scheduler, batch)
            if iteration == K:
                args.consumed_train_samples, args.consumed_valid_samples = K * GBS, 0
                save_like_megatron_lm(root / "mg", fmt, model, optimizer, scheduler, args, dist_checkpointing,
                                       ShardedObject)
                if fmt == "torch_dist":  # the genuine run's own default: no --dist-ckpt-optim-fully-reshardable
                    _save_dp_reshardable(root / "mg_dp", "dp_reshardable", 0, model, optimizer, scheduler, args,
                                         dist_checkpointing, ShardedObject)
    biases = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("expert_bias")}
    _RUNS[fmt] = root, prefix, losses, biases
    return _RUNS[fmt]


@pytest.mark.parametrize("fmt,ranks", [("torch_dist", 2), ("torch", 1)])
def test_load_continues_a_genuine_mla_run_as_megatron_core_does(mla_megatron, tmp_path_factory, fmt, ranks):
    from tests.support.launchers import run_pretrain

    root, prefix, reference, biases = _megatron_run(tmp_path_factory, fmt)
    # the saved args' one hand-set field given too; 2 ranks: one sample each, FSDP2 shards the loaded state
    flags = resume_flags(root, prefix, *_model_flags(), "--qk-layernorm", mbs=GBS // ranks)
    flags[flags.index("--vocab-size") + 1] = "1000"  # the genuine run's NullTokenizer vocabulary
    out = tmp_path_factory.mktemp(f"out_{fmt}")
    _, log = run_pretrain(flags, out, ranks=ranks)
    got = printed_steps(log)
    assert sorted(got) == [K + 1, K + 2], log[-2000:]
    for iteration in (K + 1, K + 2):
        assert got[iteration][2] == pytest.approx(reference[iteration], abs=1e-5), (iteration, log[-2000:])
    # the aux-loss-free expert bias went on moving as megatron-core moved it (main layer and MTP layer)
    ours = hf_weights(out / "hf")
    for theirs, name in (("decoder.layers.1.mlp.router.expert_bias", "model.layers.1.mlp.gate.e_score_correction_bias"),
                         ("mtp.layers.0.transformer_layer.mlp.router.expert_bias",
                          "model.layers.2.mlp.gate.e_score_correction_bias")):
        torch.testing.assert_close(ours[name].float(), biases[theirs], rtol=0, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}; ours {ours[name].tolist()}, {biases[theirs].tolist()}")
    print(f"\n{fmt}: |loss - megatron-core| at K+1, K+2 = {[abs(got[i][2] - reference[i]) for i in (K + 1, K + 2)]}")


def test_a_continuation_without_the_runs_mtp_layers_is_one_line():
    """The checkpoint's MTP layers are trained on, never dropped: a run built without them (no --mtp-num-layers)
    is told which flag to give."""
    from types import SimpleNamespace

    from fsdp2_backend.training.megatron_continuation import _set_states
    from fsdp2_backend.usage_errors import UsageError

    model = torch.nn.Linear(4, 4, bias=False)
    weights = {"weight": torch.ones(4, 4), "mtp.layers.0.enorm.weight": torch.ones(4),
               "mtp.layers.0.eh_proj.weight": torch.ones(4, 8)}
    words = "has 1 MTP layer(s), this run builds 0 — give --mtp-num-layers 1"
    with pytest.raises(UsageError, match=re.escape(words)):
        _set_states(model, None, weights, SimpleNamespace(tie_word_embeddings=False), None, None)


def test_yarn_scaling_in_the_saved_args_gives_megatron_cores_loss(mla_megatron):
    """--rotary-scaling-factor 4 (hand-set on the genuine namespace; megatron-core's MLA then runs YaRN with the
    concentration factor and softmax scale of DeepSeek's rule) reaches the HF config through the flags' own YaRN
    mapping (architecture/mla.py): the same loss in memory, no save needed."""
    from transformers import AutoModelForCausalLM

    from megatron_compat.checkpoint.convert import hf_config_from_args, to_hf_state_dict

    args = _args()
    args.rotary_scaling_factor, args.mscale, args.mscale_all_dim = 4.0, 0.7, 0.7
    model = _mcore_mla_gpt(args, seed=5)
    g = torch.Generator().manual_seed(2)
    tokens, labels = (torch.randint(0, args.padded_vocab_size, (2, SEQ), generator=g) for _ in range(2))
    with torch.no_grad():
        expected = _main_loss(model(tokens, torch.arange(SEQ)[None].expand_as(tokens),
                                    attention_mask=torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None],
                                    labels=labels))
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    config = hf_config_from_args(args, state)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 4.0
    from fsdp2_backend.models.mtp import attach_mtp

    def hf_loss(config) -> float:
        hf = attach_mtp(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), 1, seed=0)
        hf.load_state_dict(to_hf_state_dict(state, config), strict=True)
        with torch.no_grad():
            return _main_loss(hf(tokens).logits, labels)

    got = hf_loss(config)
    assert got == pytest.approx(expected, rel=1e-6), (got, expected)
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    assert abs(hf_loss(config) - expected) > 1e-4 * expected  # plain RoPE would not pass the comparison


def test_a_tensor_parallel_legacy_mla_checkpoint_is_declined_in_one_line():
    """A legacy MLA save split over 2 TP ranks: its latent down-projections are replicated under Transformer
    Engine's spec and split under the local one, and the files do not say which — declined (torch_dist's global
    tensors convert). The two shards are written here by hand (two keys): megatron-core's MLA at TP 2 needs two
    processes and Transformer Engine to show both layouts."""
    from fsdp2_backend.usage_errors import UsageError
    from megatron_compat.checkpoint.convert import _merge_tensor_parallel

    shard = {"decoder.layers.0.self_attention.linear_kv_down_proj.weight": torch.zeros(24, 64),
             "decoder.layers.0.self_attention.linear_proj.weight": torch.zeros(64, 32)}
    with pytest.raises(UsageError, match="--ckpt-format torch_dist"):
        _merge_tensor_parallel([shard, dict(shard)])



def test_the_genuine_runs_default_optimizer_layout_reads_as_the_fully_reshardable_one(mla_megatron,
                                                                                       tmp_path_factory):
    """The genuine args save the distributed optimizer dp_reshardable (no --dist-ckpt-optim-fully-reshardable):
    flat per-bucket buffers in megatron-core's parameter order (`checkpoint/distopt.py`: MLA, the experts, the
    shared expert and the MTP layer in their places). Read back, the main weights and both Adam moments equal
    those of the fully_reshardable save of the same optimizer at the same step, bit for bit."""
    from megatron_compat.checkpoint.resume import read_megatron_state

    root, _, _, _ = _megatron_run(tmp_path_factory, "torch_dist")
    default = read_megatron_state(root / "mg_dp" / f"iter_{K:07d}")
    full = read_megatron_state(root / "mg" / f"iter_{K:07d}")
    assert (default.step, default.iteration, default.consumed_train_samples) == (full.step, K, K * GBS)
    for what in ("weights", "exp_avg", "exp_avg_sq"):
        ours = default.weights if what == "weights" else default.moments[what]
        theirs = full.weights if what == "weights" else full.moments[what]
        assert sorted(ours) == sorted(theirs), what
        for name, value in theirs.items():
            assert torch.equal(ours[name], value), (what, name)
