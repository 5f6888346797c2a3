"""Dataset formats of the SFT data path: alpaca, sharegpt and OpenAI-style messages → one canonical example.

The canonical example (what templates read) is `{"messages": [{"role", "content"}...], "system": str,
"tools": str}` with roles `user`, `assistant`, `observation` (a tool's answer) and `function` (the assistant's
tool call, content = JSON of `{"name", "arguments"}` or a list of them), alternating prompt / reply:
even positions are user or observation, odd positions assistant or function, the last one a reply.
These are LLaMA-Factory's semantics (`data/converter.py`), which MindSpeed-LLM's FSDP2 path vendors; the
column and tag names a dataset may override are those of its `dataset_info.json` entry (`columns`, `tags`).
A sample that breaks the alternation is dropped (counted, said once by `loader.load_one`), as LLaMA-Factory does;
so is one with no text in the prompt or in the reply the format names (alpaca: an empty `instruction`+`input`
or `output`; messages: every prompt turn or every reply turn empty) — the mark of a file read under the wrong
`formatting` (a sharegpt file read as alpaca has neither column: each row would train an empty turn).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

USER, ASSISTANT, OBSERVATION, FUNCTION = "user", "assistant", "observation", "function"
PROMPT_ROLES, REPLY_ROLES = (USER, OBSERVATION), (ASSISTANT, FUNCTION)

ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                  "history": "history"}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": "system", "tools": "tools"}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
OPENAI_COLUMNS = {"messages": "messages", "system": "system", "tools": "tools"}
OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
               "observation_tag": "tool", "function_tag": "function_call", "system_tag": "system"}
FORMATS = ("alpaca", "sharegpt", "openai")
DEFAULT_COLUMNS = {"alpaca": ALPACA_COLUMNS, "sharegpt": SHAREGPT_COLUMNS, "openai": OPENAI_COLUMNS}


@dataclass
class DatasetAttr:
    """One dataset: where its file is and how to read it (a dataset_info.json entry, or an inline one)."""

    name: str
    file_name: str
    formatting: str = "alpaca"
    columns: Dict[str, str] = field(default_factory=dict)
    tags: Dict[str, str] = field(default_factory=dict)
    split: str = "train"
    num_samples: Optional[int] = None

    def column(self, key: str) -> Optional[str]:
        return self.columns.get(key, DEFAULT_COLUMNS[self.formatting].get(key))

    def tag(self, key: str) -> str:
        return self.tags.get(key, (OPENAI_TAGS if self.formatting == "openai" else SHAREGPT_TAGS)[key])


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def convert_alpaca(row: Dict[str, Any], attr: DatasetAttr) -> Optional[Dict[str, Any]]:
    messages: List[Dict[str, str]] = []
    history = row.get(attr.column("history")) if attr.column("history") else None
    for pair in history or []:
        if isinstance(pair, (list, tuple)) and len(pair) == 2:
            messages += [{"role": USER, "content": _text(pair[0])}, {"role": ASSISTANT, "content": _text(pair[1])}]
    query = [_text(row.get(attr.column("prompt")))]
    if attr.column("query") and row.get(attr.column("query")):
        query.append(_text(row.get(attr.column("query"))))
    messages.append({"role": USER, "content": "\n".join(q for q in query if q)})
    response = row.get(attr.column("response"))
    if isinstance(response, list):  # a ranked list (preference data): the first answer is the chosen one
        response = response[0] if response else ""
    messages.append({"role": ASSISTANT, "content": _text(response)})
    if not messages[-2]["content"].strip() or not messages[-1]["content"].strip():
        return None
    system = row.get(attr.column("system")) if attr.column("system") else None
    return {"messages": messages, "system": _text(system), "tools": ""}


def _openai_tool_calls(message: Dict[str, Any]) -> Optional[str]:
    calls = message.get("tool_calls")
    if not calls:
        return None
    out = []
    for call in calls:
        call = call.get("function", call)
        arguments = call.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        out.append({"name": call.get("name"), "arguments": arguments})
    return json.dumps(out, ensure_ascii=False)


def convert_messages(row: Dict[str, Any], attr: DatasetAttr) -> Optional[Dict[str, Any]]:
    """sharegpt and OpenAI messages; None when the roles do not alternate as the canonical form needs."""
    raw = list(row.get(attr.column("messages")) or [])
    role_tag, content_tag = attr.tag("role_tag"), attr.tag("content_tag")
    role_of = {attr.tag("user_tag"): USER, attr.tag("assistant_tag"): ASSISTANT,
               attr.tag("observation_tag"): OBSERVATION, attr.tag("function_tag"): FUNCTION}
    system = _text(row.get(attr.column("system"))) if attr.column("system") else ""
    if raw and raw[0].get(role_tag) == attr.tag("system_tag"):
        system = _text(raw[0].get(content_tag))
        raw = raw[1:]
    messages = []
    for message in raw:
        role = role_of.get(message.get(role_tag))
        content = _text(message.get(content_tag))
        calls = _openai_tool_calls(message) if attr.formatting == "openai" else None
        if role == ASSISTANT and calls:
            role, content = FUNCTION, calls
        if role is None:
            return None
        if attr.formatting == "openai" and role == OBSERVATION and messages and messages[-1]["role"] == OBSERVATION:
            # parallel tool answers: one observation, as MindSpeed's OpenAI converter joins them
            messages[-1]["content"] += "\n</tool_response>\n<tool_response>\n" + content
            continue
        messages.append({"role": role, "content": content})
    if len(messages) < 2 or len(messages) % 2:
        return None
    for index, message in enumerate(messages):
        if message["role"] not in (PROMPT_ROLES if index % 2 == 0 else REPLY_ROLES):
            return None
    if not any(m["content"].strip() for m in messages[0::2]) or not any(m["content"].strip() for m in messages[1::2]):
        return None
    tools = row.get(attr.column("tools")) if attr.column("tools") else None
    return {"messages": messages, "system": system, "tools": _text(tools) if tools else ""}


def convert_example(row: Dict[str, Any], attr: DatasetAttr) -> Optional[Dict[str, Any]]:
    """The canonical example of one raw row (None: malformed, to be dropped)."""
    if attr.formatting == "alpaca":
        return convert_alpaca(row, attr)
    return convert_messages(row, attr)


def fields_read(attr: DatasetAttr) -> str:
    """The columns (and tags) `attr`'s format reads, as an error message names them."""
    if attr.formatting == "alpaca":
        prompt = "/".join(c for c in (attr.column("prompt"), attr.column("query")) if c)
        return f"'{prompt}' (prompt) and '{attr.column('response')}' (reply)"
    return (f"'{attr.column('messages')}' (a list of turns with '{attr.tag('role_tag')}' "
            f"{attr.tag('user_tag')}/{attr.tag('assistant_tag')} and '{attr.tag('content_tag')}')")


def likely_formats(columns: List[str]) -> List[str]:
    """The formats whose default columns a file's columns match, for the hint in the error."""
    out = []
    if "conversations" in columns:
        out.append("sharegpt")
    if "messages" in columns:
        out.append("openai")
    if "instruction" in columns and "output" in columns:
        out.append("alpaca")
    return out
