"""Offline inference, vLLM-compatible: ``LLM(model, **engine_args).generate(...)`` and ``.chat(...)``.

Contract: engine args use vLLM's names (``onecard.config.EngineArgs``). ``generate`` takes a prompt string,
a list of them, token-id lists, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": ...}`` dicts, and one
``SamplingParams`` or one per prompt; it returns one ``RequestOutput`` per prompt, in order. The engine core
runs in this process and thread (no server); ``n`` > 1 fans out into child requests that share the
prompt's KV blocks through the prefix cache. Stop strings are applied by the incremental detokenizer.
``SamplingParams(structured_outputs=StructuredOutputsParams(...))`` is compiled here (cached by spec) before the
request is queued; an invalid spec raises ``ValueError`` naming the field.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, fields
from typing import Any, Sequence

from onecard.config import EngineArgs
from onecard.outputs import CompletionOutput, Logprob, RequestOutput
from onecard.protocol import EngineOutput, EngineRequest, FinishReason
from onecard.sampling_params import SamplingParams


@dataclass(slots=True)
class _Child:
    parent: int
    index: int
    detok: Any
    params: SamplingParams
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    cumulative: float | None
    finish: str | None = None
    stop_reason: int | str | None = None


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        from transformers import AutoTokenizer

        from onecard.core.engine_core import EngineCore

        names = {f.name for f in fields(EngineArgs)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}; known: {sorted(names)}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.config = self.engine_args.create_config()
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model.tokenizer)
        if self.config.model.chat_template:
            from pathlib import Path

            ct = self.config.model.chat_template
            self.tokenizer.chat_template = Path(ct).read_text() if Path(ct).exists() else ct
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()
        self._grammar = None               # GrammarService, made at the first constrained request

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
        from onecard.frontend.detokenizer import IncrementalDetokenizer

        results: list[RequestOutput] = []
        children: dict[str, _Child] = {}
        eos = self.config.model.eos_token_ids
        for sp in params:
            self._compile_constraint(sp)
        for i, ((text, ids), sp) in enumerate(zip(items, params)):
            results.append(RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=ids))
            for j in range(sp.n):
                child_sp = sp.clone(n=1)
                if sp.seed is not None and sp.n > 1:
                    child_sp.seed = sp.seed + j
                rid = f"{results[-1].request_id}-{j}"
                detok = IncrementalDetokenizer(self.tokenizer, ids, sp.skip_special_tokens,
                                               sp.spaces_between_special_tokens, list(sp.stop or []),
                                               sp.include_stop_str_in_output)
                children[rid] = _Child(i, j, detok, child_sp, [], [] if sp.logprobs is not None else None,
                                       0.0 if sp.logprobs is not None else None)
                err = self.engine.add_request(EngineRequest(rid, ids, child_sp, time.monotonic(), eos))
                if err is not None:
                    raise ValueError(err.error)
        pending = set(children)
        while pending:
            for out in self.engine.step():
                if out.request_id in pending:
                    if self._absorb(children[out.request_id], out, results):
                        pending.discard(out.request_id)
        for rid, ch in children.items():
            res = results[ch.parent]
            res.outputs.append(CompletionOutput(
                index=ch.index, text=ch.detok.text, token_ids=ch.token_ids,
                cumulative_logprob=ch.cumulative, logprobs=ch.logprobs, finish_reason=ch.finish,
                stop_reason=ch.stop_reason))
        for res in results:
            res.outputs.sort(key=lambda c: c.index)
            res.finished = True
        return results

    def _absorb(self, ch: _Child, out: EngineOutput, results: list[RequestOutput]) -> bool:
        if out.error:
            raise RuntimeError(out.error)
        if out.num_cached_tokens and ch.index == 0:
            results[ch.parent].num_cached_tokens = out.num_cached_tokens
        new = out.new_token_ids
        if new:
            ch.token_ids.extend(new)
            if ch.logprobs is not None and out.new_logprobs:
                for tl in out.new_logprobs:
                    d = {tid: Logprob(lp, rank=r + 1, decoded_token=self.tokenizer.decode([tid]))
                         for r, (tid, lp) in enumerate(sorted(tl.top.items(), key=lambda kv: -kv[1]))}
                    d[tl.token_id] = Logprob(tl.logprob, rank=tl.rank,
                                             decoded_token=self.tokenizer.decode([tl.token_id]))
                    ch.logprobs.append(d)
                    ch.cumulative = (ch.cumulative or 0.0) + tl.logprob
            upd = ch.detok.update(new)
            stop_str = upd[1] if isinstance(upd, tuple) else getattr(upd, "stop_string", None)
            if stop_str is not None:
                # the stop string ends the request: drop the tokens B may still produce
                self.engine.abort([out.request_id])
                ch.finish, ch.stop_reason = "stop", stop_str
                return True
        if out.finish_reason is not None:
            ch.detok.flush()
            ch.finish = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                         FinishReason.ABORT: "abort", FinishReason.ERROR: "error"}[out.finish_reason]
            ch.stop_reason = out.stop_reason
            return True
        return False
