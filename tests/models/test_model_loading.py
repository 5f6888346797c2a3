"""Model ids, HF directories, architecture flags, tokenizers and vocabulary resizing — on one real rank.

References: transformers' own `from_pretrained` / `AutoTokenizer` on the same directory.
"""
import pytest
import torch

from fsdp2_backend.config import Config
from fsdp2_backend.usage_errors import UsageError
from tests.support.tiny_models import tiny_model_dir, tiny_qwen3_config


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen3 checkpoint whose vocabulary equals its locally trained tokenizer's."""
    return tiny_model_dir(tmp_path_factory.mktemp("qwen3_dir"), seed=3)


@pytest.fixture(scope="module")
def ctx():
    from fsdp2_backend.distributed.context import ParallelContext

    context = ParallelContext.create(Config().parallel)
    yield context
    context.close()


def _config(hf_dir, **model_fields):
    config = Config()
    config.model.model_name_or_path = hf_dir
    config.parallel.param_dtype = "fp32"
    for key, value in model_fields.items():
        setattr(config.model, key, value)
    return config


def _build_model(config, ctx):
    """(tokenizer, parallelised model, HF config) of a fresh run (no checkpoint to resume)."""
    from fsdp2_backend.build import build_model
    from fsdp2_backend.checkpoint.resume_point import ResumePoint

    return build_model(config, ctx, ResumePoint(None, False, ""))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_single_process_context_is_one_rank_cpu(ctx):
    assert (ctx.world_size, ctx.rank, ctx.dp_size, ctx.device.type, ctx.device.backend) == (1, 0, 1, "cpu", "gloo")
    assert ctx.fsdp_mesh.size() == 1 and ctx.ep_mesh is None


@pytest.mark.parametrize("model_id", [None, "qwen3"])
def test_hf_dir_loads_the_checkpoint(hf_dir, ctx, model_id):
    from transformers import AutoModelForCausalLM

    tokenizer, model, _ = _build_model(_config(hf_dir, model_id=model_id), ctx)
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = torch.randint(0, 300, (2, 12))
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids), rtol=0, atol=0)
    assert tokenizer.vocab_size == len(tokenizer.hf) == 300


def test_unknown_model_id_and_missing_weights_are_usage_errors(tmp_path, hf_dir):
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.models.registry import model_spec

    with pytest.raises(UsageError, match="model.model_id: 'step36'"):
        model_spec("step36")
    (tmp_path / "config.json").write_text((__import__("pathlib").Path(hf_dir) / "config.json").read_text())
    config = _config(str(tmp_path))
    with pytest.raises(UsageError, match="holds no \\*.safetensors"):
        create_model(config.model, load_hf_config(config.model), seed=0, device=torch.device("cpu"),
                     parallelize=lambda m: m)


def test_architecture_flags_build_from_scratch_and_are_checked(hf_dir, ctx):
    arch = dict(model_type="qwen3", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
    config = _config(None, architecture=arch, tokenizer_name_or_path=hf_dir, make_vocab_size_divisible_by=128)
    _, model, hf_config = _build_model(config, ctx)
    assert hf_config.num_hidden_layers == 1 and hf_config.hidden_size == 32
    assert model.lm_head.weight.shape[0] == 384  # 300 tokens padded to a multiple of 128, like Megatron
    _, again, _ = _build_model(config, ctx)
    for a, b in zip(model.parameters(), again.parameters()):  # seeded: the same every time
        assert torch.equal(a.full_tensor(), b.full_tensor())
    wrong = _config(hf_dir, architecture=dict(model_type="qwen3", hidden_size=128, num_hidden_layers=2))
    with pytest.raises(UsageError, match="architecture.hidden_size: 128 disagrees with 64"):
        _build_model(wrong, ctx)


@pytest.mark.parametrize("meta", [False, True])
def test_added_tokens_resize_embedding_and_lm_head_with_noise_init(hf_dir, ctx, meta):
    from transformers import AutoModelForCausalLM

    config = _config(hf_dir, add_tokens="hello_world,foo_bar", add_special_tokens="<|tool|>", resize_vocab=True,
                     init_model_with_meta_device=meta)
    tokenizer, model, _ = _build_model(config, ctx)
    assert tokenizer.vocab_size == len(tokenizer.hf) == 303 and tokenizer.hf.convert_tokens_to_ids("<|tool|>") == 302
    assert "<|tool|>" in tokenizer.hf.all_special_tokens
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        got = dict(model.named_parameters())[name].full_tensor()
        old = dict(reference.named_parameters())[name]
        assert got.shape == (303, 64)
        assert torch.equal(got[:300], old)
        new = got[300:]
        # mean of the old rows plus noise of std 1/sqrt(hidden): centred on the mean, spread ~0.125
        assert (new - old.mean(0)).std().item() == pytest.approx(64 ** -0.5, rel=0.3)
        assert not torch.equal(new[0], new[1])


def test_tokenizer_without_resize_or_with_desc_init_is_declined(hf_dir, ctx):
    from fsdp2_backend.config.validation import validate

    with pytest.raises(UsageError, match="model.resize_vocab"):
        _build_model(_config(hf_dir, add_tokens="brand_new_token"), ctx)
    # desc_init is declined by config validation, before anything is built
    with pytest.raises(UsageError, match="model.init_special_tokens: desc_init"):
        validate(_config(hf_dir, init_special_tokens="desc_init"))


def test_split_special_tokens_and_slow_tokenizer_flags_reach_the_tokenizer(hf_dir):
    from transformers import AutoTokenizer

    from fsdp2_backend.data.tokenizer import load_tokenizer

    text = "a<|endoftext|>b"
    for split in (False, True):
        ours = load_tokenizer(_config(hf_dir, split_special_tokens=split).model)
        ref = AutoTokenizer.from_pretrained(hf_dir, split_special_tokens=split)
        assert ours.tokenize(text) == ref(text).input_ids
    assert load_tokenizer(_config(hf_dir).model).tokenize(text) != \
        load_tokenizer(_config(hf_dir, split_special_tokens=True).model).tokenize(text)


def test_plan_patterns():
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.parallel.plans import match_modules, require_matches

    model = Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=3))
    names = lambda patterns: [n for n, _ in match_modules(model, patterns)]  # noqa: E731
    assert names(["model.layers.{}"]) == names(["model.layers.{*}"]) == [f"model.layers.{i}" for i in range(3)]
    assert names(["*.q_proj"]) == [f"model.layers.{i}.self_attn.q_proj" for i in range(3)]
    assert names(["model.layers.{*}.mlp.down_proj", "lm_head"]) == \
        [f"model.layers.{i}.mlp.down_proj" for i in range(3)] + ["lm_head"]
    assert names(["model.layers"]) == ["model.layers"]  # literal, whole-name match
    with pytest.raises(UsageError, match="parallel.fsdp_modules: pattern 'model.blocks.{}' matches no module"):
        require_matches(model, ["model.blocks.{}"], "parallel.fsdp_modules")


def _tiny_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    values = dict(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=128, decoder_sparse_step=1, mlp_only_layers=[],
                  tie_word_embeddings=False)
    values.update(overrides)
    return Qwen3MoeConfig(**values)


@pytest.mark.parametrize("meta", [False, True])
def test_qwen3_moe_model_id_loads_stock_per_expert_checkpoints(tmp_path, ctx, meta):
    from transformers import Qwen3MoeForCausalLM

    from fsdp2_backend.models.loading import create_model, load_hf_config

    torch.manual_seed(4)
    Qwen3MoeForCausalLM(_tiny_moe_config()).save_pretrained(tmp_path)
    reference = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    config = _config(str(tmp_path), model_id="qwen3_moe", init_model_with_meta_device=meta)
    from fsdp2_backend.parallel.apply import apply_parallelism

    model = create_model(config.model, load_hf_config(config.model), seed=0, device=torch.device("cpu"),
                         parallelize=lambda m: apply_parallelism(m, config, ctx))
    assert type(model).__name__.endswith("Qwen3MoeGroupedForCausalLM")
    ids = torch.randint(0, 300, (2, 12))
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids), rtol=1e-5, atol=1e-5)


def test_trainer_adds_the_moe_aux_loss_to_backward(tmp_path, ctx):
    """The trainer's gradients equal those of mean CE + router_aux_loss_coef x aux_loss (HF's own loss)."""
    import torch.nn.functional as F
    from transformers import Qwen3MoeForCausalLM

    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism
    from fsdp2_backend.build import TrainJob
    from fsdp2_backend.training.grad_clip import clip_grad_norm
    from fsdp2_backend.training.trainer import Trainer

    torch.manual_seed(4)
    Qwen3MoeForCausalLM(_tiny_moe_config(output_router_logits=True, router_aux_loss_coef=0.5)).save_pretrained(
        tmp_path)
    config = _config(str(tmp_path), model_id="qwen3_moe")
    config.training.per_device_train_batch_size = 2
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=torch.device("cpu"),
                         parallelize=lambda m: apply_parallelism(m, config, ctx))
    text = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = dict(tokens=text[:, :-1], labels=text[:, 1:], loss_mask=torch.ones(2, 16))
    reference = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    out = reference(input_ids=batch["tokens"])
    assert out.aux_loss is not None and out.aux_loss.item() > 0
    (F.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten()) + 0.5 * out.aux_loss).backward()
    seen = {}

    def capture(params, max_norm):
        seen.update({n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None})
        return clip_grad_norm(params, max_norm)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    trainer = Trainer(TrainJob(config=config, ctx=ctx, model=model, optimizer=optimizer,
                               scheduler=type("Fixed", (), {"step": lambda s, n: None})(), train_batches=iter([batch]),
                               train_iters=1, micro_batches=1, clip_fn=capture))
    trainer.train_step()
    ref = dict(reference.named_parameters())
    gate = "model.layers.0.mlp.gate.weight"
    torch.testing.assert_close(seen[gate], ref[gate].grad, rtol=1e-4, atol=1e-6)
    without_aux = torch.autograd.grad(F.cross_entropy(reference(input_ids=batch["tokens"]).logits.flatten(0, 1),
                                                      batch["labels"].flatten()), ref[gate])[0]
    assert not torch.allclose(seen[gate], without_aux, rtol=1e-3)  # the aux loss does reach the router
    torch.testing.assert_close(seen["lm_head.weight"], ref["lm_head.weight"].grad, rtol=1e-4, atol=1e-6)
