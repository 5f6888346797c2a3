"""Faults met while training, through the real entry point: a diverging run stops as Megatron's
--check-for-nan-in-loss-and-grad stops it, a resume with dropout on is bit-exact, a model built from flags exports
its tokenizer's special tokens, a save that runs out of room leaves the previous checkpoint intact, a resume with a
different --hidden-size is refused in Megatron's words, the HF export is written once, and tools/generate.py given
the run's YAML generates from its newest checkpoint."""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from tests.support.launchers import MEGATRON_LINE, REPO
from tests.support.tiny_models import tiny_model_dir

# A llama-style model built from flags, dropout on, trained on mock data with the tokenizer of an HF directory.
FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --seq-length 32 --max-position-embeddings 64 --micro-batch-size 2 "
         "--global-batch-size 4 --train-iters 8 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 "
         "--mock-data --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --attention-dropout 0.2 --hidden-dropout 0 --log-interval 1 "
         "--save-interval 4 --eval-iters 0 --tokenizer-type HuggingFaceTokenizer").split()


def pretrain(args, preexec_fn=None):
    """(exit code, stdout, stderr) of `pretrain_fsdp2.py args` on one rank."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    result = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), *map(str, args)],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=600, preexec_fn=preexec_fn)
    return result.returncode, result.stdout, result.stderr


def error_lines(stderr: str):
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("hf"), seed=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_dir):
    """A straight run, and the same run stopped at 4 by --exit-interval (a copy kept) and restarted."""
    root = tmp_path_factory.mktemp("runs")
    flags = FLAGS + ["--tokenizer-model", tokenizer_dir]
    code, out, err = pretrain(flags + ["--save", root / "straight"])
    assert code == 0, err[-3000:]
    code, out1, err = pretrain(flags + ["--save", root / "stopped", "--exit-interval", "4"])
    assert code == 0, err[-3000:]
    shutil.copytree(root / "stopped", root / "at4")
    code, out2, err = pretrain(flags + ["--save", root / "stopped", "--exit-interval", "4"])
    assert code == 0, err[-3000:]
    return dict(root=root, flags=flags, straight=out, resumed=out1 + out2)


def losses(log: str):
    return {int(it): loss for it, _, loss in MEGATRON_LINE.findall(log)}


def test_resume_with_dropout_is_bit_exact(runs):
    from safetensors.torch import load_file

    straight, resumed = losses(runs["straight"]), losses(runs["resumed"])
    assert sorted(straight) == sorted(resumed) == list(range(1, 9))
    assert resumed == straight  # the printed losses, digit for digit, with attention dropout 0.2
    a = load_file(runs["root"] / "straight" / "hf" / "model.safetensors")
    b = load_file(runs["root"] / "stopped" / "hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_of_a_model_built_from_flags_has_the_tokenizers_special_tokens(runs, tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    hf = runs["root"] / "straight" / "hf"
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((hf / name).read_text())
        assert saved.get("eos_token_id") == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
        assert saved.get("bos_token_id") is None and tokenizer.bos_token_id is None
    # generate() pads with the tokenizer's pad; the model config's pad_token_id (the embedding's padding_idx) is
    # the one the model was built with (Llama's default: none), so a resumed run builds the same model
    generation = json.loads((hf / "generation_config.json").read_text())
    assert generation["pad_token_id"] == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|pad|>")
    assert json.loads((hf / "config.json").read_text()).get("pad_token_id") is None
    # the checkpoints describe themselves the same way (tools/convert_checkpoint.py reads hf_meta)
    meta = json.loads((runs["root"] / "straight" / "iter_0000008" / "hf_meta" / "config.json").read_text())
    assert meta["eos_token_id"] == tokenizer.eos_token_id


def test_resume_with_another_hidden_size_is_refused_in_megatrons_words(runs):
    save = runs["root"] / "stopped"
    flags = [f for f in runs["flags"]]
    flags[flags.index("--hidden-size") + 1] = "96"
    code, _, err = pretrain(flags + ["--load", save, "--save", save, "--dry-run"])
    assert code == 2
    assert ("error: model.architecture.hidden_size (from --hidden-size): hidden_size value from checkpoint (64) is "
            "not equal to the input hidden_size value (96) — drop the flag, fix it, or add --use-checkpoint-args") \
        in error_lines(err)


def _file_size_limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


def test_a_save_that_runs_out_of_room_keeps_the_previous_checkpoint(runs):
    from fsdp2_backend.checkpoint import dirs

    save = runs["root"] / "full"
    shutil.copytree(runs["root"] / "at4", save)  # a run stopped after its checkpoint of iteration 4
    code, out, err = pretrain(runs["flags"] + ["--save", save], preexec_fn=_file_size_limit)
    assert code == 1, err[-3000:]
    assert error_lines(err) == [
        f"error: training.output_dir (--save): saving the checkpoint of iteration 8 to {save} failed (File too "
        f"large) — the previous checkpoint iter_0000004 is intact; free space or fix permissions there, then rerun "
        f"the same command to resume"]
    assert "Traceback" not in err
    assert [i for i, _ in dirs.complete_checkpoints(save)] == [4] and dirs.read_latest_marker(save) == 4
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000004"]
    assert not (save / "hf").exists()


def test_a_diverging_run_stops_with_one_line_and_exports_nothing(tmp_path, tokenizer_dir):
    flags = FLAGS + ["--tokenizer-model", tokenizer_dir, "--lr", "1e5", "--min-lr", "1", "--lr-warmup-iters", "0",
                     "--save-interval", "2", "--save", tmp_path / "nan"]
    code, out, err = pretrain(flags)
    assert code == 1, err[-3000:]
    lines = [line for line in out.splitlines() if " iteration " in line and "consumed samples" in line]
    stop = int(re.search(r"iteration +(\d+)/", lines[-1]).group(1))
    assert stop < 8 and "number of nan iterations:   1" in lines[-1]
    assert all("number of nan iterations:   0" in line for line in lines[:-1])
    last = (stop - 1) // 2 * 2
    kept = f"the last checkpoint (iteration {last}) is kept" if last else "no checkpoint was saved by this run"
    [line] = error_lines(err)
    assert re.fullmatch(re.escape(f"error: training.check_for_nan_in_loss_and_grad: iteration {stop}: ")
                        + r"the (loss|gradient norm) is (nan|inf|-inf)" + re.escape(
                            f" — training stopped without saving or exporting ({kept}); lower the learning rate or "
                            f"check the data, or pass --no-check-for-nan-in-loss-and-grad to skip such iterations "
                            f"instead"), line), line
    assert "Traceback" not in err
    assert not (tmp_path / "nan" / "hf").exists()
    assert max([int(p.name[5:]) for p in (tmp_path / "nan").glob("iter_*")] or [0]) == last

    # --no-check-for-nan-in-loss-and-grad: such iterations are skipped and each one counted as a nan iteration
    code, out, err = pretrain(flags[:-1] + [tmp_path / "skip", "--no-check-for-nan-in-loss-and-grad"])
    assert code == 0, err[-3000:]
    lines = [line for line in out.splitlines() if " iteration " in line and "consumed samples" in line]
    assert len(lines) == 8
    nan_lines = [line for line in lines if "grad norm: nan" in line or "lm loss" not in line]
    assert nan_lines and all("number of nan iterations:   1" in line for line in nan_lines)
    assert all("number of nan iterations:   0" in line for line in lines if line not in nan_lines)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_last_iteration_on_a_save_interval_exports_once(tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.config import Config
    from fsdp2_backend.checkpoint.resume_point import ResumePoint
    from fsdp2_backend.training.checkpointer import Checkpointer
    from fsdp2_backend.training.trainer import TrainState
    from tests.support.tiny_models import tiny_qwen3_config

    config = Config()
    config.training.output_dir = str(tmp_path / "out")
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config())
    saver = Checkpointer(config, ResumePoint(None, False, ""), states=dict(model=model, train_state=TrainState(
        iteration=4)), model_config=model.config)
    saver.save(4, "interval", train_iters=4)  # the last iteration is a save interval: training has finished
    first = os.stat(tmp_path / "out" / "hf").st_ino
    saver.save(4, "final", train_iters=4)     # the loop's final save of the same iteration
    saver.close()
    assert os.stat(tmp_path / "out" / "hf").st_ino == first  # not gathered and written (renamed into place) again


def test_generate_given_the_runs_yaml_uses_its_newest_checkpoint(runs, tokenizer_dir, tmp_path, capsys):
    import yaml

    from fsdp2_backend.cli.generate import main

    save = runs["root"] / "straight"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"model_name_or_path": tokenizer_dir},
                                      "training": {"output_dir": str(save)}, "inference": {"max_new_tokens": 8}}))
    assert main([str(config), "--prompt", "def main():"]) == 0
    got = capsys.readouterr()
    assert (f"notice: generating from {save / 'iter_0000008'}, the newest checkpoint of training.output_dir (give "
            f"--model.model_name_or_path to choose another model)") in got.err
    assert main(["--model.model_name_or_path", str(save), "--inference.max_new_tokens", "8",
                 "--prompt", "def main():"]) == 0
    assert capsys.readouterr().out == got.out
