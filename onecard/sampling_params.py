"""SamplingParams with vLLM's names, defaults and validation.

Contract: a plain dataclass, no torch. ``validate()`` raises ``ValueError`` naming the field; the server
maps that to a 400. ``top_k`` 0 or -1 means disabled (vLLM accepts both). Every value that reaches the
runner is checked against the range the runner can hold (the bounds below are the one home of those
ranges; the HTTP models import them): a request that passes ``validate()`` cannot fail a step.
``structured_outputs`` (vLLM's ``StructuredOutputsParams``: exactly one of json, regex, choice, grammar,
json_object, structural_tag) constrains the output; process A compiles it (``onecard.frontend.grammar``)
and fills the private ``_compiled`` field that process B turns into a grammar matcher.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

_CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class CompiledConstraint:
    """What process B needs to build a request's grammar matcher (filled by process A, picklable)."""

    key: str                          # (kind, spec) digest: B caches deserialized grammars by it
    grammar_json: str                 # xgrammar ``CompiledGrammar.serialize_json()``
    # thinking models: the constraint starts after the reasoning block (``think_end`` token id)
    think_start: int | None = None    # ``<think>`` id: allowed as the first token (the model opens a block)
    think_end: int | None = None      # ``</think>`` id
    in_reasoning: bool = False        # the prompt opened a think block: wait for ``</think>`` first


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's names: one of json (schema dict or JSON text), regex, choice, grammar (EBNF/GBNF/Lark),
    json_object, structural_tag (xgrammar's JSON form)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    _compiled: CompiledConstraint | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        given = [f for f in _CONSTRAINT_FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of " + ", ".join(_CONSTRAINT_FIELDS)
                + (f"; got {', '.join(given)}." if given else "; got none."))
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}.")

    @property
    def kind(self) -> str:
        return next(f for f in _CONSTRAINT_FIELDS if getattr(self, f) not in (None, False))

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# torch.Generator.manual_seed takes [-2**63, 2**64): the API takes vLLM's int64 range and child request i of
# n gets seed + i, which stays inside the generator's range.
SEED_MIN, SEED_MAX = INT64_MIN, 2**64 - 1
MAX_N = 128                     # choices per request (OpenAI's documented maximum)
MAX_LOGPROBS = 20               # vLLM's default --max-logprobs
TOP_K_MAX = INT64_MAX           # held as int64 on the device (clamped to the vocabulary there)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Set by the engine: token ids that end the request besides stop_token_ids (EOS of the model).
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}.")

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                     "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, "must be a finite number")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be in [1, {MAX_N}]")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise bad("seed", f"must be in [{SEED_MIN}, {SEED_MAX}]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if self.temperature < 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.top_k <= TOP_K_MAX:
            raise bad("top_k", f"must be 0 or -1 (disabled) or a positive integer up to {TOP_K_MAX}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "must be less than or equal to max_tokens")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be non-negative")
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise bad("logprobs", f"must be at most {MAX_LOGPROBS}")
        if any(type(t) is not int or not 0 <= t <= INT64_MAX for t in self.stop_token_ids or ()):
            raise bad("stop_token_ids", "must be non-negative integers")

    def clone(self, **changes) -> SamplingParams:
        values = {f: getattr(self, f) for f in self.__dataclass_fields__ if not f.startswith("_")}
        values.update(changes)
        out = SamplingParams(**values)
        out._all_stop_token_ids = set(self._all_stop_token_ids)
        return out
