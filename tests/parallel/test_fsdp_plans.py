"""The FSDP2 / recompute stages on one real rank: plans reach fully_shard, recompute recomputes without
changing the numbers, prefetch and placement options take effect, device/backend selection is honoured."""
import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from fsdp2_backend.config import Config
from fsdp2_backend.usage_errors import UsageError
from tests.support.tiny_models import tiny_qwen3_config


def shard_rows_of_matrices_by_columns(param):
    """A shard placement for the test: 2-D parameters sharded on dim 1, the rest default (dim 0)."""
    return Shard(1) if param.dim() == 2 else None


@pytest.fixture(scope="module")
def ctx():
    from fsdp2_backend.distributed.context import ParallelContext

    context = ParallelContext.create(Config().parallel)
    yield context
    context.close()


def _model(config, ctx, seed=0):
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.parallel.apply import apply_parallelism

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=2))
    return apply_parallelism(model, config, ctx)


def _config(**parallel):
    config = Config()
    config.parallel.param_dtype = "fp32"
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    return config


def _loss_and_grads(model):
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731  (ignored params are plain)
    return loss.item(), {n: full(p.grad).clone() for n, p in model.named_parameters()}


def test_recompute_reruns_layer_forwards_and_keeps_numbers(ctx):
    plain = _model(_config(), ctx)
    recomputed = _model(_config(recompute=True, recompute_modules=["model.layers.{*}"]), ctx)
    calls = []
    for layer in recomputed.model.layers:
        # a pre-hook: recomputation stops early once the last saved tensor is rebuilt (inside the MLP)
        layer.mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    loss_a, grads_a = _loss_and_grads(plain)
    loss_b, grads_b = _loss_and_grads(recomputed)
    assert len(calls) == 4  # 2 layers x (forward + recomputation in backward)
    assert loss_a == loss_b
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-6, atol=1e-7)
    names = [n for n, _ in recomputed.named_parameters()]
    assert names == [n for n, _ in plain.named_parameters()]  # no wrapper module: state-dict keys unchanged


def test_fsdp_units_prefetch_ignored_modules_and_placement(ctx):
    from torch.distributed.fsdp import FSDPModule

    config = _config(ignored_modules=["*.q_norm"], num_to_forward_prefetch=2, num_to_backward_prefetch=1,
                     shard_placement_fn=f"{__name__}.shard_rows_of_matrices_by_columns")
    model = _model(config, ctx)
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert units == ["", "model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    q_norm = model.model.layers[0].self_attn.q_norm.weight
    assert not isinstance(q_norm, DTensor)  # ignored: FSDP leaves it alone
    assert model.model.layers[0].mlp.up_proj.weight.placements == (Shard(1),)
    assert model.model.norm.weight.placements == (Shard(0),)
    embed = model.model.embed_tokens
    prefetch = embed._get_fsdp_state()._states_to_forward_prefetch
    assert [s._fsdp_param_group.modules for s in prefetch] == [(model.model.layers[0],), (model.model.layers[1],)]
    # the output layer stays gathered from its forward to its backward (that follows at once); the others reshard
    resharded = {n: m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                 for n, m in model.named_modules() if isinstance(m, FSDPModule) and n}
    assert resharded == {"model.embed_tokens": True, "model.layers.0": True, "model.layers.1": True, "lm_head": False}
    _loss_and_grads(model)  # and it trains


def test_tied_embeddings_stay_with_the_root(ctx):
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.parallel.apply import apply_parallelism

    model = Qwen3ForCausalLM(tiny_qwen3_config(tie_word_embeddings=True))
    model = apply_parallelism(model, _config(), ctx)
    from torch.distributed.fsdp import FSDPModule

    assert model.lm_head.weight is model.model.embed_tokens.weight
    # a parameter can belong to one FSDP unit only: the tied pair is left to the root
    assert not isinstance(model.lm_head, FSDPModule) and not isinstance(model.model.embed_tokens, FSDPModule)
    assert isinstance(model.model.layers[0], FSDPModule)
    _loss_and_grads(model)


def test_a_tie_with_an_unmatched_module_stays_with_the_root(ctx, capsys):
    """GPT-2 (what Megatron's tied, learned-position flags build): of the default plan only `lm_head` matches,
    and `transformer.wte` shares its weight from outside it — wrapping lm_head alone made FSDP2 refuse the
    root ("shared with a parameter already managed by another FSDP group")."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import GPT2Config, GPT2LMHeadModel

    from fsdp2_backend.parallel.apply import apply_parallelism

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                       tie_word_embeddings=True))
    model = apply_parallelism(model, _config(), ctx)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not isinstance(model.lm_head, FSDPModule) and isinstance(model, FSDPModule)
    # the default plan's `model.layers.{}` is not GPT-2's path: its blocks (GPT2Block) are the units instead
    assert all(isinstance(block, FSDPModule) for block in model.transformer.h)
    loss = model(input_ids=torch.randint(0, 128, (2, 16)), labels=torch.randint(0, 128, (2, 16))).loss
    loss.backward()
    assert torch.isfinite(loss) and model.transformer.wte.weight.grad is not None
    assert "decoder blocks transformer.h.{} are the FSDP units" in capsys.readouterr().out


def test_bad_options_are_usage_errors(ctx):
    with pytest.raises(UsageError, match="parallel.shard_placement_fn: cannot import 'no.such.fn'"):
        _model(_config(shard_placement_fn="no.such.fn"), ctx)
    with pytest.raises(UsageError, match="parallel.recompute_modules: pattern 'blocks.{}' matches no module"):
        _model(_config(recompute=True, recompute_modules=["blocks.{}"]), ctx)
    # model.quant_* fields are checked by config validation, before any stage runs (tests/config/test_quantize_config.py)


def test_device_and_backend_selection():
    from fsdp2_backend.distributed.device import resolve_device

    device = resolve_device()
    assert (device.type, device.backend) == ("cpu", "gloo")  # this machine has no accelerator
    with pytest.raises(UsageError, match="--distributed-backend .*'nccl' cannot run on this machine's cpu"):
        resolve_device("nccl")
    assert resolve_device("gloo").backend == "gloo"


def test_tp_plans_use_the_plan_globs():
    """TP selects modules with the same globs as FSDP / EP / recompute: `{*}` works in tp_colwise too."""
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.parallel.plans import unmatched_patterns
    from fsdp2_backend.parallel.tensor_parallel import plan_modules

    model = Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=2))
    by_path = plan_modules(model, ["model.layers.{*}.self_attn.q_proj"], "tp_colwise")
    assert by_path == plan_modules(model, ["*.q_proj"], "tp_colwise")
    assert by_path == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert plan_modules(model, ["*.q_proj"], "tp_colwise", exclude=["model.layers.{*}.self_attn.q_proj"]) == []
    assert unmatched_patterns(model, ["*.q_proj", "model.blocks.{}", "lm_head"]) == ["model.blocks.{}"]
    with pytest.raises(UsageError, match="tp_colwise: the globs model.blocks.{} match no module"):
        plan_modules(model, ["model.blocks.{}"], "tp_colwise")


def test_a_plan_pattern_matching_nothing_is_a_warning_where_plans_are_shared(capsys):
    """MindSpeed's Qwen3-235B YAML ignores `model.layers.{*}.mlp.router`, which our model calls `gate`: a warning
    line, not an error; a field whose patterns all match nothing still fails where the stage needs a module."""
    from torch import nn

    from fsdp2_backend.parallel.plans import lenient_matches

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(2, 2)])
    assert lenient_matches(model, ["layers.{*}.router"], "parallel.ignored_modules", require_one=False) == []
    assert "warning: parallel.ignored_modules: pattern 'layers.{*}.router' matches no module" in capsys.readouterr().out
    assert [n for n, _ in lenient_matches(model, ["layers.{*}", "x"], "parallel.ep_modules")] == ["layers.0"]
    with pytest.raises(UsageError):
        lenient_matches(model, ["x"], "parallel.ep_modules")
