"""Run by test_pre_ampere_engine.py in a process of its own (TRITON_INTERPRET, the capability and the backend are
read once per process): the bundled tiny coder through the real engine on the Triton kernels, greedy, two
prompts; prints JSON: each prompt's tokens, and how often each pre-sm80 path answered yes (the decisions are
wrapped to count, then answer as they do)."""
from __future__ import annotations

import json
import sys

import torch

from onecard import LLM, SamplingParams
from onecard.kernels import paths
from onecard.kernels.attention import sdpa

PROMPTS = [list(range(3, 43)), list(range(50, 70))]     # 40 and 20 tokens: both past the verify rows (> 16)


def main(model: str) -> None:
    seen = {"sdpa_sequences": 0, "moe_rows": 0, "dense_rows": 0}
    long_sequences, decode_rows, dense_rows = sdpa.long_sequences, paths.decode_rows, paths.dense_rows

    def count_long(md, cc):
        out = long_sequences(md, cc)
        seen["sdpa_sequences"] += len(out)
        return out

    def count(key, fn):
        def wrapped(n, cc):
            out = fn(n, cc)
            seen[key] += out > 0
            return out
        return wrapped

    sdpa.long_sequences = count_long
    paths.decode_rows, paths.dense_rows = count("moe_rows", decode_rows), count("dense_rows", dense_rows)
    llm = LLM(model, device="cpu", max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "seen": seen,
                      "capability": paths.capability(torch.device("cpu"))}))


if __name__ == "__main__":
    main(sys.argv[1])
