"""Chat templates of the SFT data path: a canonical example (formats.py) → (prompt, reply) text per turn → ids.

- `qwen3`: Qwen3's own chat template written out turn by turn, so that the concatenated ids equal the Qwen3
  tokenizer's `apply_chat_template` for the same messages (tests/sft/test_sft_template.py checks it on the
  template in shared/sft_parity): the tools block in the system turn, `<tool_call>` / `<tool_response>`, and
  Qwen3's thinking rules — reasoning (`<think>…</think>`) kept only on replies after the last user query, the
  final reply always carrying a think block (empty when it has none). `enable_thinking`: True trains on that
  block; False removes every reasoning and puts the empty block in the prompt (not trained); None keeps the
  data's own `<think>` tags untouched (mixed data) and puts an empty block in the prompt where a reply has none.
- `gpt`, `empty` and `template: None` (the tokenizer's own chat template, parsed into slots) follow
  LLaMA-Factory's slot templates (data/template.py of LLaMA-Factory, vendored by MindSpeed-LLM): system and
  tools in the first prompt, `efficient_eos` (one eos at the end of the sample, gpt), reasoning as
  LLaMA-Factory's ReasoningTemplate.

Ids: the text of all turns is tokenized at once (a fast tokenizer's offsets assign each token to its turn), so
the ids are exactly those of tokenizing the whole conversation, as `apply_chat_template` does; a slow tokenizer
tokenizes each piece on its own (LLaMA-Factory's way).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from fsdp2_backend.data.sft.formats import ASSISTANT, FUNCTION, OBSERVATION, USER
from fsdp2_backend.usage_errors import UsageError

Turn = Tuple[str, str]  # (prompt text, reply text)
TOOL_FORMATS = ("qwen", "default")
THINK = ("<think>\n", "\n</think>\n\n")

QWEN_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                   "with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                   "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                   "\"arguments\": <args-json-object>}\n</tool_call>")


def _tool_list(tools: str) -> List[dict]:
    if not tools:
        return []
    try:
        parsed = json.loads(tools)
    except ValueError:
        return []
    parsed = parsed if isinstance(parsed, list) else [parsed]
    return [t if "type" in t else {"type": "function", "function": t} for t in parsed if isinstance(t, dict)]


def _calls(content: str) -> List[dict]:
    try:
        parsed = json.loads(content)
    except ValueError:
        return []
    return [c for c in (parsed if isinstance(parsed, list) else [parsed]) if isinstance(c, dict)]


def qwen_tools_text(tools: str) -> str:
    listed = _tool_list(tools)
    return QWEN_TOOLS_HEAD + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in listed) + QWEN_TOOLS_TAIL


def qwen_call_text(calls: List[dict]) -> str:
    parts = []
    for call in calls:
        args = call.get("arguments")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        parts.append('<tool_call>\n{"name": "' + str(call.get("name")) + '", "arguments": ' + args + "}\n</tool_call>")
    return "\n".join(parts)


def default_tools_text(tools: str) -> str:
    lines = []
    for tool in _tool_list(tools):
        fn = tool.get("function", tool)
        lines.append(f"> Tool Name: {fn.get('name')}\nTool Description: {fn.get('description', '')}\nTool Args:")
        for name, spec in ((fn.get("parameters") or {}).get("properties") or {}).items():
            lines.append(f"  - {name} ({spec.get('type', '')}): {spec.get('description', '')}")
    names = ", ".join(str(t.get("function", t).get("name")) for t in _tool_list(tools))
    return ("You have access to the following tools:\n" + "\n".join(lines) + "\n\nUse the following format if "
            f"using a tool:\n```\nAction: tool name (one of [{names}])\nAction Input: the input to the tool, in a "
            "JSON format representing the kwargs\n```\n")


def default_call_text(calls: List[dict]) -> str:
    return "\n".join(f"Action: {c.get('name')}\nAction Input: "
                     f"{c['arguments'] if isinstance(c.get('arguments'), str) else json.dumps(c.get('arguments'), ensure_ascii=False)}"
                     for c in calls)


def split_thought(content: str) -> Tuple[str, str]:
    """(reasoning, answer) as Qwen3's template reads an assistant message with `</think>` in it."""
    if "</think>" not in content:
        return "", content
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content.split("</think>")[-1].lstrip("\n")


class Qwen3Template:
    """Qwen3's chat template, turn by turn (see the module docstring)."""

    name = "qwen3"
    efficient_eos = False
    stop_words = ("<|im_end|>",)

    def __init__(self, default_system: str = "", enable_thinking: Optional[bool] = True,
                 tool_format: Optional[str] = None):
        self.default_system, self.enable_thinking = default_system, enable_thinking
        self.tool_format = tool_format or "qwen"

    def render(self, messages: Sequence[Dict[str, str]], system: str = "", tools: str = "") -> List[Turn]:
        system = system or self.default_system
        if _tool_list(tools):
            tools_text = qwen_tools_text(tools) if self.tool_format == "qwen" else default_tools_text(tools)
            head = "<|im_start|>system\n" + (system + "\n\n" if system else "") + tools_text + "<|im_end|>\n"
        else:
            head = "<|im_start|>system\n" + system + "<|im_end|>\n" if system else ""
        last_query = max((i for i, m in enumerate(messages) if m["role"] == USER), default=len(messages) - 1)
        turns = []
        for i in range(0, len(messages), 2):
            query, reply = messages[i], messages[i + 1]
            prompt = head if i == 0 else ""
            if query["role"] == OBSERVATION:
                prompt += "<|im_start|>user\n<tool_response>\n" + query["content"] + "\n</tool_response><|im_end|>\n"
            else:
                prompt += "<|im_start|>user\n" + query["content"] + "<|im_end|>\n"
            prompt += "<|im_start|>assistant\n"
            calls = _calls(reply["content"]) if reply["role"] == FUNCTION else []
            content = "" if reply["role"] == FUNCTION else reply["content"]
            after_query, last = i + 1 > last_query, i + 1 == len(messages) - 1
            if self.enable_thinking is None and not (after_query and last):
                body = content  # keep the data's own tags in history
            else:
                reasoning, answer = split_thought(content)
                if self.enable_thinking is False:
                    reasoning = ""
                if after_query and (last or reasoning):
                    block = THINK[0] + reasoning.strip("\n") + THINK[1]
                    if not reasoning and self.enable_thinking is not True:
                        prompt, block = prompt + block, ""  # the empty block is the prompt's, not trained
                    body = block + answer.lstrip("\n")
                else:
                    body = answer
            if calls:
                call_text = qwen_call_text(calls) if self.tool_format == "qwen" else default_call_text(calls)
                body += ("\n" if body else "") + call_text
            turns.append((prompt, body + "<|im_end|>\n"))
        return turns


@dataclass
class SlotTemplate:
    """LLaMA-Factory's slot template: `{{content}}` slots, `{{eos}}` the tokenizer's eos text."""

    name: str
    user: str = "{{content}}"
    assistant: str = "{{content}}{{eos}}"
    system: str = "{{content}}"
    observation: Optional[str] = None
    function: Optional[str] = None
    prefix: str = ""
    default_system: str = ""
    thought_words: Optional[Tuple[str, str]] = None  # a reasoning template when set
    efficient_eos: bool = False
    enable_thinking: Optional[bool] = True
    tool_format: str = "default"
    eos_text: str = ""
    stop_words: Tuple[str, ...] = ()

    def _fill(self, slot: str, content: str) -> str:
        return slot.replace("{{content}}", content).replace("{{eos}}", self.eos_text)

    def _remove_thought(self, content: str) -> str:
        begin, end = self.thought_words
        return re.sub(re.escape(begin) + "(.*?)" + re.escape(end), "", content, flags=re.DOTALL).lstrip("\n")

    def render(self, messages: Sequence[Dict[str, str]], system: str = "", tools: str = "") -> List[Turn]:
        system = system or self.default_system
        tools_text = ""
        if _tool_list(tools):
            tools_text = ("\n\n" + qwen_tools_text(tools)) if self.tool_format == "qwen" else default_tools_text(tools)
        turns = []
        for i in range(0, len(messages), 2):
            query, reply = messages[i], messages[i + 1]
            prompt = ""
            if i == 0:
                prompt += self.prefix
                if system or tools_text:
                    prompt += self._fill(self.system, system + tools_text)
            prompt += self._fill(self.observation or self.user if query["role"] == OBSERVATION else self.user,
                                 query["content"])
            content = reply["content"]
            if reply["role"] == FUNCTION:
                calls = _calls(content)
                content = qwen_call_text(calls) if self.tool_format == "qwen" else default_call_text(calls)
                body = self._fill(self.function or self.assistant, content)
            else:
                if self.thought_words and self.enable_thinking is False:
                    content = self._remove_thought(content)
                body = self._fill(self.assistant, content)
            if self.thought_words and not any(w.strip() in content for w in self.thought_words):
                empty = self.thought_words[0] + self.thought_words[1]
                if self.enable_thinking:
                    body = empty + body
                else:
                    prompt += empty
            turns.append((prompt, body))
        return turns


def _gpt(**kw) -> SlotTemplate:
    return SlotTemplate(name="gpt", user="<|start|>user<|message|>{{content}}<|end|><|start|>assistant",
                        assistant="{{content}}<|end|>", system="<|start|>system<|message|>{{content}}<|end|>",
                        default_system="You are ChatGPT, a large language model trained by OpenAI.",
                        thought_words=("<|channel|>analysis<|message|>",
                                       "<|end|><|start|>assistant<|channel|>final<|message|>"),
                        efficient_eos=True, **kw)


def _empty(**kw) -> SlotTemplate:
    return SlotTemplate(name="empty", assistant="{{content}}", **kw)


TEMPLATES = {"qwen3": None, "gpt": _gpt, "empty": _empty}


def parse_tokenizer_template(hf) -> SlotTemplate:
    """The tokenizer's own chat template as slots: its renderings of placeholder messages, cut apart
    (LLaMA-Factory's parse_template)."""
    def render(messages, generation):
        return hf.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)

    prefix = hf.decode(hf.encode("")) if hf.encode("") else ""
    mark = "{{content}}"
    system_slot = render([{"role": "system", "content": mark}], False)[len(prefix):]
    user_empty_system = render([{"role": "system", "content": ""}, {"role": "user", "content": mark}], True)[len(prefix):]
    user_slot = render([{"role": "user", "content": mark}], True)[len(prefix):]
    assistant_slot = render([{"role": "user", "content": mark}, {"role": "assistant", "content": mark}],
                            False)[len(prefix) + len(user_slot):]
    reasoning = "<think>" in assistant_slot
    assistant_slot = assistant_slot.replace("<think>", "").replace("</think>", "").lstrip("\n")
    default_system = ""
    if len(user_slot) > len(user_empty_system):  # the template inserts a default system prompt of its own
        default_system = _extra_chars(user_empty_system, user_slot)
        user_slot = user_slot[len(system_slot.replace(mark, default_system, 1)):]
    return SlotTemplate(name="tokenizer", user=user_slot, assistant=assistant_slot, system=system_slot,
                        prefix=prefix, default_system=default_system,
                        thought_words=THINK if reasoning else None)


def _extra_chars(short: str, long: str) -> str:
    i, extra = 0, []
    for ch in long:
        if i < len(short) and short[i] == ch:
            i += 1
        else:
            extra.append(ch)
    return "".join(extra)


def get_template(data_args, hf_tokenizer):
    """The run's template from `data.template` (None: the tokenizer's own, or `empty` when it has none),
    with `default_system`, `enable_thinking` and `tool_format` applied."""
    name = data_args.template
    tool_format = data_args.tool_format
    if name == "qwen3":
        template = Qwen3Template(enable_thinking=data_args.enable_thinking, tool_format=tool_format)
    elif name in TEMPLATES:
        template = TEMPLATES[name](enable_thinking=data_args.enable_thinking)
    elif name is None:
        if hf_tokenizer is not None and isinstance(getattr(hf_tokenizer, "chat_template", None), str):
            template = replace(parse_tokenizer_template(hf_tokenizer), enable_thinking=data_args.enable_thinking)
        else:
            template = _empty(enable_thinking=data_args.enable_thinking)
    else:
        raise UsageError(f"data.template: '{name}' is not a template — use one of {', '.join(TEMPLATES)}, or unset "
                         "it to use the tokenizer's own chat template")
    if isinstance(template, SlotTemplate):
        eos = getattr(hf_tokenizer, "eos_token", None) or ""
        template = replace(template, eos_text=eos, tool_format=tool_format or template.tool_format)
    if data_args.default_system is not None:
        template.default_system = data_args.default_system
    return template


def encode_turns(hf, turns: Sequence[Turn]) -> List[Tuple[List[int], List[int]]]:
    """(prompt ids, reply ids) per turn, from one tokenization of the whole text (see the module docstring)."""
    return encode_conversations(hf, [turns])[0]


def encode_conversations(hf, conversations: Sequence[Sequence[Turn]]) -> List[List[Tuple[List[int], List[int]]]]:
    """`encode_turns` of many conversations with one batched tokenizer call (the fast tokenizer's threads)."""
    if not getattr(hf, "is_fast", False):
        out = []
        for turns in conversations:
            ids = [hf.encode(p, add_special_tokens=False) if p else [] for turn in turns for p in turn]
            out.append([(ids[k], ids[k + 1]) for k in range(0, len(ids), 2)])
        return out
    texts = ["".join(piece for turn in turns for piece in turn) for turns in conversations]
    encoded = hf(texts, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for turns, token_ids, offsets in zip(conversations, encoded["input_ids"], encoded["offset_mapping"]):
        bounds, end = [], 0
        for turn in turns:
            for piece in turn:
                end += len(piece)
                bounds.append(end)
        pieces: List[List[int]] = [[] for _ in bounds]
        k = 0
        for token, (start, _) in zip(token_ids, offsets):
            while k < len(bounds) - 1 and start >= bounds[k]:
                k += 1
            pieces[k].append(token)
        out.append([(pieces[k], pieces[k + 1]) for k in range(0, len(pieces), 2)])
    return out
