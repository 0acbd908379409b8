"""Structured-output overhead: grammar compile (cold / cached), mask fill per step, decode with and without a
tool-call schema on every request.

Usage (repo root):
  python bench/structured_overhead.py cpu  [OUT_DIR]         # compile times + mask fill per step (no GPU)
  python bench/structured_overhead.py gpu DIR [OUT_DIR]      # the above + decode bs1/bs16 with a tool schema
                                                             # on every request vs none (full-size checkpoint
                                                             # from `python bench/full_size.py build DIR`)
OUT_DIR defaults to $OUT (else .); results go to OUT_DIR/structured_overhead.json and are printed.

The full-size checkpoint has no tokenizer: the bundled tiny coder's (8,192 tokens) stands in, its vocabulary
padded to the model's 151,936 logits. The bitmask is full width (4,748 words a row), but xgrammar's fill cost
grows with the tokenizer's real vocabulary, so fill times for Qwen's 151k-token tokenizer will be higher.
The constrained requests use Qwen3-Coder's XML tool-call format for a `write_file(path, content)` tool (the
content string is unbounded, so a random-weight model stays inside the constraint for all 256 tokens).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = ROOT / "onecard" / "data" / "onecard-tiny-coder"
VOCAB = 151936
EOS = [151645, 151643]
TOOLS = [{"type": "function", "function": {"name": "write_file", "description": "Write a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "description": "file path"},
                                     "content": {"type": "string", "description": "file contents"},
                                     "mode": {"enum": ["w", "a"]}, "executable": {"type": "boolean"}},
    "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "run_tests", "parameters": {
        "type": "object", "properties": {"pattern": {"type": "string"}, "timeout": {"type": "integer",
                                                                                    "minimum": 1}},
        "required": ["pattern"]}}}]


def _constraint(fmt: str):
    from onecard.frontend.constraints import constraint_for_request

    return constraint_for_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "write_file"}},
                                  tool_format=fmt)


def compile_times(repeats: int = 5) -> dict:
    from onecard.frontend.grammar import GrammarService
    from onecard.sampling_params import StructuredOutputsParams
    from onecard.vocab import load_tokenizer

    tok = load_tokenizer(str(TINY))
    res: dict = {}
    t0 = time.perf_counter()
    svc = GrammarService(tok, VOCAB, EOS)
    svc._get_compiler()
    res["vocab_setup_ms"] = (time.perf_counter() - t0) * 1e3
    cases = {"tool_hermes": lambda: _constraint("hermes"), "tool_qwen3_coder": lambda: _constraint("qwen3_coder"),
             "json_schema": lambda: _as_rc(StructuredOutputsParams(json=TOOLS[0]["function"]["parameters"]))}
    for name, make in cases.items():
        cold, hit = [], []
        for _ in range(repeats):
            svc._cache.clear()
            rc = make()
            t0 = time.perf_counter()
            cc = svc.compile(rc.params, rc.param)
            cold.append(time.perf_counter() - t0)
            rc = make()
            t0 = time.perf_counter()
            svc.compile(rc.params, rc.param)
            hit.append(time.perf_counter() - t0)
        res[f"compile_{name}_cold_ms"] = statistics.median(cold) * 1e3
        res[f"compile_{name}_cached_ms"] = statistics.median(hit) * 1e3
        res[f"compile_{name}_serialized_kb"] = len(cc.grammar_json) / 1024
    return res


def _as_rc(params):
    from onecard.frontend.constraints import RequestConstraint

    return RequestConstraint(params, "structured_outputs")


def mask_fill(batch: int = 16, steps: int = 64) -> dict:
    """Host time of GrammarMasker.masks per step at ``batch`` constrained rows (CPU; token = first allowed)."""
    from onecard.core.request import Request
    from onecard.frontend.grammar import GrammarService
    from onecard.runner.structured import GrammarMasker
    from onecard.sampling_params import SamplingParams
    from onecard.vocab import load_tokenizer

    tok = load_tokenizer(str(TINY))
    svc = GrammarService(tok, VOCAB, EOS)
    rc = _constraint("qwen3_coder")
    so = rc.params
    so._compiled = svc.compile(so, rc.param)
    masker = GrammarMasker(str(TINY), VOCAB, EOS, batch, torch.device("cpu"))
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=steps + 1, structured_outputs=so), 0.0)
            for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        for r in reqs:
            r.num_output_placeholders = 1
        t0 = time.perf_counter()
        mask, _ = masker.masks(reqs, lambda rid: None)
        times.append(time.perf_counter() - t0)
        bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1     # [B, W, 32]
        allowed = bits.view(batch, -1)[:, :VOCAB]
        for i, r in enumerate(reqs):                                              # a random allowed token
            ids = torch.nonzero(allowed[i]).flatten()
            r.output_token_ids.append(int(ids[torch.randint(len(ids), (1,), generator=g)]))
    assert not masker.take_errors()
    return {f"mask_fill_bs{batch}_ms_per_step_median": statistics.median(times) * 1e3,
            f"mask_fill_bs{batch}_ms_per_step_p90": sorted(times)[int(0.9 * len(times))] * 1e3}


def decode(model_dir: str, tokens: int = 256, prompt_len: int = 512, **engine_kw) -> dict:
    from bench.full_size import _engine
    from onecard.frontend.grammar import GrammarService
    from onecard.protocol import EngineRequest
    from onecard.sampling_params import SamplingParams
    from onecard.vocab import load_tokenizer

    core, ready = _engine(model_dir, tokenizer=str(TINY), **engine_kw)
    cuda = torch.cuda.is_available()
    tok = load_tokenizer(str(TINY))
    svc = GrammarService(tok, core.runner.vocab_size, list(core.config.model.eos_token_ids))   # as the engine's
    rc = _constraint("qwen3_coder")
    so = rc.params
    so._compiled = svc.compile(so, rc.param)
    g = torch.Generator().manual_seed(1)
    res: dict = {"time_to_ready_s": ready}

    def run(bs: int, constrained: bool, tokens: int = tokens) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                            structured_outputs=so if constrained else None)
        for i in range(bs):
            prompt = torch.randint(0, min(8000, core.runner.vocab_size), (prompt_len,), generator=g).tolist()
            core.add_request(EngineRequest(f"r{time.time_ns()}-{i}", prompt, sp, time.monotonic(), []))
        first = last = None
        while core.has_unfinished():
            outs = core.step()
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if outs and first is None and all(o.new_token_ids for o in outs) and len(outs) == bs:
                first = now
            last = now
        return (last - first) / (tokens - 1)

    run(1, True, min(16, tokens))                        # warm-up: shapes, the grammar's first matcher
    masker = core.runner.grammar
    for bs in (1, 16):
        for constrained in (False, True):
            masker.fill_seconds = masker.rows_masked = masker.steps_masked = 0
            tp = sorted(run(bs, constrained) for _ in range(3))[1]
            key = f"decode_bs{bs}_{'tool_schema' if constrained else 'free'}"
            res[key + "_tpot_ms"] = tp * 1e3
            res[key + "_tok_s"] = bs / tp
            if constrained:
                res[key + "_masked_rows_per_step"] = masker.rows_masked / max(masker.steps_masked, 1)
                res[key + "_mask_host_ms_per_step"] = masker.fill_seconds / max(masker.steps_masked, 1) * 1e3
        res[f"decode_bs{bs}_overhead_pct"] = (res[f"decode_bs{bs}_tool_schema_tpot_ms"]
                                              / res[f"decode_bs{bs}_free_tpot_ms"] - 1) * 100
    return res


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("cpu", "gpu") or (argv[0] == "gpu" and len(argv) < 2):
        print(__doc__)
        return 2
    out_dir = Path(argv[2] if argv[0] == "gpu" and len(argv) > 2 else argv[1] if argv[0] == "cpu" and len(argv) > 1
                   else os.environ.get("OUT", "."))
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    res.update(compile_times())
    res.update(mask_fill(16))
    res.update(mask_fill(1))
    if argv[0] == "gpu":
        res.update(decode(argv[1]))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "structured_overhead.json").write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"{k:48s} {v:10.3f}" if isinstance(v, float) else f"{k:48s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
