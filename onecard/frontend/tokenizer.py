"""Chat-template rendering for process A (the tokenizer itself: ``onecard.vocab.load_tokenizer``).

Contract: ``resolve_chat_template(arg)`` turns ``--chat-template`` (a file path or an inline Jinja string) into
template text, raising ``ConfigError`` naming the flag. ``render_chat(tokenizer, messages, ...)`` applies the template
(transformers' ``apply_chat_template``, with ``tools`` and ``chat_template_kwargs``) and returns the prompt
text; ``encode_prompt`` turns prompt text into token ids without adding special tokens a second time
(the template already wrote them), as vLLM does for chat.
"""
from __future__ import annotations

import functools
import json
import logging
import math
from pathlib import Path
from typing import Any

from onecard.config import ConfigError

logger = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """The request's messages could not be rendered (maps to a 400)."""


def resolve_chat_template(arg: str | None) -> str | None:
    """``--chat-template`` as vLLM reads it: an existing file's contents, else the value as Jinja text."""
    if arg is None:
        return None
    path = Path(arg).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError as e:
        raise ConfigError(f"--chat-template={arg}: cannot read the file: {e}") from None
    if any(c in arg for c in "{}%"):
        return arg
    raise ConfigError(
        f"--chat-template={arg} is neither an existing file nor a Jinja template string; pass a path to a "
        ".jinja file or the template text.")


def _text_of(content: Any) -> Any:
    """OpenAI content (a string, None, or a list of parts) → the string the templates expect."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text"):
                texts.append(part.get("text", ""))
            else:
                raise ChatTemplateError(f"content part type {kind!r} is not supported; only text parts are.")
        return "\n".join(texts)
    raise ChatTemplateError("message content must be a string or a list of content parts.")


def prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalise OpenAI messages for HF templates: text content, tool-call arguments as dicts (templates such
    as Qwen3-Coder's iterate ``arguments|items``), None fields dropped."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if v is not None}
        if "content" in msg or msg.get("role") != "assistant":
            msg["content"] = _text_of(msg.get("content")) or ""
        calls = msg.get("tool_calls")
        if calls:
            new_calls = []
            for c in calls:
                c = dict(c)
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        pass  # leave as text; the template prints it
                c["function"] = fn
                new_calls.append(c)
            msg["tool_calls"] = new_calls
        out.append(msg)
    return out


def render_chat(tokenizer, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true.")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ChatTemplateError("continue_final_message needs the last message to be an assistant message.")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("tokenize", "messages", "conversation", "tools", "chat_template"):
        kwargs.pop(reserved, None)
    try:
        text = tokenizer.apply_chat_template(
            prepare_messages(messages), tools=tools or None, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, chat_template=chat_template,
            **kwargs)
    except ChatTemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja errors, missing template: the client's request fails
        raise ChatTemplateError(f"the chat template could not be applied: {e}") from None
    if not isinstance(text, str):  # some versions return a list for batched input
        text = text[0]
    return text


def encode_prompt(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


@functools.lru_cache(maxsize=8)
def max_token_chars(tokenizer) -> int:
    """The longest vocabulary entry, in characters (byte-level BPE: in bytes, which bounds characters)."""
    vocab = tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1) or 1


# A text is refused as too long before tokenizing when even this many times the fewest tokens it could be
# exceeds the context: normalizers (NFC) can merge a few code points, so the bound keeps a wide margin.
_LENGTH_MARGIN = 4


def surely_too_long(tokenizer, num_chars: int, max_model_len: int) -> int | None:
    """The least number of tokens a text of ``num_chars`` characters needs when that alone makes it longer
    than ``max_model_len`` by a wide margin (checked before tokenizing: a huge body costs nothing), else None.
    Every token covers at most ``max_token_chars`` characters, so tokens >= chars / max_token_chars."""
    least = math.ceil(num_chars / max_token_chars(tokenizer))
    return least if least > _LENGTH_MARGIN * max_model_len else None
