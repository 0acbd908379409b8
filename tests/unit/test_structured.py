"""Structured outputs, unit level: the request → constraint mapping, the compile service (cache, errors naming
the field), the bitmask op against xgrammar's own, the runner's matcher bookkeeping (reasoning hand-off, async
pending token, dead end), and the scheduler ending a request whose grammar died (blocks freed)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import xgrammar as xgr

from onecard.config import CacheConfig, SchedulerConfig
from onecard.core.request import Request
from onecard.core.scheduler import Scheduler
from onecard.frontend.constraints import ConstraintError, constraint_for_request
from onecard.frontend.grammar import GrammarService, StructuredOutputsConfig
from onecard.protocol import FinishReason
from onecard.runner.step_io import RunnerOutput
from onecard.runner.structured import GrammarMasker, apply_token_bitmask
from onecard.sampling_params import CompiledConstraint, SamplingParams, StructuredOutputsParams

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}, "strict": True}}]


def test_bitmask_op_matches_xgrammar_reference():
    g = torch.Generator().manual_seed(0)
    vocab, rows = 1000, [0, 2, 3]
    logits = torch.randn(5, vocab, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    ref = logits.clone()
    full = torch.full((5, mask.shape[1]), -1, dtype=torch.int32)
    full[rows] = mask
    xgr.apply_token_bitmask_inplace(ref, full, vocab_size=vocab, indices=rows, backend="torch_native")
    out = logits.clone()
    apply_token_bitmask(out, mask, torch.tensor(rows))
    assert torch.equal(out, ref)
    out2, ref2 = logits[:3].clone(), logits[:3].clone()
    xgr.apply_token_bitmask_inplace(ref2, mask, vocab_size=vocab, backend="torch_native")
    apply_token_bitmask(out2, mask, None)
    assert torch.equal(out2, ref2)


def test_constraint_mapping():
    rc = constraint_for_request(response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                                      "schema": {"type": "object"}}})
    assert rc.params.json == {"type": "object"} and rc.param == "response_format"
    # the Responses API's flat text.format shape
    rc = constraint_for_request(response_format={"type": "json_schema", "name": "a", "schema": {"type": "integer"}},
                                response_format_param="text.format")
    assert rc.params.json == {"type": "integer"} and rc.param == "text.format"
    assert constraint_for_request(response_format={"type": "text"}) is None
    assert constraint_for_request(guided={"guided_choice": ["a", "b"]}).params.choice == ["a", "b"]
    assert constraint_for_request(structured_outputs={"regex": "x+"}).params.regex == "x+"
    # required / named / Anthropic shapes → a structural tag of tool calls
    for choice in ("required", {"type": "any"}, {"type": "function", "function": {"name": "f"}},
                   {"type": "tool", "name": "f"}, {"type": "function", "name": "f"}):
        rc = constraint_for_request(tools=TOOLS, tool_choice=choice, tool_format="qwen3_coder")
        assert rc.is_tool_call and "<function=f>" in json.dumps(rc.params.structural_tag)
    rc = constraint_for_request(tools=TOOLS, tool_choice="auto", tool_format="hermes")   # strict under auto
    assert rc.params.structural_tag["format"]["type"] == "triggered_tags"
    assert constraint_for_request(tools=[{"name": "g", "input_schema": {}}], tool_choice="auto",
                                  tool_format="hermes") is None
    with pytest.raises(ConstraintError) as e:
        constraint_for_request(structured_outputs={"regex": "a"}, response_format={"type": "json_object"})
    assert e.value.param == "response_format"
    with pytest.raises(ConstraintError) as e:
        constraint_for_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"


def test_config_parse():
    assert StructuredOutputsConfig.parse('{"backend": "xgrammar", "disable_any_whitespace": true}').disable_any_whitespace
    assert StructuredOutputsConfig.parse(None, "auto").backend == "auto"
    for bad in ('{"backend": "outlines"}', "{nope", '{"unknown": 1}'):
        with pytest.raises(ValueError, match="structured-outputs-config|outlines"):
            StructuredOutputsConfig.parse(bad)


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    from onecard.vocab import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def service(tokenizer):
    calls = []
    svc = GrammarService(tokenizer, len(tokenizer), [tokenizer.convert_tokens_to_ids("<|im_end|>")],
                         on_compile=calls.append)
    svc.calls = calls
    return svc


def test_compile_is_cached_and_errors_name_the_field(service):
    p = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    a = service.compile(p)
    n = len(service.calls)
    b = service.compile(StructuredOutputsParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"}))
    assert b is a and len(service.calls) == n              # same spec (key order aside): no recompilation
    with pytest.raises(ConstraintError) as e:
        service.compile(StructuredOutputsParams(grammar="root ::= missing"), "guided_grammar")
    assert e.value.param == "guided_grammar" and "guided_grammar" in str(e.value)


def _req(rid: str, so: StructuredOutputsParams, outputs=(), placeholders=1) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=50, structured_outputs=so), 0.0)
    r.output_token_ids = list(outputs)
    r.num_output_placeholders = placeholders
    return r


def _allowed(mask_row: torch.Tensor, vocab: int) -> set[int]:
    bits = (mask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab]).flatten().tolist())


def test_masker_follows_outputs_reasoning_and_pending_tokens(service, tokenizer, tiny_tokenizer_dir):
    vocab = len(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    masker = GrammarMasker(str(tiny_tokenizer_dir), vocab, [eos], 8, torch.device("cpu"))
    so = StructuredOutputsParams(choice=["ab"])
    so._compiled = service.compile(so)
    ids = tokenizer.encode("ab", add_special_tokens=False)
    plain = Request("free", [1], SamplingParams(max_tokens=5), 0.0)
    mask, rows = masker.masks([plain, _req("r", so)], lambda rid: None)
    assert rows.tolist() == [1]
    assert ids[0] in _allowed(mask[0], vocab) and eos not in _allowed(mask[0], vocab)
    # async: the step in flight sampled the whole answer; the mask now allows only the stop token
    r = _req("r", so, outputs=ids[:-1], placeholders=2)
    mask, rows = masker.masks([r], lambda rid: ids[-1])
    assert rows is None and _allowed(mask[0], vocab) == {eos}
    # a thinking model: unconstrained until </think>, then constrained
    think = tokenizer.convert_tokens_to_ids("</think>")
    so2 = StructuredOutputsParams(choice=["ab"])
    so2._compiled = dataclasses.replace(so._compiled, think_end=think, in_reasoning=True)
    assert masker.masks([_req("t", so2, outputs=[5, 6])], lambda rid: None) is None
    mask, _ = masker.masks([_req("t", so2, outputs=[5, 6, think])], lambda rid: None)
    assert ids[0] in _allowed(mask[0], vocab) and 5 not in _allowed(mask[0], vocab) - {ids[0]}
    assert masker.take_errors() == {}


def test_masker_reports_a_rejected_token_and_a_dead_end(service, tokenizer, tiny_tokenizer_dir):
    vocab = len(tokenizer)
    masker = GrammarMasker(str(tiny_tokenizer_dir), vocab, [tokenizer.convert_tokens_to_ids("<|im_end|>")], 8,
                           torch.device("cpu"))
    so = StructuredOutputsParams(regex="[0-9]+")
    so._compiled = service.compile(so)
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert masker.masks([_req("bad", so, outputs=[letter])], lambda rid: None) is None
    assert "rejected token" in masker.take_errors()["bad"]
    # a dead end: a grammar compiled for a vocabulary in which nothing continues it (the runner's check, not
    # reachable through a byte-level vocabulary, which spells anything)
    info = xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2])
    dead = CompiledConstraint(key="dead", grammar_json=xgr.GrammarCompiler(info).compile_regex("ac").serialize_json())
    so_dead = StructuredOutputsParams(regex="ac")
    so_dead._compiled = dead
    masker = GrammarMasker(str(tiny_tokenizer_dir), 3, [2], 8, torch.device("cpu"))
    masker._grammars["dead"] = xgr.CompiledGrammar.deserialize_json(dead.grammar_json, info)
    mask, _ = masker.masks([_req("dead", so_dead, outputs=[0])], lambda rid: None)
    assert "dead end" in masker.take_errors()["dead"]
    assert mask.tolist() == [[-1]]            # its row samples freely: the scheduler drops that token anyway


def test_scheduler_ends_a_request_whose_grammar_died_and_frees_its_blocks():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                      CacheConfig(block_size=4, enable_prefix_caching=False), num_blocks=16)
    for rid in ("a", "b"):
        assert sched.add_request(Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=8), 0.0)) is None
    out = sched.schedule()
    outs = sched.update(out, RunnerOutput(sampled_token_ids={"a": 7, "b": 8}, errors={"a": "dead end"}))
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].finish_reason == FinishReason.ERROR and by_id["a"].error == "dead end"
    assert by_id["a"].error_status == 400 and by_id["a"].new_token_ids == []
    assert by_id["b"].new_token_ids == [8] and by_id["b"].finish_reason is None
    assert [r.request_id for r in sched.running] == ["b"]
    sched.abort(["b"])
    assert sched.kv_cache_manager.usage == 0.0


def test_serve_flags_are_checked_before_loading():
    from onecard.cli import ServeArgsError, build_serve_parser, check_parser_flags

    check_parser_flags(build_serve_parser().parse_args(
        ["--structured-outputs-config", '{"backend": "xgrammar"}', "--guided-decoding-backend", "auto"]))
    for argv in (["--guided-decoding-backend", "outlines"], ["--structured-outputs-config", "{bad"]):
        with pytest.raises(ServeArgsError, match="structured|outlines"):
            check_parser_flags(build_serve_parser().parse_args(argv))
