"""The fine-tuning stage's config rules (config/rules/data.py): every problem one line naming the field, before
anything is built; notices for fields with no effect; the per-token loss SFT derives."""
import pytest

from fsdp2_backend.config import Config, DataArguments, ModelArguments, ParallelArguments, TrainingArguments
from fsdp2_backend.config.validation import validate, validate_with_notices
from tests.support.sft_assets import write_jsonl
from fsdp2_backend.usage_errors import UsageError


@pytest.fixture()
def data_file(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}])


def _config(data_file, data=None, training=None, parallel=None, model=None):
    return Config(model=ModelArguments(architecture={"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
                                                     "num_attention_heads": 4, "num_key_value_heads": 2,
                                                     "num_hidden_layers": 1}, **(model or {})),
                  data=DataArguments(**{"dataset": {"file_name": data_file}, **(data or {})}),
                  training=TrainingArguments(**{"stage": "sft", "max_steps": 2, "save_checkpoints": False,
                                                **(training or {})}),
                  parallel=ParallelArguments(**(parallel or {})))


@pytest.mark.parametrize("data,training,parallel,message", [
    ({"template": "llama9"}, {}, {}, "data.template: 'llama9' is not a template"),
    ({"tool_format": "xml"}, {}, {}, "data.tool_format: 'xml' is not a tool format"),
    ({"template": "gpt", "train_on_prompt": True}, {}, {}, "data.train_on_prompt: template gpt ends each sample"),
    ({"streaming": True}, {"max_steps": -1, "num_train_epochs": 1.0}, {}, "training.max_steps: a streamed dataset"),
    ({"eval_num_beams": 4}, {}, {}, "data.eval_num_beams: generation-based evaluation"),
    ({"data_manager_type": "mg", "dataset": "/x"}, {}, {}, "training.stage: sft reads the fine-tuning data path"),
    ({}, {"stage": "pt"}, {}, "data.data_manager_type: lf with training.stage pt"),
    ({"dataset": "missing_name"}, {}, {}, "data.dataset: 'missing_name' is neither a dataset of"),
    ({"dataset": {"file_name": "/no/such.jsonl"}}, {}, {}, "data.dataset: /no/such.jsonl (dataset 'such.jsonl') not found"),
    ({"dataset": {"file_name": "x", "formatting": "chatml"}}, {}, {}, "formatting 'chatml' — use one of"),
])
def test_each_rule_names_its_field(data_file, data, training, parallel, message):
    with pytest.raises(UsageError) as error:
        validate(_config(data_file, data, training, parallel), world_size=2)
    assert any(line.startswith(f"error: {message}") or message in line for line in str(error.value).splitlines()), \
        str(error.value)


def test_sft_normalises_by_the_global_batchs_tokens_and_reports_pretraining_fields(data_file):
    config, notices = validate_with_notices(_config(data_file, {"split": "90,10,0", "neat_packing": True}))
    assert config.training.calculate_per_token_loss and config.data.packing
    assert "data.split: no effect on the fine-tuning data path (Megatron pretraining data only)" in notices


def test_eval_sets_without_interval_are_evaluated_at_the_end(data_file):
    _, notices = validate_with_notices(_config(data_file, {"val_size": 0.5}))
    assert any(n.startswith("data.val_size / eval_dataset: evaluated at the end of training only") for n in notices)
