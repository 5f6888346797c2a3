"""SFT templates and labels against independent references: the Qwen3 chat template itself (the tokenizer's own
`apply_chat_template` on tests/data/sft/qwen3_chat_template.jinja) for single-turn samples, and LLaMA-Factory's
documented rules for labels and the cutoff budget (worked by hand here). Multi-turn samples (each turn rendered
as a final one, MindSpeed's way): test_sft_multiturn.py."""
import json

import pytest

from fsdp2_backend.config import DataArguments
from fsdp2_backend.data.sft.formats import DatasetAttr, convert_example
from fsdp2_backend.data.sft.supervised import IGNORE_INDEX, SupervisedProcessor, encode_supervised, infer_seqlen
from fsdp2_backend.data.sft.template import encode_turns, get_template
from tests.support.sft_assets import qwen3_like_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MULTI_TURN = [{"role": "system", "content": "You are helpful."},
              {"role": "user", "content": "Hi there"},
              {"role": "assistant", "content": "<think>\nthe user greets\n</think>\n\nHello!"},
              {"role": "user", "content": "What is 2 + 2?"},
              {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."}]
NO_REASONING = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Green."}]
TOOL_CALL = [{"role": "system", "content": "Use tools."},
             {"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "sunny, 21 C"},
             {"role": "assistant", "content": "It is sunny in Paris."}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return qwen3_like_tokenizer(tmp_path_factory.mktemp("qwen3_tok"))


def _reference_ids(tokenizer, messages, tools=None):
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _ours(tokenizer, messages, tools=None, enable_thinking=True):
    """Our qwen3 template on the same conversation, read through the OpenAI format converter."""
    row = {"messages": messages, "tools": json.dumps(tools) if tools else None}
    example = convert_example(row, DatasetAttr(name="t", file_name="-", formatting="openai"))
    template = get_template(DataArguments(template="qwen3", enable_thinking=enable_thinking), tokenizer)
    return encode_turns(tokenizer, template.render(example["messages"], example["system"], example["tools"]))


def _strip_reasoning(messages):
    return [{**m, "content": m["content"].split("</think>")[-1].lstrip("\n")} if m["role"] == "assistant" else m
            for m in messages]


@pytest.mark.parametrize("messages,tools", [(MULTI_TURN[:3], None), (NO_REASONING[:2], None), (TOOL_CALL[:3], TOOLS)],
                         ids=["system_thinking", "no_reasoning", "tools"])
def test_qwen3_single_turn_equals_the_tokenizers_chat_template(tokenizer, messages, tools):
    pairs = _ours(tokenizer, messages, tools, enable_thinking=True)
    assert [t for p, r in pairs for t in p + r] == _reference_ids(tokenizer, messages, tools)


@pytest.mark.parametrize("messages,tools", [(MULTI_TURN[:3], None), (TOOL_CALL[:3], TOOLS)], ids=["system", "tools"])
def test_qwen3_thinking_off_removes_reasoning_and_keeps_the_empty_block_untrained(tokenizer, messages, tools):
    pairs = _ours(tokenizer, messages, tools, enable_thinking=False)
    assert [t for p, r in pairs for t in p + r] == _reference_ids(tokenizer, _strip_reasoning(messages), tools)
    empty_block = tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    final_prompt, final_reply = pairs[-1]
    assert final_prompt[-len(empty_block):] == empty_block
    assert tokenizer.decode(final_reply).startswith(_strip_reasoning(messages)[-1]["content"])


def test_qwen3_thinking_on_trains_the_final_think_block(tokenizer):
    pairs = _ours(tokenizer, NO_REASONING, enable_thinking=True)
    assert tokenizer.decode(pairs[-1][1]) == "<think>\n\n</think>\n\nGreen.<|im_end|>\n"
    assert tokenizer.decode(pairs[0][1]) == "<think>\n\n</think>\n\nBlue.<|im_end|>\n"  # every turn a final one


def test_qwen3_thinking_none_keeps_the_datas_own_tags(tokenizer):
    pairs = _ours(tokenizer, MULTI_TURN, enable_thinking=None)
    assert "<think>\nthe user greets\n</think>" in tokenizer.decode(pairs[0][1])


def test_template_none_parses_the_tokenizers_own(tokenizer):
    """template: None reads slots off the tokenizer's template; a one-turn sample renders as apply_chat_template."""
    template = get_template(DataArguments(template=None), tokenizer)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    pairs = encode_turns(tokenizer, template.render(messages, "", ""))
    assert [t for p, r in pairs for t in p + r] == _reference_ids(tokenizer, messages)


def test_default_system_applies(tokenizer):
    template = get_template(DataArguments(template="qwen3", default_system="Be brief."), tokenizer)
    prompt, _ = template.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])[0]
    assert "".join(prompt).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_gpt_template_is_mindspeeds_harmony_slots(tokenizer):
    template = get_template(DataArguments(template="gpt", enable_thinking=True), tokenizer)
    turns = template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    assert turns == [(("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI."
                       "<|end|>", "<|start|>user<|message|>Hi<|end|><|start|>assistant"),
                      ("<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>",
                       "Yo<|end|>"))]
    assert template.efficient_eos


# --- labels and the cutoff budget (LLaMA-Factory's rules, worked by hand) -------------------------------------

def test_infer_seqlen_budget_split():
    assert infer_seqlen(10, 3, 8) == (5, 3)   # a reply under half the budget is kept whole
    assert infer_seqlen(3, 10, 8) == (3, 5)   # else a prompt under half is kept whole
    assert infer_seqlen(6, 10, 8) == (3, 5)   # else both in proportion: int(8 * 10 / 16) = 5 for the reply
    assert infer_seqlen(2, 2, 100) == (2, 2)


PAIRS = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10])]


def test_labels_assistant_only_by_default():
    ids, labels = encode_supervised(PAIRS, 100, train_on_prompt=False, mask_history=False, efficient_eos=False,
                                    eos_id=99)
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert labels == [IGNORE_INDEX] * 3 + [4, 5] + [IGNORE_INDEX] * 2 + [8, 9, 10]


def test_train_on_prompt_labels_everything():
    ids, labels = encode_supervised(PAIRS, 100, train_on_prompt=True, mask_history=False, efficient_eos=False,
                                    eos_id=99)
    assert labels == ids


def test_mask_history_trains_the_last_turn_only_and_keeps_it_under_the_cutoff():
    ids, labels = encode_supervised(PAIRS, 100, train_on_prompt=False, mask_history=True, efficient_eos=False,
                                    eos_id=99)
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert labels == [IGNORE_INDEX] * 7 + [8, 9, 10]
    ids, labels = encode_supervised(PAIRS, 5, train_on_prompt=False, mask_history=True, efficient_eos=False,
                                    eos_id=99)
    assert ids == [6, 7, 8, 9, 10] and labels == [IGNORE_INDEX] * 2 + [8, 9, 10]


def test_cutoff_shares_the_budget_turn_by_turn():
    # turn 1 takes (3, 2) of 7; turn 2 gets 2: infer_seqlen(2, 3, 2) → reply int(2*3/5)=1, prompt 1
    ids, labels = encode_supervised(PAIRS, 7, train_on_prompt=False, mask_history=False, efficient_eos=False,
                                    eos_id=99)
    assert ids == [1, 2, 3, 4, 5, 6, 8]
    assert labels == [IGNORE_INDEX] * 3 + [4, 5, IGNORE_INDEX, 8]


def test_efficient_eos_reserves_and_labels_one_eos():
    ids, labels = encode_supervised([([1, 2], [3])], 100, train_on_prompt=False, mask_history=False,
                                    efficient_eos=True, eos_id=99)
    assert ids == [1, 2, 3, 99] and labels == [IGNORE_INDEX, IGNORE_INDEX, 3, 99]


def test_processor_drops_samples_with_nothing_to_learn(tokenizer):
    """A 4-token budget cut in proportion: the long prompt (166 tokens) leaves its 7-token reply int(4 * 7 / 173)
    = 0 tokens (dropped); the short one (a 9-token prompt) keeps int(4 * 7 / 16) = 1 reply token."""
    rows = {"messages": [[{"role": "user", "content": "word " * 50}, {"role": "assistant", "content": "ok"}],
                         [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]],
            "system": ["", ""], "tools": ["", ""]}
    data = DataArguments(template="qwen3", cutoff_len=4)
    out = SupervisedProcessor(get_template(data, tokenizer), tokenizer, data, packing=False)(rows)
    assert len(out["input_ids"]) == 1 and len(out["input_ids"][0]) == 4
    assert out["labels"][0][:3] == [IGNORE_INDEX] * 3 and out["labels"][0][3] == out["input_ids"][0][3]
    data = DataArguments(template="qwen3", cutoff_len=1000)
    out = SupervisedProcessor(get_template(data, tokenizer), tokenizer, data, packing=False)(rows)
    assert len(out["input_ids"]) == 2 and out["doc_lens"] == [[len(ids)] for ids in out["input_ids"]]
