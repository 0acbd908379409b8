"""Run by test_pre_ampere_engine.py in a process of its own (TRITON_INTERPRET, the capability and the backend are
read once per process): the bundled tiny coder through the real engine on the Triton kernels, greedy, in the
SCENARIOS; prints JSON: each scenario's tokens per prompt, and how often each pre-sm80 path answered yes (the
decisions are wrapped to count, then answer as they do)."""
from __future__ import annotations

import json
import sys

import torch

from onecard import LLM, SamplingParams
from onecard.kernels import paths
from onecard.kernels.attention import sdpa

# (prompts, max_num_batched_tokens, max_tokens): a 40-token prompt in chunks of 22 (SDPA) and 18, its second chunk
# over the first one's cached KV beside the whole 4-token prompt (one launch: SDPA for the chunk, the kernel for the
# 4 rows), then a batch-2 decode step (both row steps). Three steps on purpose: every kernel runs under the
# interpreter, and a prefill step's MoE (sorted16) costs ~40 s there.
SCENARIOS = [([list(range(100, 140)), list(range(50, 54))], 22, 2)]


def main(model: str) -> None:
    seen = {"sdpa_sequences": 0, "sdpa_over_prefix": 0, "split_launches": 0, "moe_rows": 0, "dense_rows": 0}
    long_sequences, decode_rows, dense_rows = sdpa.long_sequences, paths.decode_rows, paths.dense_rows

    def count_long(md, cc):
        out = long_sequences(md, cc)
        seen["sdpa_sequences"] += len(out)
        qsl, lens = md.host_query_start_loc, md.host_seq_lens
        seen["sdpa_over_prefix"] += sum(int(lens[i]) > int(qsl[i + 1] - qsl[i]) for i in out)
        seen["split_launches"] += 0 < len(out) < md.num_seqs                 # SDPA and the kernel in one launch
        return out

    def count(key, fn):
        def wrapped(n, cc):
            out = fn(n, cc)
            seen[key] += out > 0
            return out
        return wrapped

    sdpa.long_sequences = count_long
    paths.decode_rows, paths.dense_rows = count("moe_rows", decode_rows), count("dense_rows", dense_rows)
    tokens = []
    for prompts, budget, max_tokens in SCENARIOS:
        llm = LLM(model, device="cpu", max_model_len=256, max_num_batched_tokens=budget)
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    print(json.dumps({"tokens": tokens, "seen": seen, "capability": paths.capability(torch.device("cpu"))}))


if __name__ == "__main__":
    main(sys.argv[1])
