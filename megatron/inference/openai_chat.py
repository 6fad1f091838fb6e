"""OpenAI's chat completions API, ``POST /v1/chat/completions``, on the completions machinery of
``megatron.inference.openai_api``.

Request: ``model``, ``messages`` (a non-empty list of {"role": "system" | "developer" | "user" |
"assistant", "content": a string or a list of {"type": "text", "text"} parts (joined with newlines),
"name" (ignored)}), ``max_completion_tokens`` or its older name ``max_tokens`` (default: the server's
default number of new tokens), and as for completions ``temperature`` (0 greedy, at most 2), ``top_p``,
``n``, ``stop``, ``seed``, ``stream``, ``stream_options.include_usage``, ``user``. Unimplemented
parameters are accepted at their neutral value only (``logprobs`` false, ``top_logprobs``,
``logit_bias``, ``tools``, ``tool_choice``, ``response_format`` null, the penalties 0).

The messages become one prompt text by ``megatron.inference.chat_template`` (the checkpoint tokenizer's
chat template, or the documented plain one), which is then generated from exactly as a completions prompt
(so greedy answers equal ``tools/generate.py`` on that text). Reply: ``object`` "chat.completion", choices
with ``message`` {"role": "assistant", "content"}; streamed, "chat.completion.chunk"s whose first chunk
gives each choice's role, then ``delta`` {"content"} pieces, then an empty delta with the finish_reason.
"""

from __future__ import annotations

from typing import Any, Optional

from aiohttp import web

from megatron.inference.openai_api import (
    OpenAIRequest,
    Shape,
    answer,
    check_fields,
    parse_n,
    parse_sampling,
    parse_stream,
)
from megatron.inference.validation import RequestError, check_unicode, load_json_object

__all__ = ["chat_completions", "parse_chat_request", "CHAT"]

ROLES = ("system", "developer", "user", "assistant")
_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed",
           "stream", "stream_options", "user"}
_NEUTRAL = {"logprobs": False, "top_logprobs": None, "logit_bias": None, "tools": None, "tool_choice": None,
            "response_format": None, "presence_penalty": 0, "frequency_penalty": 0}
_MESSAGE_FIELDS = {"role", "content", "name"}


def _content(content: Any, index: int) -> str:
    if isinstance(content, list) and content and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            and set(part) == {"type", "text"} for part in content):
        content = "\n".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise RequestError(400, f"messages[{index}].content must be a string or a non-empty list of "
                                f"{{'type': 'text', 'text': str}} parts, got {content!r:.80}", param="messages")
    check_unicode(content, f"messages[{index}].content", "messages")
    return content


def parse_messages(messages: Any) -> list[dict]:
    """[{"role", "content"}] with content a string, or RequestError(400) naming the message."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list of messages", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(400, f"messages[{index}] must be an object, got {message!r:.80}", param="messages")
        unknown = sorted(set(message) - _MESSAGE_FIELDS)
        if unknown:
            raise RequestError(400, f"messages[{index}] has unknown fields {unknown!r:.200}; known: "
                                    f"{sorted(_MESSAGE_FIELDS)}", param="messages")
        if message.get("role") not in ROLES:
            raise RequestError(400, f"messages[{index}].role must be one of {', '.join(ROLES)}, got "
                                    f"{message.get('role')!r:.80}", param="messages")
        parsed.append({"role": message["role"], "content": _content(message.get("content"), index)})
    return parsed


def _max_tokens_name(body: dict) -> str:
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise RequestError(400, "give 'max_completion_tokens' or its older name 'max_tokens', not both",
                           param="max_tokens")
    return "max_tokens" if "max_tokens" in body else "max_completion_tokens"


def parse_chat_request(raw: bytes, limits, template) -> OpenAIRequest:
    """The fields of a /v1/chat/completions body, its messages rendered by ``template`` into one prompt."""
    body = load_json_object(raw)
    check_fields(body, _FIELDS, _NEUTRAL, ("model", "messages"))
    n = parse_n(body)
    if n > limits.max_prompts:
        raise RequestError(413, f"n={n} completions in one request; the limit is {limits.max_prompts}", param="n")
    params = parse_sampling(body, limits, _max_tokens_name(body), limits.default_max_new_tokens)
    messages = parse_messages(body["messages"])
    try:
        prompt = template.render(messages)
    except ValueError as error:
        raise RequestError(400, str(error), param="messages") from None
    return OpenAIRequest([prompt], n, params, *parse_stream(body), prompt_param="messages")


def _message_choice(index: int, text: str, finish_reason: str) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
            "logprobs": None}


def _delta(index: int, text: str, finish_reason: Optional[str]) -> dict:
    return {"index": index, "delta": {"content": text} if text else {}, "finish_reason": finish_reason,
            "logprobs": None}


def _opening(index: int) -> dict:
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}


CHAT = Shape("chat.completion", "chat.completion.chunk", "chatcmpl", _message_choice, _delta, _opening)


async def chat_completions(service, request: web.BaseRequest, raw: bytes) -> web.StreamResponse:
    """Answer one /v1/chat/completions request (RequestError / Busy propagate, before any byte is sent)."""
    return await answer(service, request, parse_chat_request(raw, service.limits, service.chat_template), CHAT)
