"""Megatron / MindSpeed Mamba flags build this project's Mamba-3 when no --load defines the model
(`megatron_compat.architecture.mamba`): the translation, the flags' dispositions, what does not select it (hybrid
attention patterns, Qwen3-Next's GDN flags, a --load directory), and a short run through the real entry point.
"""
from __future__ import annotations

import json

from megatron_compat.translate import translate_report
from tests.support.launchers import run_pretrain

MAMBA = ("--num-layers 2 --hidden-size 32 --mamba-state-dim 16 --mamba-head-dim 8 --mamba-num-groups 2 "
         "--mamba-expand 2 --mamba-chunk-size 16 --seq-length 48 --micro-batch-size 2 --global-batch-size 4 "
         "--train-iters 3 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 127 "
         "--disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 --log-interval 1 "
         "--eval-iters 0").split()


def test_mamba_flags_translate_to_model_id_mamba3():
    t = translate_report(MAMBA + ["--mamba-d-conv", "4", "--num-attention-heads", "4", "--norm-epsilon", "1e-6"])
    assert not t.report.declined, t.report.declined
    assert t.fields["model"]["model_id"] == "mamba3"
    arch = t.fields["model"]["architecture"]
    assert {k: arch[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "state_size", "head_dim",
                                 "n_groups", "expand", "chunk_size", "layer_norm_epsilon", "use_bias",
                                 "tie_word_embeddings")} == dict(
        model_type="mamba3", num_hidden_layers=2, hidden_size=32, state_size=16, head_dim=8, n_groups=2, expand=2,
        chunk_size=16, layer_norm_epsilon=1e-6, use_bias=False, tie_word_embeddings=False)
    no_effect = str(t.report.no_effect)
    assert "--mamba-d-conv" in no_effect and "--num-attention-heads" in no_effect


def test_d_ssm_sets_expand_or_is_declined():
    no_expand = [f for i, f in enumerate(MAMBA) if f != "--mamba-expand" and MAMBA[i - 1] != "--mamba-expand"]
    assert translate_report(no_expand + ["--mamba-d-ssm", "96"]).fields["model"]["architecture"]["expand"] == 3
    declined = dict(translate_report(no_expand + ["--mamba-d-ssm", "50"]).report.declined)
    assert "not a multiple of --hidden-size 32" in declined["--mamba-d-ssm"]
    declined = dict(translate_report(MAMBA + ["--mamba-d-ssm", "96"]).report.declined)
    assert "contradicts --mamba-expand 2" in declined["--mamba-d-ssm"]


def test_attention_hybrids_and_gdn_scripts_are_not_mamba3():
    hybrid = translate_report(MAMBA + ["--hybrid-layer-pattern", "M*M*", "--num-attention-heads", "4"])
    assert hybrid.fields["model"].get("model_id") != "mamba3"  # NemotronH (tests/megatron_compat/test_hybrid_megatron.py)
    assert hybrid.fields["model"]["architecture"]["model_type"] == "nemotron_h"
    gdn = translate_report(MAMBA + ["--linear-num-key-heads", "4", "--num-attention-heads", "4"])
    assert gdn.fields["model"].get("model_id") != "mamba3"


def test_megatron_mamba_flags_train_and_export_mamba3(tmp_path):
    losses, log = run_pretrain(MAMBA, tmp_path / "run")
    assert sorted(losses) == [1, 2, 3]
    assert json.loads((tmp_path / "run" / "hf" / "config.json").read_text())["model_type"] == "mamba3"
