"""The qwen3_next model against transformers' Qwen3-Next (its torch GDN fallback and per-expert loop) for the
same weights; packed documents against the documents run one by one; the HF checkpoint layout."""
import pytest
import torch

from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.qwen3_next.modeling import (GatedDeltaNet, Qwen3NextRouter, build_qwen3_next,
                                             configure_qwen3_next)

from tests.support.tiny_models import tiny_next_config


def _pair(**overrides):
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(0)
    hf = Qwen3NextForCausalLM(tiny_next_config(**overrides)).eval()
    ours = build_qwen3_next(tiny_next_config(**overrides)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def _batch(seed=1, length=40):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, length), generator=g)
    return dict(input_ids=ids, labels=ids, use_cache=False)


@pytest.mark.parametrize("grouped_gemm,chunk", [(False, 64), (True, 16)])
def test_logits_aux_loss_and_gradients_equal_transformers(grouped_gemm, chunk):
    hf, ours = _pair()
    configure_qwen3_next(ours, moe_grouped_gemm=grouped_gemm, fix_router=False, gdn_chunk_size=chunk,
                         gdn_implementation="torch")
    layers = ours.model.layers
    assert [type(l.linear_attn) for l in layers[:3]] == [GatedDeltaNet] * 3 and layers[3].self_attn is not None
    assert isinstance(layers[0].mlp.experts, GroupedExperts) and isinstance(layers[0].mlp.gate, Qwen3NextRouter)
    out_hf, out = hf(**_batch()), ours(**_batch())
    torch.testing.assert_close(out.logits, out_hf.logits, rtol=1e-5, atol=1e-5)
    assert float(out.aux_loss.detach()) > 0
    torch.testing.assert_close(out.aux_loss, out_hf.aux_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.loss, out_hf.loss, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    out_hf.loss.backward()
    grads_hf = {n: p.grad for n, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, grads_hf[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packed_documents_equal_documents_run_separately():
    _, ours = _pair()
    configure_qwen3_next(ours, moe_grouped_gemm=False, fix_router=False, gdn_chunk_size=8,
                         gdn_implementation="torch")
    g = torch.Generator().manual_seed(2)
    lengths = [[13, 19], [32]]  # row 0 packs two documents
    docs = [[torch.randint(0, 128, (1, n), generator=g) for n in row] for row in lengths]
    ids = torch.cat([torch.cat(row, dim=1) for row in docs])
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in lengths])
    packed = ours(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    for r, row in enumerate(docs):
        start = 0
        for doc in row:
            alone = ours(input_ids=doc, use_cache=False).logits
            torch.testing.assert_close(packed[r, start:start + doc.shape[1]], alone[0], rtol=1e-5, atol=1e-5)
            start += doc.shape[1]


def test_fix_router_balances_the_next_router():
    _, ours = _pair()
    configure_qwen3_next(ours, moe_grouped_gemm=False, fix_router=True, gdn_chunk_size=64,
                         gdn_implementation="torch")
    _, scores, index = ours.model.layers[0].mlp.gate(torch.randn(10, 64))
    assert torch.bincount(index.flatten(), minlength=4).tolist() == [5, 5, 5, 5]
    torch.testing.assert_close(scores.sum(-1), torch.ones(10))


def test_export_loads_in_transformers_and_mtp_keys_are_ignored(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3NextForCausalLM

    hf, ours = _pair()
    ours.save_pretrained(tmp_path / "export")
    shard = tmp_path / "export" / "model.safetensors"
    on_disk = load_file(shard)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in on_disk  # transformers' per-expert layout
    on_disk["mtp.fc.weight"] = torch.zeros(2, 2)  # a released checkpoint's MTP head: ignored on load
    save_file(on_disk, shard, metadata={"format": "pt"})
    back = Qwen3NextForCausalLM.from_pretrained(tmp_path / "export").eval()
    again = build_qwen3_next(back.config).eval()
    loaded = Qwen3NextForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    again.load_state_dict(loaded, strict=True)
    batch = _batch()
    torch.testing.assert_close(back(**batch).logits, hf(**batch).logits)
    torch.testing.assert_close(again(**batch).logits, ours(**batch).logits)


@pytest.fixture(scope="module")
def ctx():
    from fsdp2_backend.config import Config
    from fsdp2_backend.distributed.context import ParallelContext

    context = ParallelContext.create(Config().parallel)
    yield context
    context.close()


@pytest.mark.parametrize("meta", [False, True])
def test_model_id_streams_stock_checkpoints_with_mtp_keys(tmp_path, ctx, meta):
    """A transformers-saved Qwen3-Next directory (per-expert keys, plus an MTP key) streams into the model id."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3NextForCausalLM

    from fsdp2_backend.config import Config
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism

    torch.manual_seed(4)
    config_hf = tiny_next_config()
    Qwen3NextForCausalLM(config_hf).save_pretrained(tmp_path)
    shard = tmp_path / "model.safetensors"
    tensors = load_file(shard)
    tensors["mtp.layers.0.mlp.gate.weight"] = torch.zeros(4, 64)
    save_file(tensors, shard, metadata={"format": "pt"})
    reference = Qwen3NextForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    config = Config()
    config.model.model_name_or_path = str(tmp_path)
    config.model.model_id = "qwen3_next"
    config.model.init_model_with_meta_device = meta
    config.parallel.param_dtype = "fp32"
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=torch.device("cpu"),
                         parallelize=lambda m: apply_parallelism(m, config, ctx))
    assert type(model).__name__.endswith("Qwen3NextGroupedForCausalLM")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits,
                                   reference(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_gated_norm_kernel_swap_keeps_transformers_logits():
    """use_triton_rmsnormgated: the GDN output norm through kernels.rmsnorm_gated (its reference on CPU)."""
    hf, ours = _pair()
    configure_qwen3_next(ours, moe_grouped_gemm=False, fix_router=False, gdn_chunk_size=64,
                         gdn_implementation="torch", fused_gated_norm=True)
    assert ours.model.layers[0].linear_attn.fused_norm
    with torch.no_grad():
        torch.testing.assert_close(ours(**_batch()).logits, hf(**_batch()).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("meta", [False, True])
def test_transformers_class_streams_per_expert_checkpoints(tmp_path, ctx, meta):
    """model_id unset (transformers' own Qwen3NextForCausalLM, as MindSpeed's YAMLs use): a transformers-saved
    directory (per-expert keys) streams through `load_safetensors`, and the logits equal `from_pretrained`'s.
    Without meta init, `create_model` itself calls `from_pretrained`, so the streaming loader is driven
    directly on a freshly built transformers model (the path a resized vocabulary takes)."""
    from transformers import Qwen3NextForCausalLM

    from fsdp2_backend.config import Config
    from fsdp2_backend.models.loading import create_model, load_hf_config, load_safetensors
    from fsdp2_backend.parallel.apply import apply_parallelism

    torch.manual_seed(5)
    Qwen3NextForCausalLM(tiny_next_config()).save_pretrained(tmp_path)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in _saved_keys(tmp_path)
    reference = Qwen3NextForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    config = Config()
    config.model.model_name_or_path = str(tmp_path)
    config.model.init_model_with_meta_device = meta
    config.parallel.param_dtype = "fp32"
    hf_config = load_hf_config(config.model)
    if meta:
        model = create_model(config.model, hf_config, seed=0, device=torch.device("cpu"),
                             parallelize=lambda m: apply_parallelism(m, config, ctx))
    else:
        torch.manual_seed(6)
        model = Qwen3NextForCausalLM(hf_config).float()
        load_safetensors(model, str(tmp_path), hf_config=hf_config)
    assert type(model).__name__.endswith("Qwen3NextForCausalLM")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits,
                                   reference(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_transformers_qwen3_moe_class_streams_per_expert_checkpoints(tmp_path):
    """The same gap for transformers' Qwen3MoeForCausalLM: its stacked experts from per-expert keys."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from fsdp2_backend.models.loading import load_safetensors

    torch.manual_seed(7)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    assert "model.layers.1.mlp.experts.2.gate_proj.weight" in _saved_keys(tmp_path)
    reference = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    torch.manual_seed(8)
    model = Qwen3MoeForCausalLM(config).float().eval()
    load_safetensors(model, str(tmp_path), hf_config=config)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def _saved_keys(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


def test_a_config_carrying_transformers_experts_choice_builds_our_models_first_in_a_process():
    """transformers caches on the first class it checks whether a class may take `_experts_implementation`; our
    grouped subclasses inherited the answer or not depending on which model a process built first, so a config
    from `from_pretrained` (it carries "grouped_mm") failed to build our model when ours came first (found by the
    full test run). A fresh process builds ours first, for the grouped model ids."""
    import subprocess
    import sys

    from tests.support.launchers import REPO

    code = """
import torch
from tests.support.tiny_models import tiny_moe_config, tiny_next_config
from fsdp2_backend.models.qwen3_next.modeling import build_qwen3_next
from fsdp2_backend.models.registry import model_spec
for build, config in ((build_qwen3_next, tiny_next_config()), (model_spec("qwen3_moe").build, tiny_moe_config())):
    config._experts_implementation = "grouped_mm"
    build(config)
print("built")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "built" in result.stdout, result.stderr[-2000:]
