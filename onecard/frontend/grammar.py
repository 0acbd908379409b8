"""Grammar compilation in process A (xgrammar), cached by (kind, spec), off the event loop.

Contract: ``StructuredOutputsConfig.parse(json_text, guided_backend)`` reads ``--structured-outputs-config`` /
``--guided-decoding-backend`` (backend ``auto`` or ``xgrammar``; ``disable_any_whitespace``,
``disable_additional_properties``, ``max_whitespace`` defaults) and raises ``ValueError`` naming the flag.
``GrammarService(tokenizer, vocab_size, stop_token_ids, config)``: ``compile(params, param) ->
CompiledConstraint`` compiles one ``StructuredOutputsParams`` (or returns the cached result: a dict lookup)
and raises ``ConstraintError`` naming ``param`` when the spec is invalid or cannot be compiled;
``await acompile(...)`` does it in a worker thread (a cache hit stays on the loop). ``on_compile(seconds)``
(metrics) is called for each real compilation; ``on_request()`` for each constrained request.
``await attach(sampling_params, constraint, thinking=, prompt_opened_think=)`` is what a route calls: it
compiles a ``frontend.constraints.RequestConstraint`` and sets ``sampling_params.structured_outputs`` (with
the reasoning hand-off: a thinking model is constrained after ``</think>``). Process B rebuilds the grammar from the serialized form
(``onecard.runner.structured``) with the same ``onecard.vocab.tokenizer_info(...)``. ``onecard.hardware.structured_outputs_backend()`` names the backend.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from onecard.frontend.constraints import ConstraintError, RequestConstraint
from onecard.sampling_params import CompiledConstraint, SamplingParams, StructuredOutputsParams
from onecard.vocab import tokenizer_info

BACKENDS = ("auto", "xgrammar")
_CACHE_BYTES = 512 << 20         # serialized grammars kept (a tool schema on a 152k vocab: ~100s of KB)


@dataclass(slots=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # at most this many whitespace characters in a row between JSON tokens (0 = unbounded, vLLM's behaviour). A
    # bound keeps a model from filling max_tokens with spaces, but it multiplies the grammar's states (a tool
    # schema: 20 KB -> 600 KB serialized at 32, deserializing 30 ms instead of 1.5 ms): off by default
    max_whitespace: int = 0

    @classmethod
    def parse(cls, json_text: str | None = None, guided_backend: str | None = None) -> StructuredOutputsConfig:
        values: dict[str, Any] = {}
        if json_text:
            try:
                values = json.loads(json_text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--structured-outputs-config is not valid JSON ({e}).") from None
            if not isinstance(values, dict):
                raise ValueError("--structured-outputs-config must be a JSON object.")
            values.pop("reasoning_parser", None)           # vLLM's field: --reasoning-parser does it here
            values.pop("enable_in_reasoning", None)
            unknown = set(values) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"--structured-outputs-config has unknown field(s) {sorted(unknown)}; known: "
                                 f"{sorted(cls.__dataclass_fields__)}.")
        if guided_backend is not None:
            values.setdefault("backend", guided_backend)
        cfg = cls(**values)
        backend = cfg.backend.split(":")[0]
        if backend not in BACKENDS:
            raise ValueError(f"structured outputs backend {cfg.backend!r} is not available; use auto or xgrammar "
                             "(--structured-outputs-config / --guided-decoding-backend).")
        if cfg.max_whitespace < 0:
            raise ValueError("--structured-outputs-config max_whitespace must be >= 0.")
        return cfg


def spec_key(params: StructuredOutputsParams, cfg: StructuredOutputsConfig) -> tuple[str, str]:
    kind = params.kind
    spec = getattr(params, kind)
    text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True, ensure_ascii=False)
    opts = (params.disable_any_whitespace or cfg.disable_any_whitespace, cfg.max_whitespace,
            params.disable_additional_properties or cfg.disable_additional_properties)
    return kind, f"{opts}|{text}"


def _choice_ebnf(choices: list[str]) -> str:
    alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return f"root ::= {alts}"


class GrammarService:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 config: StructuredOutputsConfig | None = None,
                 on_compile: Callable[[float], None] | None = None,
                 on_request: Callable[[], None] | None = None):
        self.tokenizer = tokenizer
        self.on_request = on_request
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.config = config or StructuredOutputsConfig()
        self.on_compile = on_compile
        self._compiler = None
        self._init_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledConstraint] = OrderedDict()
        self._cache_bytes = 0

    def warm(self) -> None:
        """Build the vocabulary view in a background thread (the first constrained request then waits less)."""
        threading.Thread(target=self._get_compiler, name="onecard-grammar-warm", daemon=True).start()

    def _think_ids(self) -> tuple[int | None, int | None]:
        ids = []
        for tok in ("<think>", "</think>"):
            i = self.tokenizer.convert_tokens_to_ids(tok)
            ids.append(i if isinstance(i, int) and i != self.tokenizer.unk_token_id and i >= 0 else None)
        return ids[0], ids[1]

    async def attach(self, params: SamplingParams, constraint: RequestConstraint | None, *, thinking: bool = False,
                     prompt_opened_think: bool = False) -> None:
        """Compile ``constraint`` (ConstraintError names the field) and set ``params.structured_outputs``."""
        if constraint is None:
            return
        compiled = await self.acompile(constraint.params, constraint.param)
        if thinking:
            start, end = self._think_ids()
            if end is not None:
                compiled = replace(compiled, think_start=start, think_end=end, in_reasoning=prompt_opened_think)
        so = constraint.params
        so._compiled = compiled
        params.structured_outputs = so
        if self.on_request is not None:
            self.on_request()

    def _get_compiler(self):
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                # xgrammar's own cache is off: ours holds the serialized form B needs
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def cached(self, params: StructuredOutputsParams) -> CompiledConstraint | None:
        key = spec_key(params, self.config)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def compile(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> CompiledConstraint:
        hit = self.cached(params)
        if hit is not None:
            return hit
        key = spec_key(params, self.config)
        t0 = time.perf_counter()
        compiled = self._compile(params, param)
        data = compiled.serialize_json()
        seconds = time.perf_counter() - t0
        if self.on_compile is not None:
            self.on_compile(seconds)
        digest = hashlib.sha256(f"{key[0]}\0{key[1]}".encode()).hexdigest()[:32]
        out = CompiledConstraint(key=digest, grammar_json=data)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = out
                self._cache_bytes += len(data)
                while self._cache_bytes > _CACHE_BYTES and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._cache_bytes -= len(old.grammar_json)
        return out

    async def acompile(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> CompiledConstraint:
        hit = self.cached(params)
        if hit is not None:
            return hit
        return await asyncio.to_thread(self.compile, params, param)

    def _compile(self, params: StructuredOutputsParams, param: str):
        compiler = self._get_compiler()
        cfg = self.config
        kind = params.kind
        spec = getattr(params, kind)
        where = param if param != "structured_outputs" else f"structured_outputs.{kind}"
        try:
            if kind == "json":
                schema = spec
                if isinstance(spec, str):
                    try:
                        schema = json.loads(spec)
                    except json.JSONDecodeError as e:
                        raise ConstraintError(f"{where}: the JSON schema is not valid JSON ({e}).", param) from None
                if not isinstance(schema, (dict, bool)):
                    raise ConstraintError(f"{where}: a JSON schema must be an object.", param)
                any_ws = not (params.disable_any_whitespace or cfg.disable_any_whitespace)
                import xgrammar as xgr

                grammar = xgr.Grammar.from_json_schema(
                    json.dumps(schema), any_whitespace=any_ws, max_whitespace_cnt=cfg.max_whitespace or None,
                    strict_mode=True)
                return compiler.compile_grammar(strict_json_strings(grammar))
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                re.compile(spec)       # Python's syntax errors are clearer than the backend's
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(_choice_ebnf(spec))
            if kind == "grammar":
                if "::=" in spec:
                    return compiler.compile_grammar(spec)
                return compiler.compile_lark(spec)
            if kind == "structural_tag":
                ws = 1 if (params.disable_any_whitespace or cfg.disable_any_whitespace) else cfg.max_whitespace
                return self._structural_tag(compiler, spec, ws or None)
        except ConstraintError:
            raise
        except (re.error, Exception) as e:  # noqa: BLE001 - the backend's message, against the field
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConstraintError(f"{where} could not be compiled: {msg}", param) from None
        raise ConstraintError(f"{where}: unknown constraint kind {kind!r}.", param)

    @staticmethod
    def _structural_tag(compiler, spec: str | dict[str, Any], max_whitespace: int | None):
        tag = json.loads(spec) if isinstance(spec, str) else spec
        if max_whitespace is not None:
            tag = _bound_whitespace(tag, max_whitespace)
        if isinstance(tag, dict) and "structures" in tag:       # vLLM's legacy form: begin/schema/end + triggers
            import xgrammar as xgr

            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                     for s in tag["structures"]]
            return compiler.compile_structural_tag(items, tag.get("triggers") or [])
        import xgrammar as xgr

        text = strict_json_strings(xgr.Grammar.from_structural_tag(json.dumps(tag)))
        if max_whitespace is not None:         # also the whitespace around XML parameters
            text = text.replace(_ANY_WS, _ANY_WS[:-1] + f"{{0, {max_whitespace}}}")
        return compiler.compile_grammar(text)


# xgrammar 0.2.9 writes a length-bounded JSON string's characters as [^"\\\r\n]: raw control characters (a
# random model picks \x17) then pass the grammar but not a JSON parser (json.loads, pydantic). Exclude them as
# its unbounded strings do (\0-\x1f), on the grammar's text.
_LOOSE_STRING_CHARS = r'[^\"\\\r\n]'
_STRICT_STRING_CHARS = r'[^\0-\x1f\"\\]'


# Its qwen_xml style lets whitespace surround a parameter value (``>`` ws* value ws* ``</parameter>``), where the
# tool parser (and vLLM's) strips one newline at each end and keeps the rest: ``<parameter=c> ab`` would be
# a 3-character value to the parser and a 2-character one to the grammar. Pin the layout Qwen3-Coder writes.
_ANY_WS = r"[ \n\r\t]*"
_XML_VALUE = re.compile(r'">" \[ \\n\\r\\t\](?:\*|\{0, \d+\}) (\w+) \[ \\n\\r\\t\](?:\*|\{0, \d+\}) "</parameter>"')


def strict_json_strings(grammar) -> str:
    """The EBNF text of an xgrammar ``Grammar`` whose JSON strings take no raw control characters and whose
    qwen_xml parameter values sit between exactly one newline on each side."""
    text = str(grammar).replace(_LOOSE_STRING_CHARS, _STRICT_STRING_CHARS)
    return _XML_VALUE.sub(r'">\\n" \1 "\\n</parameter>"', text)


def _bound_whitespace(node: Any, limit: int) -> Any:
    """A copy of a structural tag whose JSON-schema parts allow at most ``limit`` whitespace characters in a
    row (their own setting wins): how ``disable_any_whitespace`` reaches tool-call arguments.
    """
    if isinstance(node, list):
        return [_bound_whitespace(v, limit) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("json_schema", "schema") else _bound_whitespace(v, limit)) for k, v in node.items()}
    # (qwen_xml parts are bounded on the grammar's text instead: _structural_tag)
    if out.get("type") == "json_schema" and out.get("max_whitespace_cnt") is None and out.get("style") != "qwen_xml":
        out["max_whitespace_cnt"] = limit
    return out
