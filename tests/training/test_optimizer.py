"""Optimizer groups (Megatron's weight-decay rule, Muon vs AdamW split), training on a tiny Qwen3, and
ShardedMuon on 2 FSDP2 ranks against torch.optim.Muon on 1 rank."""
import os
import tempfile

import pytest
import torch

from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.training.optimizer import ShardedMuon, build_optimizer
from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_qwen3_config


@pytest.fixture(scope="module")
def qwen3():
    from transformers import Qwen3ForCausalLM

    def make():
        torch.manual_seed(0)
        return Qwen3ForCausalLM(tiny_qwen3_config(attention_bias=True, num_hidden_layers=1))
    return make


def _names(model, opt_groups):
    ids = {id(p): n for n, p in model.named_parameters()}
    return [{ids[id(p)] for p in g["params"]} for g in opt_groups]


def test_adamw_groups_follow_megatron_weight_decay_rule(qwen3):
    model = qwen3()
    opt = build_optimizer(model, name="adamw", lr=1e-3, weight_decay=0.1)
    assert len(opt.optimizers) == 1 and isinstance(opt.optimizers[0], torch.optim.AdamW)
    decay, no_decay = _names(model, opt.param_groups)
    assert [g["wd_mult"] for g in opt.param_groups] == [1.0, 0.0]
    assert "model.embed_tokens.weight" in decay and "lm_head.weight" in decay
    assert "model.layers.0.self_attn.q_proj.weight" in decay
    assert "model.layers.0.self_attn.q_proj.bias" in no_decay and "model.norm.weight" in no_decay
    assert "model.layers.0.self_attn.q_norm.weight" in no_decay
    for name, p in model.named_parameters():
        assert (name in no_decay) == (p.dim() == 1 or name.endswith(".bias"))
    assert decay | no_decay == {n for n, _ in model.named_parameters()}


def test_muon_takes_layer_matrices_and_adamw_the_rest(qwen3):
    model = qwen3()
    opt = build_optimizer(model, name="muon", lr=1e-3, weight_decay=0.1)
    muon, adamw = opt.optimizers
    assert isinstance(muon, ShardedMuon) and isinstance(adamw, torch.optim.AdamW)
    (muon_names,) = _names(model, muon.param_groups)
    adamw_decay, adamw_no_decay = _names(model, adamw.param_groups)
    layer = "model.layers.0."
    assert muon_names == {layer + m + ".weight" for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                          "self_attn.v_proj", "self_attn.o_proj",
                                                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert adamw_decay == {"model.embed_tokens.weight", "lm_head.weight"}
    assert "model.norm.weight" in adamw_no_decay and layer + "self_attn.q_proj.bias" in adamw_no_decay
    assert len(opt.param_groups) == 3


@pytest.mark.parametrize("name,lr", [("adamw", 3e-3), ("muon", 3e-3)])
def test_each_optimizer_makes_the_loss_fall(qwen3, name, lr):
    model = qwen3()
    opt = build_optimizer(model, name=name, lr=lr, weight_decay=0.01)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    state = opt.state_dict()
    assert set(state) == {type(o).__name__ for o in opt.optimizers}
    fresh = build_optimizer(model, name=name, lr=lr, weight_decay=0.01)
    fresh.load_state_dict(state)
    assert fresh.optimizers[0].state_dict()["state"].keys() == opt.optimizers[0].state_dict()["state"].keys()
    # DCP's state-dict API takes the combined optimizer as an iterable of optimizers
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _, optim_sd = get_state_dict(model, opt)
    dcp_fresh = build_optimizer(model, name=name, lr=lr, weight_decay=0.01)
    set_state_dict(model, dcp_fresh, model_state_dict=model.state_dict(), optim_state_dict=optim_sd)
    for ours, loaded in zip(opt, dcp_fresh):
        for p in ours.state:
            torch.testing.assert_close(loaded.state[p], ours.state[p])


def test_unknown_optimizer_is_a_usage_error(qwen3):
    with pytest.raises(UsageError, match="optimizer"):
        build_optimizer(qwen3(), name="sgd", lr=1.0, weight_decay=0.0)


def _mlp():
    torch.manual_seed(0)
    # tall, wide and uneven (7 rows on 2 ranks) matrices
    return torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 7, bias=False))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=g) for _ in range(3)]


def _muon_worker(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ShardedMuon(model.parameters(), lr=0.02, weight_decay=0.1)
    for x in _batches():
        model(x).pow(2).sum().backward()  # same data on both ranks; FSDP averages the equal grads
        opt.step()
        opt.zero_grad()
    full = [p.full_tensor() for p in model.parameters()]
    if rank == 0:
        torch.save(full, out)


def test_sharded_muon_on_two_fsdp2_ranks_equals_torch_muon_on_one():
    model = _mlp()
    opt = torch.optim.Muon(model.parameters(), lr=0.02, weight_decay=0.1)
    for x in _batches():
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "w.pt")
        run_distributed(_muon_worker, 2, out)
        got = torch.load(out)
    for ref, p in zip(model.parameters(), got):
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)


def _group_of(model, opt):
    """name → (wd_mult, max_lr, min_lr) of its param group (None where the group follows the default)."""
    ids = {id(p): n for n, p in model.named_parameters()}
    return {ids[id(p)]: (g["wd_mult"], g.get("max_lr"), g.get("min_lr")) for g in opt.param_groups for p in g["params"]}


def test_qk_norm_weights_decay_only_when_asked(qwen3):
    model = qwen3()
    qk = {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"}
    plain = _group_of(model, build_optimizer(model, lr=1e-3, weight_decay=0.1))
    assert all(plain[n][0] == 0.0 for n in qk)
    for name in ("muon", "adamw"):
        groups = _group_of(model, build_optimizer(model, name=name, lr=1e-3, weight_decay=0.1,
                                                  apply_wd_to_qk_layernorm=True))
        assert all(groups[n][0] == 1.0 for n in qk)
        # every other parameter keeps Megatron's default rule
        assert {n: g[0] for n, g in groups.items() if n not in qk} == {n: g[0] for n, g in plain.items() if n not in qk}


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_decoupled_lr_groups_hold_embedding_and_output_layer(qwen3, name):
    model = qwen3()
    heads = {"model.embed_tokens.weight", "lm_head.weight"}
    opt = build_optimizer(model, name=name, lr=1e-3, weight_decay=0.1, decoupled_lr=5e-3, decoupled_min_lr=1e-5)
    groups = _group_of(model, opt)
    assert {n for n, g in groups.items() if g[1] is not None} == heads
    assert all(groups[n] == (1.0, 5e-3, 1e-5) for n in heads)
    assert opt.param_groups[0].get("max_lr") is None  # the default schedule comes first (the logged lr)
    without_min = _group_of(model, build_optimizer(model, name=name, lr=1e-3, weight_decay=0.1, decoupled_lr=5e-3))
    assert all(without_min[n] == (1.0, 5e-3, None) for n in heads)  # min_lr: the scheduler's (training.min_lr)
    assert all(g[1] is None for g in _group_of(model, build_optimizer(model, name=name, lr=1e-3,
                                                                      weight_decay=0.1)).values())


def _megatron_groups_worker(rank, world, out):
    """Our groups on an FSDP2-sharded tiny Qwen3 vs megatron-core's _get_param_groups on an unsharded copy."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3ForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    def make(tie):
        torch.manual_seed(0)
        return Qwen3ForCausalLM(tiny_qwen3_config(attention_bias=True, num_hidden_layers=1, tie_word_embeddings=tie))

    results = {}
    for tie in (False, True):
        reference = make(tie)
        # What Megatron's LanguageModule marks: the word embedding, and the output layer unless it is shared.
        for module in (reference.get_input_embeddings(), reference.get_output_embeddings()):
            module.weight.is_embedding_or_output_parameter = True
        config = OptimizerConfig(lr=1e-3, min_lr=1e-4, weight_decay=0.1, decoupled_lr=5e-3, decoupled_min_lr=2e-5)
        ref_groups = _get_param_groups([reference], config, None)
        names = {id(p): n for n, p in reference.named_parameters()}
        want = {names[id(p)]: (g["wd_mult"], g["max_lr"], g["min_lr"]) for g in ref_groups for p in g["params"]}

        model = make(tie)
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.model.layers[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, decoupled_lr=5e-3, decoupled_min_lr=2e-5)
        ours = {n: (wd, max_lr or 1e-3, min_lr or 1e-4) for n, (wd, max_lr, min_lr) in _group_of(model, opt).items()}
        results[str(tie)] = (ours == want, sorted(set(ours.items()) ^ set(want.items())))
    if rank == 0:
        torch.save(results, out)


def test_decoupled_groups_match_megatron_core_under_fsdp2():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "groups.pt")
        run_distributed(_megatron_groups_worker, 1, out)
        results = torch.load(out)
    assert results == {"False": (True, []), "True": (True, [])}
