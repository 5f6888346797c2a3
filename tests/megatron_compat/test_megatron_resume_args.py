"""Megatron-LM's saved args are read under their argparse dests, every field with a NON-DEFAULT value.

One megatron-core 0.16.1 run (module fixture) whose every architecture field the readers take differs from
Megatron-LM's default: --norm-epsilon 1e-6 (saved as `layernorm_epsilon`), --rotary-base 50000, --kv-channels 24
(not hidden / heads), --ffn-hidden-size 80, --add-qkv-bias (random biases), --group-query-attention with 2 groups,
--untie-embeddings-and-output-weights, --make-vocab-size-divisible-by 48 (a padded vocabulary of 144 for the
NullTokenizer's 100), --max-position-embeddings 96. Its saved args are the namespace Megatron-LM's own parser builds
from the run's flags (tests/support/megatron_reference.megatron_lm_args). The converted HF model's eval loss equals
megatron-core's within 1e-6 relative; `pretrain_fsdp2.py <the run's own flags> --load` gives megatron-core's next
two losses within 1e-5. The MoE router and the fields no HF layout here expresses are read from the same kind of
namespace, without a run.
"""
import pytest
import torch

from tests.support.launchers import run_pretrain
from tests.support.megatron_checkpoints import megatron  # noqa: F401  (pytest fixture)
from tests.support.megatron_training import (GBS, K, SEED, T, CpuForCuda, megatron_training_stack,
                                             megatron_training_step, printed_steps, save_like_megatron_lm)
from tests.support.megatron_reference import IdsTokenizer, megatron_lm_args, write_corpus

SEQ, TOKENS, PADDED = 12, 100, 144  # NullTokenizer --vocab-size 99: 100 ids (eod last); padded to a multiple of 48
ARCH = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "80", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "24", "--normalization", "RMSNorm",
        "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear", "--add-qkv-bias", "--position-embedding-type",
        "rope", "--rotary-base", "50000", "--max-position-embeddings", "96", "--untie-embeddings-and-output-weights",
        "--make-vocab-size-divisible-by", "48", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(TOKENS - 1)]
TRAIN = ["--seq-length", str(SEQ), "--micro-batch-size", str(GBS), "--global-batch-size", str(GBS), "--train-iters",
         str(T), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
         "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps",
         "1e-8", "--seed", str(SEED), "--hidden-dropout", "0", "--attention-dropout", "0", "--split", "100,0,0"]


def _model():
    """megatron-core's GPTModel with the values ARCH gives (the reference builds from its own config)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=24,
                            ffn_hidden_size=80, normalization="RMSNorm", layernorm_epsilon=1e-6,
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
                            use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
                            apply_rope_fusion=False, persist_layer_norm=False)
    torch.manual_seed(21)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=PADDED,
                     max_sequence_length=96, position_embedding_type="rope", rotary_base=50000,
                     share_embeddings_and_output_weights=False)
    with torch.no_grad():  # norms start at 1 and biases at 0: make them differ so a misread shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.2)
    return model


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)).item()


@pytest.fixture(scope="module")
def run(megatron, tmp_path_factory):
    """megatron-core trains K iterations, saves (Megatron-LM's layout, args from the flags), evaluates a fixed
    batch, trains 2 more: (root, data prefix, reference)."""
    from megatron.core import dist_checkpointing
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    root = tmp_path_factory.mktemp("mg_args")
    prefix = write_corpus(str(root / "data" / "text_document"), 120, seed=7, vocab_size=TOKENS - 1)
    data = BlendedMegatronDatasetBuilder(GPTDataset, [T * GBS, 0, 0], lambda: True, GPTDatasetConfig(
        random_seed=SEED, sequence_length=SEQ, blend=([prefix], None), split="100,0,0",
        tokenizer=IdsTokenizer(vocab_size=TOKENS, eod=TOKENS - 1), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, path_to_cache=str(root / "mcore_cache"))).build()[0]
    model = _model().train()
    tokens = torch.randint(0, TOKENS, (2, SEQ + 1), generator=torch.Generator().manual_seed(5))
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    reference = {"loss": {}}
    with CpuForCuda():
        ddp, optimizer, scheduler = megatron_training_stack(model, distributed_optimizer=True)
        for iteration in range(1, K + 3):
            samples = [data[(iteration - 1) * GBS + j] for j in range(GBS)]
            batch = {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask",
                                                                             "position_ids")}
            reference["loss"][iteration] = megatron_training_step(ddp, optimizer, scheduler, batch)
            if iteration == K:
                args = megatron_lm_args(*ARCH, *TRAIN, padded_vocab_size=PADDED, consumed_train_samples=K * GBS,
                                        consumed_valid_samples=0)
                save_like_megatron_lm(root / "mg", "torch_dist", model, optimizer, scheduler, args,
                                       dist_checkpointing, ShardedObject)
                model.eval()
                with torch.no_grad():
                    logits = model(tokens[:, :-1], torch.arange(SEQ)[None].expand(2, SEQ), attention_mask=mask)
                reference["eval_loss"] = _loss(logits, tokens[:, 1:])
                reference["tokens"] = tokens
                model.train()
    return root, prefix, reference


def test_conversion_keeps_every_non_default_field(run, tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.cli.convert_checkpoint import main as convert

    root, _, reference = run
    convert([str(root / "mg"), str(tmp_path / "hf")])
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    config = model.config
    assert (config.model_type, config.rms_norm_eps, config.rope_parameters["rope_theta"], config.head_dim,
            config.intermediate_size, config.num_key_value_heads, config.tie_word_embeddings, config.vocab_size,
            config.max_position_embeddings) == ("qwen2", 1e-6, 50000, 24, 80, 2, False, PADDED, 96)
    tokens = reference["tokens"]
    with torch.no_grad():
        got = _loss(model(tokens[:, :-1]).logits, tokens[:, 1:])
    assert got == pytest.approx(reference["eval_loss"], rel=1e-6, abs=0)


def test_continuation_with_the_runs_own_flags(run, tmp_path):
    root, prefix, reference = run
    flags = ["--load", str(root / "mg"), *ARCH, *TRAIN, "--data-path", prefix, "--data-cache-path",
             str(tmp_path / "cache"), "--log-interval", "1", "--eval-iters", "0"]
    _, log = run_pretrain(flags, tmp_path / "out", ranks=1)
    got = printed_steps(log)
    assert sorted(got) == [K + 1, K + 2], log[-3000:]
    for iteration in (K + 1, K + 2):
        assert got[iteration][0] == iteration * GBS
        assert got[iteration][2] == pytest.approx(reference["loss"][iteration], abs=1e-5), iteration


def _config(*flags, **derived):
    from megatron_compat.checkpoint.convert import hf_config_from_args

    args = megatron_lm_args(*ARCH, *flags, **derived)
    state = {"embedding.word_embeddings.weight": torch.empty(PADDED, 64, device="meta")}
    return hf_config_from_args(args, state)


def test_moe_router_fields_read_by_their_dests():
    """Non-default MoE values, in the namespace Megatron-LM's parser builds, reach the HF config."""
    config = _config("--qk-layernorm", "--num-experts", "6", "--moe-router-topk", "3", "--moe-ffn-hidden-size", "40",
                     "--moe-router-pre-softmax", "--moe-layer-freq", "[0,1]", "--moe-aux-loss-coeff", "0.02")
    assert (config.model_type, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.norm_topk_prob, config.mlp_only_layers, config.router_aux_loss_coef, config.rms_norm_eps) == \
        ("qwen3_moe", 6, 3, 40, False, [0], 0.02, 1e-6)


@pytest.mark.parametrize("flags,words", [
    (("--apply-layernorm-1p",), "--apply-layernorm-1p True"),
    (("--rotary-interleaved",), "--rotary-interleaved True"),
    (("--rotary-percent", "0.5"), "--rotary-percent < 1"),
    (("--window-size", "8,0"), "--window-size"),
    (("--num-experts", "4", "--moe-router-score-function", "sigmoid"), "--moe-router-score-function"),
    (("--num-experts", "4", "--moe-router-enable-expert-bias"), "--moe-router-enable-expert-bias"),
    (("--num-experts", "4", "--moe-expert-capacity-factor", "1.5"), "--moe-expert-capacity-factor"),
    (("--mtp-num-layers", "1"), "--mtp-num-layers"),
])
def test_a_field_no_hf_layout_expresses_is_declined_not_dropped(flags, words):
    from fsdp2_backend.usage_errors import UsageError

    with pytest.raises(UsageError) as info:
        _config(*flags)
    assert words in str(info.value)


def test_the_tokenizer_a_checkpoint_carries_is_used_when_no_tokenizer_flag_is_given(run, tmp_path):
    """Megatron-LM's torch_dist saves carry iter_*/tokenizer/ (save_tokenizer_assets: an HF tokenizer's
    save_pretrained files, by the saved --tokenizer-type). megatron-core does not write it: written here as
    Megatron-LM does, into a copy of the fixture's save whose args name an HF tokenizer directory since deleted."""
    import shutil

    from fsdp2_backend.config.schema import ModelArguments
    from fsdp2_backend.data.tokenizer import load_tokenizer
    from megatron_compat.checkpoint.resume import megatron_model_args
    from tests.support.sft_assets import qwen3_like_tokenizer

    root, _, _ = run
    shutil.copytree(root / "mg", tmp_path / "mg")
    it_dir = tmp_path / "mg" / f"iter_{K:07d}"
    original = qwen3_like_tokenizer(tmp_path / "gone")
    original.save_pretrained(str(it_dir / "tokenizer"))  # Megatron-LM's save_tokenizer_assets, HF branch
    common = torch.load(it_dir / "common.pt", weights_only=False)  # the test's own save, re-written below
    common["args"].tokenizer_type, common["args"].tokenizer_model = "HuggingFaceTokenizer", str(tmp_path / "gone")
    torch.save(common, it_dir / "common.pt")
    shutil.rmtree(tmp_path / "gone")
    model_args = megatron_model_args(ModelArguments(), it_dir)
    assert (model_args.tokenizer_type, model_args.tokenizer_model) == ("HuggingFaceTokenizer",
                                                                       str(it_dir / "tokenizer"))
    text = "hello world, what is the weather in Paris today?"
    assert load_tokenizer(model_args).tokenize(text) == original(text)["input_ids"]
    # the fixture's own save (a NullTokenizer run: Megatron-LM writes no files for it) takes it from the args
    null = megatron_model_args(ModelArguments(), root / "mg" / f"iter_{K:07d}")
    assert (null.tokenizer_type, null.vocab_size) == ("NullTokenizer", TOKENS - 1)
