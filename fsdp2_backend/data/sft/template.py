"""Chat templates of the SFT data path: a canonical example (formats.py) → (prompt, reply) pieces per turn → ids.

Every template renders a conversation as MindSpeed-LLM's FSDP2 data path does (LLaMA-Factory's `Template` /
`ReasoningTemplate`, as LLaMA-Factory had them before its PR #10435), not as a chat template renders a whole
conversation:
- Slots: `{{content}}` filled per message; system and tools in the first prompt (`system + tools text`, the system
  slot present when either is given), observations and tool calls in their own slots; `efficient_eos` templates
  (gpt) end the sample with one eos (supervised.py).
- Reasoning templates (qwen3, gpt, a tokenizer template with `<think>`): each (prompt, reply) pair is rendered
  the way the template renders a FINAL turn. Every reply keeps its own thought block; a reply without one gets
  the empty block (`<think>\n\n</think>\n\n`), in the reply (trained) when `enable_thinking` is true, in the
  prompt (not trained) when it is false or None; false also removes every reply's thought first. So a
  multi-turn Qwen3 sample keeps the reasoning of earlier replies, which Qwen3's jinja drops (see the README).
- `qwen3`: Qwen's tool prompt (`\n\n# Tools...` after the system text, so a sample with tools and no system
  starts `<|im_start|>system\n\n\n# Tools`, as MindSpeed writes it), `<tool_call>` replies, `<tool_response>`
  observations; for single-turn samples without tools these are the tokens of Qwen3's `apply_chat_template`.
- `template: None`: the tokenizer's own chat template cut into slots (MindSpeed's parse_template), the `empty`
  template when it has none.
- `data.tool_format` replaces the template's tool prompt and its tool-call slot (`{{content}}` + eos, as
  MindSpeed does).

Ids: every piece (the first prompt's prefix / system / query, each message, the empty thought block) is
tokenized on its own, as MindSpeed does, in one batched tokenizer call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from fsdp2_backend.data.sft.formats import FUNCTION, OBSERVATION
from fsdp2_backend.usage_errors import UsageError

Pieces = Tuple[str, ...]
Turn = Tuple[Pieces, Pieces]  # (prompt pieces, reply pieces), each piece tokenized on its own
TOOL_FORMATS = ("qwen", "default")
THINK = ("<think>\n", "\n</think>\n\n")

QWEN_TOOLS_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                   "provided with function signatures within <tools></tools> XML tags:\n<tools>")
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
    return [t for t in parsed if isinstance(t, dict)]


def _calls(content: str) -> List[Tuple[str, str]]:
    """(name, arguments as JSON text) of a tool-call reply (MindSpeed re-dumps the arguments: a string stays one)."""
    try:
        parsed = json.loads(content)
    except ValueError:
        return []
    return [(str(c.get("name")), json.dumps(c.get("arguments"), ensure_ascii=False))
            for c in (parsed if isinstance(parsed, list) else [parsed]) if isinstance(c, dict)]


def qwen_tools_text(tools: str) -> str:
    wrapped = [t if t.get("type") == "function" else {"type": "function", "function": t} for t in _tool_list(tools)]
    return QWEN_TOOLS_HEAD + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in wrapped) + QWEN_TOOLS_TAIL


def qwen_call_text(calls: List[Tuple[str, str]]) -> str:
    return "\n".join("<tool_call>\n" + json.dumps({"name": name, "arguments": json.loads(args)}, ensure_ascii=False)
                     + "\n</tool_call>" for name, args in calls)


def default_tools_text(tools: str) -> str:
    text, names = "", []
    for tool in _tool_list(tools):
        fn = tool.get("function", {}) if tool.get("type") == "function" else tool
        params = fn.get("parameters") or {}
        args = ""
        for name, spec in (params.get("properties") or {}).items():
            required = ", required" if name in params.get("required", []) else ""
            enum = ", should be one of [{}]".format(", ".join(map(str, spec["enum"]))) if spec.get("enum") else ""
            items = (", where each item should be " + spec["items"].get("type", "")) if spec.get("items") else ""
            args += (f"  - {name} ({spec.get('type', '')}{required}): {spec.get('description', '')}"
                     f"{enum}{items}\n")
        text += f"> Tool Name: {fn.get('name')}\nTool Description: {fn.get('description', '')}\nTool Args:\n{args}\n"
        names.append(str(fn.get("name")))
    return ("You have access to the following tools:\n" + text + "Use the following format if using a tool:\n```\n"
            f"Action: tool name (one of [{', '.join(names)}])\nAction Input: the input to the tool, in a JSON format "
            'representing the kwargs (e.g. ```{"input": "hello world", "num_beams": 5}```)\n```\n')


def default_call_text(calls: List[Tuple[str, str]]) -> str:
    return "\n".join(f"Action: {name}\nAction Input: {args}" for name, args in calls)


@dataclass
class SlotTemplate:
    """LLaMA-Factory's slot template: `{{content}}` slots, `{{eos}}` the eos text (see the module docstring)."""

    name: str
    user: str = "{{content}}"
    assistant: str = "{{content}}{{eos}}"
    system: str = "{{content}}"
    observation: Optional[str] = None  # None: the user slot
    function: Optional[str] = None     # None: the assistant slot
    prefix: str = ""
    default_system: str = ""
    thought_words: Tuple[str, str] = THINK  # also where a tool-call reply's own thought is found
    reasoning: bool = False            # LLaMA-Factory's ReasoningTemplate: the thought rules per turn
    efficient_eos: bool = False
    enable_thinking: Optional[bool] = True
    tool_format: str = "default"
    eos_text: str = ""
    stop_words: Tuple[str, ...] = ()

    def _fill(self, slot: str, content: str) -> str:
        return slot.replace("{{eos}}", self.eos_text).replace("{{content}}", content, 1)

    def remove_thought(self, content: str) -> str:
        begin, end = self.thought_words
        return re.sub(re.escape(begin) + "(.*?)" + re.escape(end), "", content, flags=re.DOTALL).lstrip("\n")

    def _has_thought(self, content: str) -> bool:
        begin, end = self.thought_words
        return begin.strip() in content or end.strip() in content

    def _function_text(self, content: str) -> str:
        """A tool-call reply: its own thought block (if any) first, then the calls in the tool format."""
        begin, end = self.thought_words
        thought = re.search(re.escape(begin) + "(.*?)" + re.escape(end), content, flags=re.DOTALL)
        if thought:
            content = content.replace(thought.group(0), "")
        calls = _calls(content)
        text = qwen_call_text(calls) if self.tool_format == "qwen" else default_call_text(calls)
        return (thought.group(0) if thought else "") + text

    def render(self, messages: Sequence[Dict[str, str]], system: str = "", tools: str = "") -> List[Turn]:
        """(prompt pieces, reply pieces) per turn, each turn as the template renders a final one."""
        system = system or self.default_system
        turns = []
        for i in range(0, len(messages), 2):
            query, reply = messages[i], messages[i + 1]
            prompt: List[str] = []
            if i == 0:
                prompt.append(self.prefix)
                if system or tools:
                    tools_text = ""
                    if _tool_list(tools):
                        tools_text = qwen_tools_text(tools) if self.tool_format == "qwen" else default_tools_text(tools)
                    prompt.append(self._fill(self.system, system + tools_text))
            slot = (self.observation or self.user) if query["role"] == OBSERVATION else self.user
            prompt.append(self._fill(slot, query["content"]))
            content = reply["content"]
            if self.reasoning and self.enable_thinking is False:
                content = self.remove_thought(content)
            if reply["role"] == FUNCTION:
                body = [self._fill(self.function or self.assistant, self._function_text(content))]
            else:
                body = [self._fill(self.assistant, content)]
            if self.reasoning and not self._has_thought(content):
                empty = self.thought_words[0] + self.thought_words[1]  # its own piece, as MindSpeed tokenizes it
                if self.enable_thinking:
                    body.insert(0, empty)
                else:
                    prompt.append(empty)
            turns.append((tuple(p for p in prompt if p), tuple(b for b in body if b)))
        return turns


def _qwen3(**kw) -> SlotTemplate:
    return SlotTemplate(name="qwen3", user="<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",
                        assistant="{{content}}<|im_end|>\n", system="<|im_start|>system\n{{content}}<|im_end|>\n",
                        function="{{content}}<|im_end|>\n",
                        observation=("<|im_start|>user\n<tool_response>\n{{content}}\n</tool_response><|im_end|>\n"
                                     "<|im_start|>assistant\n"),
                        reasoning=True, tool_format="qwen", stop_words=("<|im_end|>",), **kw)


def _gpt(**kw) -> SlotTemplate:
    return SlotTemplate(name="gpt", user="<|start|>user<|message|>{{content}}<|end|><|start|>assistant",
                        assistant="{{content}}<|end|>", system="<|start|>system<|message|>{{content}}<|end|>",
                        default_system="You are ChatGPT, a large language model trained by OpenAI.",
                        thought_words=("<|channel|>analysis<|message|>",
                                       "<|end|><|start|>assistant<|channel|>final<|message|>"),
                        reasoning=True, efficient_eos=True, **kw)


def _empty(**kw) -> SlotTemplate:
    return SlotTemplate(name="empty", assistant="{{content}}", **kw)


TEMPLATES = {"qwen3": _qwen3, "gpt": _gpt, "empty": _empty}
REPLACE_EOS = ("qwen3",)  # MindSpeed makes the first stop word the eos of these templates (replace_eos)


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
                        prefix=prefix, default_system=default_system, reasoning=reasoning)


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
    with `default_system`, `enable_thinking` and `tool_format` applied as MindSpeed applies them."""
    name = data_args.template
    if name in TEMPLATES:
        template = TEMPLATES[name]()
    elif name is None:
        if hf_tokenizer is not None and isinstance(getattr(hf_tokenizer, "chat_template", None), str):
            template = parse_tokenizer_template(hf_tokenizer)
        else:
            template = _empty()
            from fsdp2_backend.distributed.console import print_rank0

            # LLaMA-Factory warns here too: no separator and no end-of-reply token, so the model never learns
            # where a reply ends
            print_rank0("warning: data.template: unset, and the tokenizer has no chat template — using the empty "
                        "template (the prompt and the reply joined with nothing between them and no end-of-reply "
                        "token); set data.template to one of " + ", ".join(n for n in TEMPLATES if n != "empty")
                        + " (or empty, to keep this and silence the warning)")
    else:
        raise UsageError(f"data.template: '{name}' is not a template — use one of {', '.join(TEMPLATES)}, or unset "
                         "it to use the tokenizer's own chat template")
    eos = template.stop_words[0] if name in REPLACE_EOS else (getattr(hf_tokenizer, "eos_token", None) or "")
    template = replace(template, eos_text=eos, enable_thinking=data_args.enable_thinking)
    if data_args.tool_format is not None:  # MindSpeed swaps the tool prompt and the tool-call slot
        template = replace(template, tool_format=data_args.tool_format,
                           function="{{content}}" if template.efficient_eos else "{{content}}{{eos}}")
    if data_args.default_system is not None:
        template.default_system = data_args.default_system
    return template


def encode_turns(hf, turns: Sequence[Turn]) -> List[Tuple[List[int], List[int]]]:
    """(prompt ids, reply ids) per turn: each piece tokenized on its own (see the module docstring)."""
    return encode_conversations(hf, [turns])[0]


def batch_ids(hf, texts: List[str]) -> List[List[int]]:
    """`hf(texts, add_special_tokens=False)["input_ids"]`, straight from the fast tokenizer's Rust backend when the
    call would reach it unchanged (no truncation or padding set on it, transformers' special-token splitting
    as set): the same ids without transformers' per-text conversion (attention masks, offsets), which cost as much
    as the tokenization itself."""
    backend = getattr(hf, "_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if (fast is not None and getattr(hf, "is_fast", False) and backend.truncation is None
            and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(hf, "split_special_tokens", False))):
        return [encoding.ids for encoding in fast(texts, add_special_tokens=False)]
    return hf(texts, add_special_tokens=False)["input_ids"]


def encode_conversations(hf, conversations: Sequence[Sequence[Turn]]) -> List[List[Tuple[List[int], List[int]]]]:
    """`encode_turns` of many conversations with one batched tokenizer call (the fast tokenizer's threads). A piece
    that recurs in the batch (the empty thought block, a system prompt, a template prefix) is tokenized once: a
    piece's ids depend on its text alone. Every side gets lists of its own (callers may extend them)."""
    texts = list(dict.fromkeys(piece for turns in conversations for turn in turns for side in turn for piece in side))
    ids = dict(zip(texts, batch_ids(hf, texts))) if texts else {}
    out = []
    for turns in conversations:
        encoded = []
        for prompt, reply in turns:
            prompt_ids: List[int] = []
            for piece in prompt:
                prompt_ids += ids[piece]
            reply_ids: List[int] = []
            for piece in reply:
                reply_ids += ids[piece]
            encoded.append((prompt_ids, reply_ids))
        out.append(encoded)
    return out
