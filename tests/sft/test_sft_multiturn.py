"""Multi-turn SFT samples as MindSpeed-LLM's FSDP2 data path encodes them (LLaMA-Factory before its PR #10435):
each (prompt, reply) pair rendered the way the chat template renders a FINAL turn.

The expected ids are built here from the Qwen3 chat template itself (tests/data/sft/qwen3_chat_template.jinja,
through transformers' `apply_chat_template` on the prefix conversation that ends with the turn), tokenized:
- the reply of turn k: render(messages[:2k+2]) after render(messages[:2k+1], add_generation_prompt=True);
- the prompt of turn 0: render(system + first query, tools, add_generation_prompt=True); of turn k > 0: the
  query rendered alone with add_generation_prompt=True;
- a reply without its own thought gets the empty block in the prompt (enable_thinking false / None: rendered
  with `enable_thinking=False`) or in the reply (true); false removes every reply's thought first.
The gpt template (no jinja here) and the labels are worked by hand from MindSpeed's rules.
"""
import json

import pytest

from fsdp2_backend.config import DataArguments
from fsdp2_backend.data.sft.formats import DatasetAttr, convert_example
from fsdp2_backend.data.sft.supervised import IGNORE_INDEX, SupervisedProcessor
from fsdp2_backend.data.sft.template import encode_conversations, encode_turns, get_template
from tests.support.sft_assets import qwen3_like_tokenizer

pytestmark = pytest.mark.unit

THOUGHT = "<think>\nthe user greets\n</think>\n\n"
REASONING_HISTORY = [{"role": "system", "content": "You are helpful."},
                     {"role": "user", "content": "Hi there"},
                     {"role": "assistant", "content": THOUGHT + "Hello!"},
                     {"role": "user", "content": "What is 2 + 2?"},
                     {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."}]
PLAIN_HISTORY = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                 {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Green."},
                 {"role": "user", "content": "And a third?"}, {"role": "assistant", "content": THOUGHT + "Red."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_CALLS = [{"role": "system", "content": "Use tools."},
              {"role": "user", "content": "What is the weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "content": "sunny, 21 C"},
              {"role": "assistant", "content": "It is sunny in Paris."},
              {"role": "user", "content": "Thanks!"},
              {"role": "assistant", "content": "You are welcome."}]
CONVERSATIONS = {"reasoning_history": (REASONING_HISTORY, None), "plain_history": (PLAIN_HISTORY, None),
                 "tool_calls": (TOOL_CALLS, TOOLS)}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return qwen3_like_tokenizer(tmp_path_factory.mktemp("qwen3_multiturn_tok"))


# --- the independent reference ---------------------------------------------------------------------------------

def _render(tok, messages, tools=None, generation=False, thinking_off=False):
    extra = {"enable_thinking": False} if thinking_off else {}
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation, **extra)


def _strip_thought(message):
    if message["role"] != "assistant" or "</think>" not in message["content"]:
        return message
    return {**message, "content": message["content"].split("</think>")[-1].lstrip("\n")}


def reference_pairs(tok, messages, tools=None, enable_thinking=True):
    """(prompt ids, reply ids) per turn: each turn as Qwen3's jinja renders a final one (module docstring)."""
    if enable_thinking is False:
        messages = [_strip_thought(m) for m in messages]
    system = messages[:1] if messages[0]["role"] == "system" else []
    body = messages[len(system):]
    replies = [i for i, m in enumerate(body) if m["role"] == "assistant"]  # a query: what follows a reply
    pairs = []
    for n, k in enumerate(replies):
        start = replies[n - 1] + 1 if n else 0
        own_thought = "</think>" in body[k]["content"]
        off = enable_thinking is False or (enable_thinking is None and not own_thought)
        if n == 0:
            prompt = _render(tok, system + body[:k], tools, generation=True, thinking_off=off)
        else:
            prompt = _render(tok, body[start:k], generation=True, thinking_off=off)
        upto_query = _render(tok, system + body[:k], tools, generation=True, thinking_off=off)
        upto_reply = _render(tok, system + body[:k + 1], tools)
        assert upto_reply.startswith(upto_query)
        pairs.append((tok.encode(prompt, add_special_tokens=False),
                      tok.encode(upto_reply[len(upto_query):], add_special_tokens=False)))
    return pairs


def _canonical(messages, tools=None):
    row = {"messages": messages, "tools": json.dumps(tools) if tools else None}
    return convert_example(row, DatasetAttr(name="t", file_name="-", formatting="openai"))


def _ours(tok, example, **data):
    template = get_template(DataArguments(template=data.pop("template", "qwen3"), **data), tok)
    return encode_turns(tok, template.render(example["messages"], example["system"], example["tools"]))


# --- streams ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("enable_thinking", [True, False, None], ids=["thinking", "no_thinking", "thinking_null"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_qwen3_renders_every_turn_as_a_final_one(tok, name, enable_thinking):
    messages, tools = CONVERSATIONS[name]
    ours = _ours(tok, _canonical(messages, tools), enable_thinking=enable_thinking)
    assert ours == reference_pairs(tok, messages, tools, enable_thinking)


def test_earlier_reasoning_is_kept_unlike_the_whole_conversation_jinja(tok):
    """The point of the rendering: the first reply's thought is trained (Qwen3's jinja drops it in history)."""
    pairs = _ours(tok, _canonical(REASONING_HISTORY), enable_thinking=True)
    assert tok.decode(pairs[0][1]) == THOUGHT + "Hello!<|im_end|>\n"
    whole = tok.apply_chat_template(REASONING_HISTORY, tokenize=False)
    assert "the user greets" not in whole
    assert [t for p, r in pairs for t in p + r] != tok.encode(whole, add_special_tokens=False)


def test_template_null_parses_the_jinja_into_the_same_streams(tok):
    """Unset template: the tokenizer's jinja cut into slots (MindSpeed's parse_template), turn by turn too."""
    for thinking in (True, False, None):
        for messages in (REASONING_HISTORY, PLAIN_HISTORY):
            ours = _ours(tok, _canonical(messages), template=None, enable_thinking=thinking)
            assert ours == reference_pairs(tok, messages, None, thinking)


def test_alpaca_history_is_rendered_turn_by_turn(tok):
    row = {"instruction": "And a third?", "input": "", "output": THOUGHT + "Red.", "system": "Be brief.",
           "history": [["Name a colour.", "Blue."], ["Another one?", "Green."]]}
    example = convert_example(row, DatasetAttr(name="a", file_name="-", formatting="alpaca"))
    messages = [{"role": "system", "content": "Be brief."}] + PLAIN_HISTORY
    for thinking in (True, False, None):
        assert _ours(tok, example, enable_thinking=thinking) == reference_pairs(tok, messages, None, thinking)


def test_default_system_fills_an_absent_system(tok):
    ours = _ours(tok, _canonical(PLAIN_HISTORY), default_system="Answer in one word.")
    messages = [{"role": "system", "content": "Answer in one word."}] + PLAIN_HISTORY
    assert ours == reference_pairs(tok, messages, None, True)


def test_tool_call_with_its_own_thought_keeps_it_before_the_call(tok):
    """sharegpt `function_call` content may carry a thought block: it goes before the <tool_call> text, and no
    empty block is added (MindSpeed's FunctionFormatter)."""
    call = THOUGHT + json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    row = {"conversations": [{"from": "human", "value": "Weather in Paris?"}, {"from": "function_call", "value": call},
                             {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "Sunny."}],
           "system": "Use tools.", "tools": json.dumps(TOOLS)}
    example = convert_example(row, DatasetAttr(name="s", file_name="-", formatting="sharegpt"))
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": THOUGHT, "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]
    assert _ours(tok, example, enable_thinking=True) == reference_pairs(tok, messages, TOOLS, True)


def test_mindspeeds_own_tool_details(tok):
    """Where MindSpeed's qwen3 differs from the jinja, worked by hand: tools without a system prompt start the
    system turn with Qwen's "\\n\\n# Tools", and `tool_format` set swaps the tool-call slot for content + eos
    (no newline after <|im_end|>)."""
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "function", "content": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})}]
    template = get_template(DataArguments(template="qwen3", tool_format="qwen"), tok)
    (prompt, reply), = template.render(messages, "", json.dumps(TOOLS))
    assert prompt[0].startswith("<|im_start|>system\n\n\n# Tools\n\nYou may call one or more functions")
    assert reply == ("<think>\n\n</think>\n\n",
                     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')


# --- labels and the budget -------------------------------------------------------------------------------------

def _rows(*examples):
    return {key: [e[key] for e in examples] for key in ("messages", "system", "tools")}


def _labels(pairs, trained):
    """Reference labels: every prompt ignored, the replies of the turns in `trained` kept."""
    return [t for k, (p, r) in enumerate(pairs) for t in [IGNORE_INDEX] * len(p) + (r if k in trained else
                                                                                 [IGNORE_INDEX] * len(r))]


@pytest.mark.parametrize("enable_thinking", [True, False, None])
def test_labels_per_turn_follow_train_on_prompt_and_mask_history(tok, enable_thinking):
    example = _canonical(TOOL_CALLS, TOOLS)
    pairs = reference_pairs(tok, TOOL_CALLS, TOOLS, enable_thinking)
    ids = [t for p, r in pairs for t in p + r]
    for extra, labels in (({}, _labels(pairs, {0, 1, 2})), ({"mask_history": True}, _labels(pairs, {2})),
                          ({"train_on_prompt": True}, ids)):
        data = DataArguments(template="qwen3", cutoff_len=4096, enable_thinking=enable_thinking, **extra)
        out = SupervisedProcessor(get_template(data, tok), tok, data, packing=False)(_rows(example))
        assert out["input_ids"] == [ids] and out["labels"] == [labels]


@pytest.mark.parametrize("enable_thinking", [True, False, None])
def test_a_batch_with_recurring_pieces_encodes_each_sample_as_alone(tok, enable_thinking):
    """A batch whose samples share pieces (the same conversation twice, the default system filled into every sample
    without one, the empty thought block in each turn), tokenized in one call where each recurring piece is
    tokenized once: every sample still gets its own jinja reference, and no two samples share a list."""
    system = "Answer in one word."
    samples = [(PLAIN_HISTORY, None), (REASONING_HISTORY, None), (PLAIN_HISTORY, None), (TOOL_CALLS, TOOLS),
               (PLAIN_HISTORY[:2], None), (TOOL_CALLS, TOOLS)]
    data = DataArguments(template="qwen3", cutoff_len=4096, enable_thinking=enable_thinking, default_system=system,
                         train_on_prompt=True)
    out = SupervisedProcessor(get_template(data, tok), tok, data, packing=False)(
        _rows(*(_canonical(messages, tools) for messages, tools in samples)))
    expected = []
    for messages, tools in samples:
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}] + messages
        expected.append([t for p, r in reference_pairs(tok, messages, tools, enable_thinking) for t in p + r])
    assert out["input_ids"] == expected and out["labels"] == expected
    assert out["input_ids"][0] is not out["input_ids"][2]
    twice = encode_conversations(tok, [get_template(data, tok).render(PLAIN_HISTORY[:2], "", "")] * 2)
    assert twice[0] == twice[1] and twice[0][0][0] is not twice[1][0][0] and twice[0][0][1] is not twice[1][0][1]


def test_cutoff_budget_is_split_turn_by_turn(tok):
    """LLaMA-Factory's infer_seqlen per turn, restated: a reply under half the remaining budget is kept whole,
    else a prompt under half, else both in proportion; later turns get what the earlier ones left."""
    def split(source, target, budget):
        if target * 2 < budget:
            keep = target
        elif source * 2 < budget:
            keep = min(budget - source, target)
        else:
            keep = min(int(budget * target / (source + target)), target)
        return min(max(budget - keep, 0), source), keep

    example = _canonical(PLAIN_HISTORY)
    pairs = reference_pairs(tok, PLAIN_HISTORY, None, True)
    cutoff = len(pairs[0][0]) + len(pairs[0][1]) + len(pairs[1][0]) + 3  # turn 2 is cut, turn 3 gets nothing
    ids, labels, left = [], [], cutoff
    for prompt, reply in pairs:
        if left <= 0:
            break
        n_prompt, n_reply = split(len(prompt), len(reply), left)
        ids += prompt[:n_prompt] + reply[:n_reply]
        labels += [IGNORE_INDEX] * n_prompt + reply[:n_reply]
        left -= n_prompt + n_reply
    data = DataArguments(template="qwen3", cutoff_len=cutoff)
    out = SupervisedProcessor(get_template(data, tok), tok, data, packing=False)(_rows(example))
    assert len(ids) == cutoff and out["input_ids"] == [ids] and out["labels"] == [labels]


def test_gpt_multi_turn_streams_and_efficient_eos_labels(tok):
    """gpt (Harmony slots, efficient_eos), by hand: the empty analysis channel per turn, one eos at the end, and
    the first prompt token of the second turn labelled with the eos id (LLaMA-Factory's efficient_eos rule)."""
    data = DataArguments(template="gpt", enable_thinking=False, cutoff_len=4096)
    template = get_template(data, tok)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}]
    empty = "<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>"
    turns = template.render(messages)
    assert turns == [(("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.<|end|>",
                       "<|start|>user<|message|>Hi<|end|><|start|>assistant", empty), ("Yo<|end|>",)),
                     (("<|start|>user<|message|>Bye<|end|><|start|>assistant", empty), ("Ciao<|end|>",))]
    enc = [tok.encode(piece, add_special_tokens=False) for turn in turns for side in turn for piece in side]
    p0, r0, p1, r1 = enc[0] + enc[1] + enc[2], enc[3], enc[4] + enc[5], enc[6]
    out = SupervisedProcessor(template, tok, data, packing=False)(_rows({"messages": messages, "system": "",
                                                                         "tools": ""}))
    eos = tok.eos_token_id
    assert out["input_ids"] == [p0 + r0 + p1 + r1 + [eos]]
    assert out["labels"] == [[IGNORE_INDEX] * len(p0) + r0 + [eos] + [IGNORE_INDEX] * (len(p1) - 1) + r1 + [eos]]


def test_pieces_are_tokenized_on_their_own(tok):
    """MindSpeed tokenizes each message apart: with the `empty` template a query and its reply never merge."""
    template = get_template(DataArguments(template="empty"), tok)
    pairs = encode_turns(tok, template.render([{"role": "user", "content": "hello"},
                                               {"role": "assistant", "content": "world"}]))
    assert pairs == [(tok.encode("hello", add_special_tokens=False), tok.encode("world", add_special_tokens=False))]


def test_openai_parallel_tool_answers_form_one_observation(tok):
    """Two tool messages in a row (parallel calls): one observation turn, as the jinja renders them (one user
    block) and as MindSpeed's OpenAI converter joins them."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Paris and Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [call, {**call, "function": {
                    "name": "get_weather", "arguments": {"city": "Rome"}}}]},
                {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rainy"},
                {"role": "assistant", "content": "Sunny in Paris, rainy in Rome."}]
    example = _canonical(messages, TOOLS)
    assert [m["role"] for m in example["messages"]] == ["user", "function", "observation", "assistant"]
    assert _ours(tok, example, enable_thinking=True) == reference_pairs(tok, messages, TOOLS, True)
