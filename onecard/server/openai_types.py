"""Pydantic request models for the OpenAI-compatible API (OpenAI's fields plus vLLM's extras).

Contract: ``ChatCompletionRequest``, ``CompletionRequest``, ``TokenizeRequest``, ``DetokenizeRequest`` parse
request bodies (unknown fields are accepted and ignored, as vLLM does). ``to_sampling_params(defaults)``
builds the engine's ``SamplingParams``; a bad value raises ``ValueError`` naming the field (a 400). An unset
max_tokens stays None: the engine fills in "up to the context length" and checks the fit. ``defaults`` are
the model's generation_config values used where the request leaves a field unset (vLLM's
``--generation-config auto``). Responses are plain dicts built in the route modules (exact OpenAI shapes,
cheap to serialise per SSE chunk).
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from onecard.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_N, TOP_K_MAX, SamplingParams

# A token id: an integer (never a bool or a float), non-negative; the vocabulary bound is checked per route.
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(request: Any, names: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields ``names`` of ``request`` (any API's request model), each from the request, else from the
    server's ``defaults`` (generation_config), left out where neither sets it (SamplingParams' default then)."""
    values: dict[str, Any] = {}
    for name in names:
        v = getattr(request, name)
        if v is None:
            v = defaults.get(name)
        if v is not None:
            values[name] = v
    return values


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Base(BaseModel):
    # NaN and Infinity (which Python's JSON parser accepts) are refused for every float field.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Base):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class FunctionDef(_Base):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Base):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(_Base):
    type: str
    json_schema: dict[str, Any] | None = None


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any] | str] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _SamplingFields(_Base):
    """Fields shared by chat and completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=TOP_K_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    response_format: ResponseFormat | None = None
    # structured outputs (vLLM): the extra body, and the older guided_* spellings vLLM 0.11 clients send
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def constraint_fields(self) -> dict[str, Any]:
        """Keyword arguments of ``frontend.constraints.constraint_for_request`` for this body's fields."""
        so = self.structured_outputs
        if self.structural_tag is not None and so is None:
            so = {"structural_tag": self.structural_tag}
        return {"structured_outputs": so, "response_format": self.response_format,
                "guided": {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                           "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar},
                "options": {"whitespace_pattern": self.guided_whitespace_pattern}}

    def _base_params(self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by onecard.")
        if self.guided_decoding_backend not in (None, "auto", "xgrammar") and not str(
                self.guided_decoding_backend).startswith("xgrammar"):
            raise ValueError(f"guided_decoding_backend {self.guided_decoding_backend!r} is not available; use "
                             "xgrammar (or auto).")
        values = sampling_defaults(self, _DEFAULTABLE, defaults)
        return SamplingParams(
            n=self.n, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, **values)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tool_choice_default(self) -> ChatCompletionRequest:
        # OpenAI (and vLLM): tools without tool_choice means "auto"; no tools means "none".
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        if (isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required") and not self.tools:
            raise ValueError("tool_choice names a tool or is 'required' but no tools were given.")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is "
                                 f"not among the tools ({', '.join(names)}).")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true.")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._base_params(defaults, self.requested_max_tokens, lp)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int64 | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n).")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty.")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        return self._base_params(defaults, self.max_tokens, self.logprobs)


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages.")
        return self


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[TokenId]
