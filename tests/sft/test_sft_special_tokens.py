"""Special tokens of fine-tuning (ModelArguments): new_special_tokens_config adds its tokens, and with
init_special_tokens desc_init the resized embedding and lm head rows of each new token are the mean of the
checkpoint rows of its description's tokens (desc_init_w_noise: plus noise); validation's rules."""
import pytest
import torch
import yaml
from safetensors.torch import load_file

from fsdp2_backend.config import Config, DataArguments, ModelArguments, ParallelArguments, TrainingArguments
from fsdp2_backend.config.validation import validate
from tests.support.sft_assets import alpaca_rows, qwen3_model_dir, write_jsonl
from fsdp2_backend.usage_errors import UsageError

DESCRIPTIONS = {"<|region|>": "the weather in Paris", "<|answer|>": "hello world"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("special")
    tokens = root / "tokens.yaml"
    tokens.write_text(yaml.safe_dump(DESCRIPTIONS))
    return {"model": qwen3_model_dir(root / "model"), "data": write_jsonl(root / "d.jsonl", alpaca_rows(8)),
            "tokens": str(tokens)}


def _config(assets, **model):
    return Config(model=ModelArguments(model_name_or_path=assets["model"], resize_vocab=True, **model),
                  data=DataArguments(dataset={"file_name": assets["data"]}, template="qwen3", cutoff_len=64),
                  training=TrainingArguments(stage="sft", max_steps=1, save_checkpoints=False),
                  parallel=ParallelArguments(param_dtype="fp32"))


def test_desc_init_rows_are_description_means(assets):
    from fsdp2_backend.build import build
    from fsdp2_backend.distributed.dtensor import local_tensor
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(assets["model"])
    weights = load_file(f"{assets['model']}/model.safetensors")
    job = build(validate(_config(assets, new_special_tokens_config=assets["tokens"], init_special_tokens="desc_init")))
    try:
        hf = job.tokenizer.hf
        params = dict(job.model.named_parameters())
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            table = params[name].full_tensor() if hasattr(params[name], "full_tensor") else local_tensor(params[name])
            for token, text in DESCRIPTIONS.items():
                token_id = hf.convert_tokens_to_ids(token)
                assert token_id >= len(original)  # a new token
                ids = original(text, add_special_tokens=False)["input_ids"]
                torch.testing.assert_close(table[token_id], weights[name][ids].float().mean(0))
    finally:
        job.close()


def test_desc_init_w_noise_adds_noise_and_new_tokens_tokenize_whole(assets):
    from fsdp2_backend.data.tokenizer import load_tokenizer, new_token_rows

    args = ModelArguments(model_name_or_path=assets["model"], new_special_tokens_config=assets["tokens"],
                          init_special_tokens="desc_init_w_noise", resize_vocab=True)
    tokenizer = load_tokenizer(args)
    region = tokenizer.hf.convert_tokens_to_ids("<|region|>")
    assert tokenizer.hf("a <|region|> b", add_special_tokens=False)["input_ids"].count(region) == 1
    old = torch.randn(region, 8)
    rows = new_token_rows(args, tokenizer, seed=0)(old, 4)
    ids = tokenizer.hf("the weather in Paris", add_special_tokens=False)["input_ids"]
    delta = rows[0] - old[ids].mean(0)
    assert 0 < delta.norm() < 5 * (8 ** 0.5) / (8 ** 0.5)  # noise of std 1/sqrt(hidden) per element


def test_validation_rules(assets, tmp_path):
    with pytest.raises(UsageError, match="model.init_special_tokens: desc_init initialises new tokens"):
        validate(_config(assets, init_special_tokens="desc_init"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just a list\n")
    with pytest.raises(UsageError, match="model.new_special_tokens_config: bad.yaml is not a non-empty mapping"):
        validate(_config(assets, new_special_tokens_config=str(bad)))
