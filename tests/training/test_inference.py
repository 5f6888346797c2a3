"""Generation (`fsdp2_backend.inference`, `tools/generate.py`) against transformers' own `model.generate`.

A tiny real Qwen3 with a locally trained byte-level tokenizer, saved as an HF directory (and as training
checkpoints through the checkpoint module); the reference is `generate` called directly on a model loaded
by transformers, with the same settings.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp2_backend.config import Config
from fsdp2_backend.inference import generate
from tests.support.launchers import init_one_rank_group, torchrun_command
from tests.support.tiny_models import stdlib_texts, tiny_qwen3_config, train_bytelevel_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def main(argv):\n    ", "import os"]


def _tiny_model(tokenizer, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_qwen3_config(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """An HF directory: config, generation_config (EOS, pad), safetensors and tokenizer."""
    path = tmp_path_factory.mktemp("hf")
    tokenizer = train_bytelevel_tokenizer(path, vocab_size=300, texts=stdlib_texts(max_files=30))
    _tiny_model(tokenizer, seed=0).save_pretrained(str(path))
    return path


def _config(model_path, **inference) -> Config:
    config = Config()
    config.model.model_name_or_path = str(model_path)
    for name, value in inference.items():
        setattr(config.inference, name, value)
    return config


def _reference(model, tokenizer, prompt: str, **generate_kwargs):
    """transformers' own generate: (completion text, number of new tokens)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **generate_kwargs)
    new = out[0, ids.shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def _hf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("max_new_tokens", [3, 11])
def test_greedy_equals_transformers_generate(model_dir, max_new_tokens):
    model, tokenizer = _hf(model_dir)
    expected = [_reference(model, tokenizer, p, max_new_tokens=max_new_tokens, do_sample=False) for p in PROMPTS]
    # The budget stops the reference at least once, so an ignored max_new_tokens would show (with 11 tokens
    # one prompt meets EOS first: stopping there is checked too).
    assert max(n for _, n in expected) == max_new_tokens
    assert generate(_config(model_dir, max_new_tokens=max_new_tokens), PROMPTS) == [t for t, _ in expected]


def test_model_generation_defaults_do_not_override_the_inference_group(model_dir, tmp_path):
    """A model directory asking for sampling with beams (as released chat models do): do_sample false is
    still greedy with one beam; do_sample true samples with the directory's temperature and top_k."""
    import json
    import shutil

    shutil.copytree(model_dir, tmp_path / "chat")
    settings = json.loads((tmp_path / "chat" / "generation_config.json").read_text())
    settings.update(do_sample=True, num_beams=2, temperature=0.3, top_k=5)
    (tmp_path / "chat" / "generation_config.json").write_text(json.dumps(settings))
    model, tokenizer = _hf(model_dir)
    greedy = [_reference(model, tokenizer, p, max_new_tokens=8, do_sample=False, num_beams=1)[0] for p in PROMPTS]
    assert generate(_config(tmp_path / "chat", max_new_tokens=8), PROMPTS) == greedy
    config = _config(tmp_path / "chat", max_new_tokens=8, do_sample=True)
    torch.manual_seed(config.training.seed)
    expected = _reference(model, tokenizer, PROMPTS[0], max_new_tokens=8, do_sample=True, num_beams=1,
                          temperature=0.3, top_k=5)[0]
    assert generate(config, PROMPTS[:1]) == [expected]


def test_megatron_tokenizer_type(model_dir):
    """A Megatron tokenizer (`model.tokenizer_type`: tokenize/detokenize/eod) generates what HF's does."""
    model, tokenizer = _hf(model_dir)
    expected = [_reference(model, tokenizer, p, max_new_tokens=11, do_sample=False)[0] for p in PROMPTS]
    config = _config(model_dir, max_new_tokens=11)
    config.model.tokenizer_type, config.model.tokenizer_model = "HuggingFaceTokenizer", str(model_dir)
    assert generate(config, PROMPTS) == expected


def test_sampling_is_seeded_by_training_seed(model_dir):
    model, tokenizer = _hf(model_dir)
    config = _config(model_dir, max_new_tokens=12, do_sample=True)
    config.training.seed = 7
    sampled = generate(config, PROMPTS[:1])
    assert generate(config, PROMPTS[:1]) == sampled  # a run repeats
    torch.manual_seed(7)
    assert sampled == [_reference(model, tokenizer, PROMPTS[0], max_new_tokens=12, do_sample=True)[0]]
    # A random tiny model's next-token distribution is nearly flat: sampling departs from greedy, seeds differ.
    assert sampled != generate(_config(model_dir, max_new_tokens=12), PROMPTS[:1])
    config.training.seed = 8
    assert generate(config, PROMPTS[:1]) != sampled


def test_empty_prompt_is_a_usage_error(model_dir):
    from fsdp2_backend.usage_errors import UsageError

    with pytest.raises(UsageError, match="prompt 2: '' encodes to no tokens"):
        generate(_config(model_dir, max_new_tokens=2), ["x", ""])


def _save_checkpoints(save_dir: Path, models, tokenizer) -> None:
    """Checkpoints iter_0000010, iter_0000020, ... of `models`, saved in a 1-process gloo group."""
    import torch.distributed as dist

    from fsdp2_backend.training.checkpoint import CheckpointManager

    init_one_rank_group()
    try:
        manager = CheckpointManager(save_dir)
        for number, model in enumerate(models, 1):
            manager.save(10 * number, model, tokenizer=tokenizer, model_config=model.config)
        manager.finalize()
    finally:
        dist.destroy_process_group()


def test_generates_from_training_checkpoints(model_dir, tmp_path):
    model, tokenizer = _hf(model_dir)
    newer = _tiny_model(tokenizer, seed=1).eval()
    save_dir = tmp_path / "run"
    _save_checkpoints(save_dir, [model, newer], tokenizer)
    # A save directory means its newest complete checkpoint; an iter_* directory means itself.
    for path, source in ((save_dir, newer), (save_dir / "iter_0000010", model)):
        expected = [_reference(source, tokenizer, p, max_new_tokens=6, do_sample=False)[0] for p in PROMPTS]
        assert generate(_config(path, max_new_tokens=6), PROMPTS) == expected, path
    assert expected != [_reference(newer, tokenizer, p, max_new_tokens=6)[0] for p in PROMPTS]


def _cli(*args, launcher=(sys.executable,)):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*launcher, str(ROOT / "tools" / "generate.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["--model.model_name_or_path", "/nonexistent/model", "--prompt", "x"],
     "error: model.model_name_or_path: /nonexistent/model does not exist"),
    (["--inference.max_new_tokens", "0", "--prompt", "x"], "error: inference.max_new_tokens: 0 generates nothing"),
    (["--model.model_name_or_path", "/tmp"], "error: prompt: none given"),
    (["--inference.do_sample", "maybe", "--prompt", "x"], "error: inference.do_sample: expected true or false"),
])
def test_cli_bad_input_exits_2(args, message):
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_cli_two_ranks_generate_once_printed(model_dir, tmp_path):
    """torchrun with 2 ranks: a YAML file plus overrides; rank 0 prints what the library returns."""
    config_file = tmp_path / "gen.yaml"
    config_file.write_text(f"model:\n  model_name_or_path: {model_dir}\ninference:\n  max_new_tokens: 4\n")
    result = _cli(str(config_file), "--inference.max_new_tokens", "5", "--prompt", PROMPTS[0], "--prompt",
                  PROMPTS[1], launcher=torchrun_command(2))
    assert result.returncode == 0, result.stderr
    expected = generate(_config(model_dir, max_new_tokens=5), PROMPTS)
    assert result.stdout == "".join(f"=== {n} ===\n{text}\n" for n, text in enumerate(expected, 1))


def test_cli_fine_tuning_yaml_wraps_the_prompt_in_its_template(model_dir, tmp_path, capsys):
    """tools/generate.py sft.yaml: the prompt goes in as the user turn of the run's template (here qwen3, written
    out by hand below), the completion is the assistant's reply."""
    from fsdp2_backend.cli.generate import main

    sft_yaml = tmp_path / "sft.yaml"
    sft_yaml.write_text(f"model:\n  model_name_or_path: {model_dir}\ndata:\n  dataset: alpaca_demo\n  template: "
                        f"qwen3\ninference:\n  max_new_tokens: 6\n")
    assert main([str(sft_yaml), "--prompt", PROMPTS[0]]) == 0
    model, tokenizer = _hf(model_dir)
    chat = f"<|im_start|>user\n{PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n"
    expected = _reference(model, tokenizer, chat, max_new_tokens=6, do_sample=False)[0]
    assert expected != _reference(model, tokenizer, PROMPTS[0], max_new_tokens=6, do_sample=False)[0]
    assert capsys.readouterr().out == f"=== 1 ===\n{expected}\n"
