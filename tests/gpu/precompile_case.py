"""Worker for test_precompile_gpu.py (a fresh process, so the Triton cache and the in-memory JIT are
cold): start an engine on a tiny GPTQ-MoE checkpoint, run greedy requests, print JSON with the tokens and
the kernels the engine process JIT-compiled itself (cache misses).

Usage: TRITON_CACHE_DIR=... [ONECARD_PRECOMPILE=0] python tests/gpu/precompile_case.py CKPT_DIR [spec | long | slices]
(``spec``: with --speculative-config ngram k=4, so that the verify graphs are captured too; ``long``: 2,048
positions, so that the decode graphs' attention splits its KV (kernels/paths.split_kv) and launches the
split-KV reduce; ``slices``: the batch-1 MoE's expert stages in one launch, kernels/paths.BATCH1_MOE_SLICES)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton

MISSES: list[str] = []


def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
    if not cache_hit:
        MISSES.append(getattr(src, "name", str(src)))
        # what the JIT specialized it for (stderr: the test shows it when the check fails)
        print(f"miss {MISSES[-1]}: {getattr(src, 'signature', '')} {getattr(src, 'constexprs', '')} "
              f"{getattr(src, 'attrs', '')}", file=sys.stderr)


def main() -> None:
    triton.knobs.compilation.listener = listener
    from bench.gpu_checks import greedy  # the same engine set-up as the other GPU checks

    spec = {"method": "ngram", "num_speculative_tokens": 4} if sys.argv[2:3] == ["spec"] else None
    max_len = 256
    if sys.argv[2:3] == ["long"]:
        max_len = 2048
    if sys.argv[2:3] == ["slices"]:
        from onecard.kernels import paths
        paths.set_switch("batch1_moe_slices", True)
    tokens = greedy(Path(sys.argv[1]), "triton", "float16", eager=False, speculative=spec, max_model_len=max_len)
    print(json.dumps({"tokens": tokens, "misses": MISSES}))


if __name__ == "__main__":
    main()
