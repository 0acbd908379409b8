"""Pydantic request model for OpenAI's Responses API (``POST /v1/responses``) and its mapping onto chat.

Contract: ``ResponsesRequest`` parses the body (unknown fields accepted, as vLLM). ``to_chat_messages()``
turns ``instructions`` + ``input`` (a string, or items: ``message`` with ``input_text``/``output_text``
parts, ``function_call``, ``function_call_output``, ``reasoning``) into OpenAI chat messages: consecutive
function calls (and the assistant text before them) form one assistant turn, so parallel calls render as
one turn and their outputs as consecutive tool messages. ``chat_tools()`` gives OpenAI chat tools,
``chat_tool_choice()`` the chat form of ``tool_choice``. What onecard does not do raises ``ValueError``
naming the field (a 400): ``previous_response_id`` (the API is stateless: send the whole conversation),
non-function tools, non-text inputs. ``response_format()`` is ``text.format`` in chat's form (structured
outputs: json_schema / json_object).
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from onecard.sampling_params import SamplingParams
from onecard.server.openai_types import sampling_defaults

_DEFAULTABLE = ("temperature", "top_p")


class _Base(BaseModel):
    # strict scalars: a boolean is not a number here (the OpenAPI fuzzer checks that wrong types are refused)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class ResponsesRequest(_Base):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "auto"
    parallel_tool_calls: bool | None = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = True
    stream: bool = False
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: onecard's /v1/responses is stateless "
                             "(nothing is stored); send the whole conversation in `input`.")

    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` in chat's ``response_format`` form, for the structured-outputs machinery."""
        fmt = dict((self.text or {}).get("format") or {})
        kind = fmt.pop("type", "text")
        if kind == "json_schema":          # Responses flattens chat's {"json_schema": {name, schema, strict}}
            return {"type": "json_schema", "json_schema": fmt}
        return {"type": kind, **fmt}

    # ------------------------------------------------------------------ tools
    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        out = []
        for t in self.tools:
            if t.get("type") != "function":
                raise ValueError(f"tools: type {t.get('type')!r} is not supported; only function tools are.")
            if not t.get("name"):
                raise ValueError("tools: a function tool needs a name.")
            fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> Any:
        """The chat-completions form: "none" | "auto" | "required" | {"type": "function", "function": {...}}."""
        tc = self.tool_choice
        if tc is None:
            return None
        if isinstance(tc, str):
            if tc not in ("none", "auto", "required"):
                raise ValueError(f"tool_choice {tc!r} is not one of none, auto, required.")
            if tc == "required" and not self.tools:
                raise ValueError("tool_choice is 'required' but no tools were given.")
            return tc
        if tc.get("type") != "function" or not tc.get("name"):
            raise ValueError("tool_choice: only {\"type\": \"function\", \"name\": ...} is supported as an object.")
        names = [t.get("name") for t in self.tools or []]
        if tc["name"] not in names:
            raise ValueError(f"tool_choice names function {tc['name']!r}, which is not among the tools.")
        return {"type": "function", "function": {"name": tc["name"]}}

    # ------------------------------------------------------------------ input → messages
    def to_chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        pending_reasoning: str | None = None
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise ValueError(f"input: message role {role!r} is not supported.")
                msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                       "content": _text(item.get("content"))}
                if role == "assistant" and pending_reasoning is not None:
                    msg["reasoning_content"], pending_reasoning = pending_reasoning, None
                messages.append(msg)
            elif kind == "function_call":
                call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": _arguments(item.get("arguments"))}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":     # the same turn's parallel calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                    if pending_reasoning is not None:
                        msg["reasoning_content"], pending_reasoning = pending_reasoning, None
                    messages.append(msg)
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": _text(item.get("output"))})
            elif kind == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                pending_reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
            else:
                raise ValueError(f"input: item type {kind!r} is not supported.")
        return messages

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        values = sampling_defaults(self, _DEFAULTABLE + ("top_k", "min_p", "repetition_penalty"), defaults)
        return SamplingParams(max_tokens=self.max_output_tokens, seed=self.seed, stop=self.stop,
                              ignore_eos=self.ignore_eos, **values)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text", "text"):
                texts.append(part.get("text", ""))
            elif kind == "refusal":
                texts.append(part.get("refusal", ""))
            else:
                raise ValueError(f"input: content part type {kind!r} is not supported; only text parts are.")
        return "".join(texts)
    raise ValueError("input: content must be a string or a list of content parts.")


def _arguments(args: Any) -> Any:
    """Function-call arguments as a mapping where they parse (Qwen3-Coder's template iterates them)."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args if args is not None else {}
