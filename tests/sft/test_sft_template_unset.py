"""SFT with data.template unset and a tokenizer that has no chat template: the empty template (no separator, no
end-of-reply token) is said once, with the templates to pick — it used to be chosen silently."""
from __future__ import annotations

from fsdp2_backend.config.schema import DataArguments
from fsdp2_backend.data.sft.template import get_template
from tests.support.tiny_models import stdlib_texts, train_bytelevel_tokenizer

WARNING = ("warning: data.template: unset, and the tokenizer has no chat template — using the empty template (the "
           "prompt and the reply joined with nothing between them and no end-of-reply token); set data.template to "
           "one of qwen3, gpt (or empty, to keep this and silence the warning)\n")


def test_unset_template_without_a_chat_template_is_said_once(tmp_path, capsys):
    tokenizer = train_bytelevel_tokenizer(tmp_path, vocab_size=300, texts=stdlib_texts(max_files=5))
    assert getattr(tokenizer, "chat_template", None) is None
    assert get_template(DataArguments(template=None), tokenizer).name == "empty"
    assert capsys.readouterr().out == WARNING
    assert get_template(DataArguments(template="empty"), tokenizer).name == "empty"  # chosen: nothing said
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    get_template(DataArguments(template=None), tokenizer)  # the tokenizer's own: nothing said
    assert capsys.readouterr().out == ""
