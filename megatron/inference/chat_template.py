"""Chat messages -> the one prompt text a base model continues: the tokenizer's chat template, else a plain one.

A tokenizer loaded from a folder whose ``tokenizer_config.json`` has a ``chat_template`` (or that holds
``chat_template.jinja``, transformers' newer place for it) renders the messages with it, through
transformers' ``apply_chat_template`` with ``add_generation_prompt=True``: the text the model was tuned on.
Every other checkpoint gets ``plain_chat_prompt``, one line per message and an open assistant line::

    system: You are brief.
    user: Name a river.
    assistant:

(each message's content as sent, after "<role>: ", then a newline; the model's answer continues the
last line). Either way the rendered text is then an ordinary prompt, tokenized like any other.
"""

from __future__ import annotations

import json
import pathlib
from typing import Optional

__all__ = ["ChatTemplate", "plain_chat_prompt"]


def plain_chat_prompt(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _has_template(directory: Optional[pathlib.Path]) -> bool:
    if directory is None:
        return False
    if (directory / "chat_template.jinja").is_file():
        return True
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (ValueError, AttributeError) as error:
        raise ValueError(f"{str(config)!r} is not a JSON object ({error}); fix or remove it") from None


class ChatTemplate:
    """Renders a list of {"role", "content"} messages (content a string) into one prompt text."""

    def __init__(self, tokenizer):
        directory = getattr(tokenizer, "directory", None)
        self._hf = None
        self.source = "plain"
        if _has_template(directory):
            from transformers import AutoTokenizer  # noqa: PLC0415 (transformers: seconds to import, only for a checkpoint with a chat template)

            self._hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            self.source = str(directory)

    def render(self, messages: list[dict]) -> str:
        """The prompt text; ValueError when the template refuses the conversation (its own message)."""
        if self._hf is None:
            return plain_chat_prompt(messages)
        from jinja2 import TemplateError  # noqa: PLC0415 (a transformers dependency, present once it is loaded)

        try:
            return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as error:  # e.g. a template's raise_exception("roles must alternate ...")
            raise ValueError(f"the chat template refused the messages: {error}") from None
