"""Offline inference, vLLM-compatible: ``LLM(model, **engine_args).generate(...)`` and ``.chat(...)``.

Contract: engine args use vLLM's names (``onecard.config.EngineArgs``). ``generate`` takes a prompt string,
a list of them, token-id lists, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": ...}`` dicts, and one
``SamplingParams`` or one per prompt; it returns one ``RequestOutput`` per prompt, in order. The engine core
runs in this process and thread (no server); ``n`` > 1 fans out into child requests that share the
prompt's KV blocks through the prefix cache. The output side (detokenizer, stop strings with ``min_tokens``,
``n`` children, logprob strings, finish reasons) is ``onecard.frontend.output_processor``, the one the server
uses, so ``LLM`` and the server give the same outputs for the same requests.
``SamplingParams(structured_outputs=StructuredOutputsParams(...))`` is compiled here (cached by spec) before the
request is queued; an invalid spec raises ``ValueError`` naming the field.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from onecard.config import EngineArgs, EngineConfig
from onecard.frontend.output_processor import (
    EngineRequestError,
    RequestOutputState,
    fan_out,
    offline_logprobs,
)
from onecard.frontend.tokenizer import resolve_chat_template
from onecard.outputs import CompletionOutput, RequestOutput
from onecard.protocol import EngineOutput, EngineRequest, TokenLogprobs
from onecard.sampling_params import SamplingParams
from onecard.vocab import load_tokenizer


@dataclass(slots=True)
class _Child:
    parent: int
    index: int
    output: RequestOutputState
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    text: list[str] = field(default_factory=list)


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        from onecard.core.engine_core import EngineCore

        self.engine_args, self.config = self.config_for(model, **kwargs)
        # the server's loader: local files only (onecard never downloads), --chat-template read the same way
        self.tokenizer = load_tokenizer(self.config.model.tokenizer)
        chat_template = resolve_chat_template(self.config.model.chat_template)
        if chat_template:
            self.tokenizer.chat_template = chat_template
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()
        self._grammar = None               # GrammarService, made at the first constrained request

    @staticmethod
    def config_for(model: str | None = None, **kwargs: Any) -> tuple[EngineArgs, EngineConfig]:
        """The engine arguments and configuration ``LLM(model, **kwargs)`` runs with (nothing is loaded): the
        option table's names, resolved by ``EngineArgs.create_config`` as ``onecard serve`` resolves its flags."""
        names = {f.name for f in fields(EngineArgs)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}; known: {sorted(names)}")
        args = EngineArgs(model=model, **kwargs)
        return args, args.create_config()

    def _compile_constraint(self, sp: SamplingParams) -> None:
        so = sp.structured_outputs
        if so is None or so._compiled is not None:
            return
        if self._grammar is None:
            from onecard.frontend.grammar import GrammarService

            self._grammar = GrammarService(self.tokenizer, int(self.config.model.hf_config["vocab_size"]),
                                           list(self.config.model.eos_token_ids))
        so._compiled = self._grammar.compile(so)

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        items = self._normalise_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"got {len(items)} prompts but {len(params)} sampling params.")
        return self._run(items, params)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            ids = self.tokenizer.apply_chat_template(
                conv, tools=tools, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, tokenize=True, **(chat_template_kwargs or {}))
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ internals
    def _normalise_prompts(self, prompts: Any) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append((p, self.tokenizer.encode(p)))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                out.append((p.get("prompt"), list(p["prompt_token_ids"])))
            elif isinstance(p, dict) and "prompt" in p:
                out.append((p["prompt"], self.tokenizer.encode(p["prompt"])))
            else:
                out.append((None, [int(t) for t in p]))
        return out

    def _run(self, items, params) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        children: dict[str, _Child] = {}
        eos = self.config.model.eos_token_ids
        for sp in params:
            self._compile_constraint(sp)
        for i, ((text, ids), sp) in enumerate(zip(items, params)):
            results.append(RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=ids))
            for j, rid, child_sp in fan_out(results[-1].request_id, sp):
                children[rid] = _Child(i, j, RequestOutputState(self.tokenizer, ids, child_sp),
                                       logprobs=[] if sp.logprobs is not None else None)
                err = self.engine.add_request(EngineRequest(rid, ids, child_sp, time.monotonic(), eos))
                if err is not None:
                    raise ValueError(err.error)
        pending = set(children)
        while pending:
            for out in self.engine.step():
                if out.request_id in pending and self._absorb(out.request_id, children[out.request_id], out,
                                                              results):
                    pending.discard(out.request_id)
        for ch in children.values():
            lps = None if ch.logprobs is None else offline_logprobs(self.tokenizer, ch.logprobs)
            results[ch.parent].outputs.append(CompletionOutput(
                index=ch.index, text="".join(ch.text), token_ids=ch.token_ids,
                cumulative_logprob=None if ch.logprobs is None else sum((t.logprob for t in ch.logprobs), 0.0),
                logprobs=lps, finish_reason=ch.output.finish_reason, stop_reason=ch.output.stop_reason))
        for res in results:
            res.outputs.sort(key=lambda c: c.index)
            res.finished = True
        return results

    def _absorb(self, rid: str, ch: _Child, out: EngineOutput, results: list[RequestOutput]) -> bool:
        """Fold one engine output into a child; True once it is finished."""
        if out.num_cached_tokens and ch.index == 0:
            results[ch.parent].num_cached_tokens = out.num_cached_tokens
        try:
            delta, abort = ch.output.process(out)
        except EngineRequestError as e:
            raise RuntimeError(e.message) from None
        if abort:
            self.engine.abort([rid])
        ch.token_ids.extend(delta.token_ids)
        ch.text.append(delta.text)
        if ch.logprobs is not None and delta.logprobs:
            ch.logprobs.extend(delta.logprobs)
        return ch.output.finished
