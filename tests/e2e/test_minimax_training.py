"""MindSpeed-LLM's minimax_m27 pretraining YAML (paths replaced, sizes scaled to 2 CPU ranks; meta-device init,
so the streaming loader reads the tiny checkpoint's per-expert `block_sparse_moe` keys and its non-zero
`e_score_correction_bias`) trains a tiny MiniMax-M2 with the minimax_m27 model id. Over 8 steps, expert parallel 2
and ep_fsdp 2 on 2 ranks print the lm loss of one rank (no EP) at every step, within 1e-4; the EP 2 checkpoint of
step 4 continues at one rank through steps 5-8 as the one-rank run; Ulysses context parallel 2 prints the one-rank
losses too (the q/k RMSNorm spans all heads of one token, which Ulysses keeps on each rank: it splits tokens before
attention and heads only inside it); the export loads in transformers as its MiniMaxM2ForCausalLM with the
checkpoint's correction bias. MindSpeed-LLM v26.1.0's copy of the example gives the same losses under EP 2."""
import json
import os
import shutil

import pytest
import torch

from tests.support.launchers import REPO, torchrun_command
from tests.support.tiny_models import text_parquet_and_tokenizer
from tests.support.launchers import LOG_LINE_START, failure_report, run_command

YAML = os.path.join(REPO, "tests", "data", "mindspeed_fsdp2", "head",
                    "examples__fsdp2__minimax_m27__pretrain_minimax_m2p7_229b_8K_fsdp2_A3.yaml")
# MindSpeed-LLM v26.1.0's copy of the same example (its paths, sizes and optimization switches in the YAML)
RELEASE_YAML = YAML.replace(os.sep + "head" + os.sep, os.sep + "v26.1.0" + os.sep)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    root = tmp_path_factory.mktemp("minimax_assets")
    parquet, model, tokenizer = text_parquet_and_tokenizer(root, "tiny-minimax")
    config = MiniMaxM2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                             num_experts_per_tok=2, rotary_dim=8, max_position_embeddings=256,
                             tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    hf = MiniMaxM2ForCausalLM(config)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.e_score_correction_bias.normal_(0, 0.3)
    hf.save_pretrained(str(model))
    return {"model": str(model), "dataset": json.dumps({"file_name": str(parquet)}),
            "bias": hf.model.layers[1].mlp.e_score_correction_bias.clone()}


def _train(assets, out, ranks, ep, ep_fsdp=1, *extra, accumulate=None, steps=8, yaml_file=YAML):
    from fsdp2_backend.training.logging import parse_train_line

    args = ["--model.model_name_or_path", assets["model"], "--data.dataset", assets["dataset"],
            "--parallel.fsdp_size", str(ranks), "--parallel.ep_size", str(ep), "--parallel.ep_fsdp_size", str(ep_fsdp),
            "--training.per_device_train_batch_size", "1", "--training.gradient_accumulation_steps",
            str(accumulate or 3 - ranks), "--training.output_dir", str(out), "--optimization.moe_grouped_gemm", "True",
            "--training.max_steps", str(steps), "--data.cutoff_len", "64", "--training.save_steps", "4",
            "--training.lr", "1e-3", *extra]
    command = torchrun_command(ranks, os.path.join(REPO, "pretrain_fsdp2.py"), yaml_file, *args)
    result = run_command(command, {}, timeout=600)
    assert result.returncode == 0, failure_report(result, command)
    log = result.stdout + result.stderr
    lines = [parsed for line in log.splitlines() for start in LOG_LINE_START.finditer(line)
             if (parsed := parse_train_line(line[start.start():]))]
    return {line["iteration"]: line["losses"]["lm loss"] for line in lines}, log


@pytest.fixture(scope="module")
def one_rank(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("minimax_one")
    one, log = _train(assets, out, ranks=1, ep=1)
    assert sorted(one) == list(range(1, 9)), log[-3000:]
    assert one[8] < one[1]  # it trains
    return one


def _same(other, one, its=range(1, 9)):
    assert sorted(other) == list(its), other
    for it in its:
        assert other[it] == pytest.approx(one[it], rel=1e-4), (it, one[it], other[it])


def test_mindspeed_yaml_ep2_and_ep_fsdp2_equal_one_rank_continue_and_export(assets, one_rank, tmp_path):
    ep2, log = _train(assets, tmp_path / "ep2", ranks=2, ep=2)
    _same(ep2, one_rank)
    ep_fsdp, log = _train(assets, tmp_path / "ep_fsdp", ranks=2, ep=1, ep_fsdp=2)
    _same(ep_fsdp, one_rank)
    # the EP 2 checkpoint of step 4 continues at one rank: steps 5..8 as the one-rank run
    found = [os.path.join(r, d) for r, dirs, _ in os.walk(tmp_path / "ep2") for d in dirs if d == "iter_0000004"]
    assert len(found) == 1, found
    shutil.copytree(found[0], tmp_path / "ckpt" / "iter_0000004")
    continued, log = _train(assets, tmp_path / "continued", 1, 1, 1, "--training.resume_from_checkpoint",
                            str(tmp_path / "ckpt"))
    _same(continued, one_rank, range(5, 9))
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ep2" / "hf"))
    assert type(exported).__name__ == "MiniMaxM2ForCausalLM"
    # the checkpoint's correction bias was loaded (meta-device init) and kept: not updated, not re-initialised
    torch.testing.assert_close(exported.model.layers[1].mlp.e_score_correction_bias, assets["bias"], rtol=0, atol=0)


def test_ulysses_context_parallel_2_equals_one_rank(assets, one_rank, tmp_path):
    # one data-parallel rank (cp 2 holds one sequence): 2 micro-batches per step, as the one-rank run
    cp2, log = _train(assets, tmp_path / "cp2", 2, 1, 1, "--parallel.cp_size", "2", "--parallel.cp_type", "ulysses",
                      accumulate=2)
    _same(cp2, one_rank)


def test_release_yaml_expert_parallel_2_prints_the_one_rank_losses(assets, one_rank, tmp_path):
    """MindSpeed-LLM v26.1.0's copy of the example (paths, sizes and kernel switches written in the YAML, where
    master's launcher passes them; the paths and sizes overridden as a user pointing it at their files would)
    trains as master's: under EP 2 it prints the one-rank losses of master's YAML at every step."""
    ep2, log = _train(assets, tmp_path / "release", 2, 2, yaml_file=RELEASE_YAML)
    _same(ep2, one_rank)
