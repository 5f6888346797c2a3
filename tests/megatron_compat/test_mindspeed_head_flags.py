"""The 68 MindSpeed-LLM flags its full list (c77308a1, 351 names) added: each parsed with MindSpeed's type and
given a real answer — e.g. --deterministic-mode mapped to training.deterministic (Megatron's default: off),
--enable-mla-scale-q-lora mapped to model.mla_scale_q_lora (no effect without MLA), high-availability and kernel choices without effect."""
import pytest

from megatron_compat.parse import arguments
from megatron_compat.translate import translate_report

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
        "--micro-batch-size 1 --train-iters 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128").split()


MLA = "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 4 " \
      "--v-head-dim 8".split()


def test_the_shipped_list_is_mindspeeds_full_list():
    names = arguments.mindspeed_llm_names()
    assert len(names) == 351 and "--enable-mla-scale-q-lora" in names and "--quant-states" in names


@pytest.mark.parametrize("flags, kind, text", [
    (["--deterministic-mode"], "mapped", "training.deterministic"),
    (["--enable-mla-scale-q-lora"], "no_effect", None),  # MindSpeed reads it only in MLA
    (MLA + ["--enable-mla-scale-q-lora"], "mapped", "model.mla_scale_q_lora"),
    (MLA + ["--enable-mla-scale-kv-lora"], "mapped", "model.mla_scale_kv_lora"),
    (MLA[:1] + MLA[3:] + ["--enable-mla-scale-q-lora"], "declined", "no --q-lora-rank"),
    (["--activation-offload"], "mapped", "parallel.activation_offload_layers = -1"),
    (["--activation-offload", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "declined", "does not combine with recompute"),
    (["--activation-offload", "--cpu-offloading-num-layers", "1"], "no_effect", None),
    (["--fsdp2-config-path", "fsdp2_config.yaml"], "declined", "offload_to_cpu: true is FSDP2's CPUOffloadPolicy "
                                                                "= parallel.cpu_offload"),
    (["--quant-states", "mxfp8"], "declined", "quantised optimizer states"),
    (["--qat-scheme", "w4a8-moe-only", "--qat-quant-block-size", "32"], "declined", "quantisation-aware"),
    (["--layerwise-disaggregated-training"], "declined", "u-shaped split learning"),
    (["--enable-high-availability"], "no_effect", None),
    (["--te-gmm-mode", "performance"], "no_effect", None),
    (["--only-convert-last-checkpoint"], "no_effect", None),
])
def test_new_flags_get_an_answer(flags, kind, text):
    report = translate_report(BASE + flags).report
    lists = {"mapped": dict(report.mapped), "declined": dict(report.declined),
             "no_effect": {flag: None for flag in report.no_effect}}
    flag = next(f for f in flags if f.startswith("--enable-mla")) if "--multi-latent-attention" in flags else flags[0]
    assert flag in lists[kind], (flags, report)
    if text:
        assert text in str(lists[kind][flag])


def test_deterministic_follows_megatrons_default():
    assert translate_report(BASE).fields["training"]["deterministic"] is False
    assert translate_report(BASE + ["--deterministic-mode"]).fields["training"]["deterministic"] is True


def test_mindspeed_types_and_choices():
    ns = arguments.parse_megatron_args(["--index-skip-topk-offset", "3", "--te-gmm-mode", "performance",
                                        "--quant-states", "hif8", "--saver", "mcore"])
    assert (ns.index_skip_topk_offset, ns.te_gmm_mode, ns.quant_states, ns.saver) == (3, "performance", "hif8",
                                                                                      "mcore")
    assert arguments.parse_megatron_args([]).index_skip_topk_offset == 2
    from fsdp2_backend.usage_errors import UsageError
    with pytest.raises(UsageError, match="--qat-quant-block-size"):
        arguments.parse_megatron_args(["--qat-quant-block-size", "64"])


def test_mla_scales_land_on_the_model_fields():
    fields = translate_report(BASE + MLA + ["--enable-mla-scale-q-lora", "--enable-mla-scale-kv-lora"]).fields
    assert (fields["model"]["mla_scale_q_lora"], fields["model"]["mla_scale_kv_lora"]) == (True, True)
    assert "mla_scale_q_lora" not in translate_report(BASE + MLA).fields["model"]


def test_activation_offload_puts_every_layer_on_the_host():
    """MindSpeed's (pre-March-2026 FSDP2) --activation-offload: every decoder layer; an explicit count wins."""
    assert translate_report(BASE + ["--activation-offload"]).fields["parallel"]["activation_offload_layers"] == -1
    fields = translate_report(BASE + ["--activation-offload", "--cpu-offloading-num-layers", "1"]).fields
    assert fields["parallel"]["activation_offload_layers"] == 1
    assert "activation_offload_layers" not in translate_report(BASE).fields["parallel"]
