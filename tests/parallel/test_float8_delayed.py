"""The delayed FP8 recipe (fsdp2_backend/parallel/float8_delayed.py: Transformer Engine's DelayedScaling, Megatron's
default): the scale a step uses comes from the amaxes of the steps before it, by TE's rule written out here from its
documented semantics (a window of the last `history_len` amaxes, max or most recent, 2^(floor(log2(fp8_max / amax))
- margin) as TE before 1.0 rounded it, kept where the amax is 0); the saved state loads only into the same linears;
Megatron's flags map to the native fields; a run stopped and resumed equals the straight run. The layouts (TP 2, TP
2 × FSDP 2, CP 2) and the TP 2 → 1 rank resume: tests/parallel/test_float8_tensor_parallel.py."""
import math

import pytest
import torch

from fsdp2_backend.kernels.float8 import E4M3, E5M2, float8_linear
from fsdp2_backend.parallel.float8_delayed import DelayedScaling
from megatron_compat.translate import translate_megatron as megatron_translate, translate_report


def _te_scales(amaxes, history_len, algo, margin, fmax):
    """The scale of each step (TE's DelayedScaling, by hand): step t uses the scale computed after step t-1 from
    the amaxes of steps t-1, t-2, ... (at most history_len of them); 1 before any amax; kept where the amax is 0."""
    scales, scale = [], 1.0
    for t, _ in enumerate(amaxes):
        scales.append(scale)
        window = amaxes[max(0, t + 1 - history_len):t + 1]
        amax = max(window) if algo == "max" else amaxes[t]
        if amax > 0:  # TE < 1.0's power of two (float8_delayed's docstring says why)
            scale = 2.0 ** (math.floor(math.log2(fmax / amax)) - margin)
    return scales


@pytest.mark.parametrize("history_len,algo,margin", [(3, "max", 1), (1, "most_recent", 0), (4, "most_recent", 2)])
def test_each_step_uses_the_scale_of_the_steps_before(history_len, algo, margin):
    layer = torch.nn.Linear(16, 8, bias=False)
    state = DelayedScaling(["layer"], history_len, algo, margin, grad_format="hybrid")
    quantize = state.quantizer(0, layer)
    gains = [2.0, 300.0, 0.5, 0.0, 7.0, 1000.0]  # a zero step keeps the scale
    used_x, used_dy, amax_x, amax_dy = [], [], [], []
    torch.manual_seed(0)
    for gain in gains:
        x = (torch.randn(4, 16) * gain).requires_grad_()
        out = float8_linear(x, layer.weight, recipe="delayed", grad_format="hybrid", quantize=quantize)
        grad = torch.randn_like(out) * gain * 3
        out.backward(grad)
        used_x.append(state.scale[0, 0].item())
        used_dy.append(state.scale[0, 2].item())
        amax_x.append(x.detach().abs().max().item())
        amax_dy.append(grad.abs().max().item())
        state.update()
    fmax4, fmax5 = torch.finfo(E4M3).max, torch.finfo(E5M2).max
    assert used_x == pytest.approx(_te_scales(amax_x, history_len, algo, margin, fmax4), rel=1e-6)
    assert used_dy == pytest.approx(_te_scales(amax_dy, history_len, algo, margin, fmax5), rel=1e-6)
    # the forward's x used the step's stored scale: saturate(x * s) in E4M3, / s
    s = state.scale[0, 0]
    x = torch.randn(4, 16) * 5
    want_w = (layer.weight.float() * state.scale[0, 1]).clamp(-fmax4, fmax4).to(E4M3).float() / state.scale[0, 1]
    want = (x * s).clamp(-fmax4, fmax4).to(E4M3).float() / s
    with torch.no_grad():
        got = float8_linear(x, layer.weight, recipe="delayed", quantize=quantize)
    torch.testing.assert_close(got, (want.double() @ want_w.double().t()).float())


def test_eval_records_nothing_and_the_state_loads_only_into_the_same_linears():
    layer = torch.nn.Linear(4, 4, bias=False)
    state = DelayedScaling(["a"], 2, "max", 0)
    layer.eval()
    float8_linear(torch.ones(2, 4) * 9, layer.weight, recipe="delayed", quantize=state.quantizer(0, layer))
    assert state.amax.abs().sum() == 0
    layer.train()
    float8_linear(torch.ones(2, 4) * 9, layer.weight, recipe="delayed", quantize=state.quantizer(0, layer))
    state.update()
    other = DelayedScaling(["a"], 2, "max", 0)
    other.load_state_dict(state.state_dict())
    assert torch.equal(other.scale, state.scale) and torch.equal(other.history, state.history)
    with pytest.raises(ValueError, match="resume with the FP8 settings it was saved with"):
        DelayedScaling(["a"], 3, "max", 0).load_state_dict(state.state_dict())
    with pytest.raises(ValueError, match="pass its quantizer"):
        float8_linear(torch.ones(2, 4), layer.weight, recipe="delayed")


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
        "--micro-batch-size 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --lr 1e-3 "
        "--train-iters 3").split()


def test_megatron_flags_map_to_the_delayed_recipe():
    t = translate_report(BASE + "--fp8-format hybrid --fp8-amax-history-len 16 --fp8-amax-compute-algo max "
                                "--fp8-margin 1 --fp8-interval 2".split())
    model = t.fields["model"]
    assert (model["quant_recipe_name"], model["quant_fp8_format"], model["quant_fp8_amax_history_len"],
            model["quant_fp8_amax_compute_algo"], model["quant_fp8_margin"]) == ("delayed", "hybrid", 16, "max", 1)
    assert not t.report.declined and t.report.no_effect == ["--fp8-interval"]
    t = translate_report(BASE + "--fp8-format e4m3 --fp8-recipe tensorwise --fp8-amax-history-len 16".split())
    assert "quant_fp8_amax_history_len" not in t.fields["model"] and t.report.no_effect == ["--fp8-amax-history-len"]


RUN = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 32 "
       "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --train-iters 5 --lr 1e-3 "
       "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --swiglu --normalization RMSNorm "
       "--disable-bias-linear --position-embedding-type rope --attention-dropout 0 --hidden-dropout 0 "
       "--log-interval 1 --save-interval 100 --eval-iters 0 --fp8-format hybrid --fp8-amax-history-len 3 "
       "--fp8-amax-compute-algo max --fp8-margin 1").split()


def _run(save_dir, *extra):
    """Builds and trains one run in this process (the launcher's build → Trainer path); (losses, final state)."""
    from fsdp2_backend.build import build
    from fsdp2_backend.config import GROUPS, Config
    from fsdp2_backend.config.validation import validate
    from fsdp2_backend.parallel.float8_delayed import delayed_scaling
    from fsdp2_backend.training.trainer import Trainer

    translation = megatron_translate(RUN + ["--save", str(save_dir), *extra])
    job = build(validate(Config(**{g: GROUPS[g](**v) for g, v in translation.fields.items()}), 1))
    try:
        job.logger.print_fn = lambda line: None
        losses = Trainer(job).train().losses
        return losses, delayed_scaling(job.model).state_dict()
    finally:
        job.close()


def test_a_run_stopped_and_resumed_equals_the_straight_run(tmp_path):
    """The histories and scales are saved with the checkpoint (build.py's states) and restored: bit-exact; the same
    checkpoint without them (fresh histories) gives other losses."""
    import shutil

    from fsdp2_backend.checkpoint.dirs import EXTRA_FILE

    straight, state = _run(tmp_path / "straight")
    assert (state["scale"] != 1).all()  # every tensor's scale came from its history
    first, _ = _run(tmp_path / "resumed", "--exit-interval", "2")
    shutil.copytree(tmp_path / "resumed", tmp_path / "fresh")
    (extra,) = (tmp_path / "fresh").glob(f"*/{EXTRA_FILE}")
    extra.unlink()
    second, resumed_state = _run(tmp_path / "resumed")
    assert first + second == straight and len(straight) == 5
    assert torch.equal(resumed_state["amax_history"], state["amax_history"])
    fresh, _ = _run(tmp_path / "fresh")
    assert first + fresh != straight


def test_native_fields_are_checked_and_unread_by_other_recipes():
    from dataclasses import replace

    from fsdp2_backend.config import GROUPS, Config
    from fsdp2_backend.config.validation import validate_with_notices
    from fsdp2_backend.usage_errors import UsageError

    def config(extra):
        translation = megatron_translate(RUN + extra.split())
        return Config(**{g: GROUPS[g](**v) for g, v in translation.fields.items()})

    with pytest.raises(UsageError) as err:
        validate_with_notices(config("--fp8-amax-history-len 0"), 1)
    assert [m for m in err.value.messages if m.startswith("model.quant_fp8_amax_history_len")] == [
        "model.quant_fp8_amax_history_len: 0 — the history holds at least the current step's amax: give 1 or more"]
    tensorwise = config("--fp8-recipe tensorwise")
    tensorwise = replace(tensorwise, model=replace(tensorwise.model, quant_fp8_margin=2))
    assert "model.quant_fp8_margin: no effect with quant_recipe_name tensorwise (read by the delayed recipe only)" \
        in validate_with_notices(tensorwise, 1)[1]
