#!/usr/bin/env python3
"""What an fp8 KV cache costs in quality on the bundled onecard-tiny-coder, through onecard's own engine (CPU).

Usage: python scripts/kv_dtype_quality.py [--kv auto float16 fp8_e5m2 fp8_e4m3] [--max-tokens N] [--json OUT]

- Perplexity on the held-out CPython stdlib files (scripts/train_tokenizer.make_split on this machine's stdlib:
  sha1(path) % buckets == 0, never trained on), tokenized and windowed as onecard/quant/ppl.py does
  (<|endoftext|> before each file, non-overlapping 512-token windows, exp of the mean next-token NLL), but
  computed by onecard's ModelRunner with the given --kv-cache-dtype: every window is one prefill whose
  attention reads K/V back from the cache in that format.
- Greedy text on 20 code prompts (64 tokens, LLM.generate) with each KV dtype against float16 KV: how many
  outputs are identical, and the mean fraction of tokens before the first difference.
The model computes in float32 on the CPU ("auto" KV = float32); float16 KV is the GPU's default format.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = [
    "def read_config(path):\n", "import os\nimport sys\n\n", "class Queue:\n    def __init__(self):\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(", "    for i in range(len(items)):\n",
    "def __repr__(self):\n        return ", "try:\n    import _thread\nexcept ImportError:\n",
    "def _check_closed(self):\n", "    if not isinstance(value, str):\n        raise TypeError(",
    "@property\ndef name(self):\n", "def main():\n    ", "    with open(filename, 'rb') as f:\n",
    "    def close(self):\n        \"\"\"", "__all__ = [", "def copy(self):\n    \"\"\"Return a shallow copy",
    "    except OSError as e:\n", "class Error(Exception):\n", "def encode(self, input, errors='strict'):\n",
    "    return self._", "if __name__ == '__main__':\n"]


def heldout_texts() -> tuple[list[str], list[str]]:
    from scripts.train_tokenizer import make_split, stdlib_root

    root = stdlib_root()
    files = make_split(root, None)["heldout"]
    return files, [(root / f).read_text(encoding="utf-8") for f in files]


@torch.inference_mode()
def engine_perplexity(model_dir: Path, kv: str, ids: torch.Tensor, seq_len: int) -> tuple[float, int]:
    from onecard.config import EngineArgs
    from onecard.kernels.attention.metadata import AttentionMetadata
    from onecard.runner.model_runner import ModelRunner

    cfg = EngineArgs(model=str(model_dir), device="cpu", kv_cache_dtype=kv, max_model_len=seq_len).create_config()
    runner = ModelRunner(cfg)
    bs = cfg.cache.block_size
    nblk = -(-seq_len // bs)
    runner.initialize_kv_cache(nblk + 1, log=False)
    total, count = 0.0, 0
    for i in range(0, ids.numel() - 1, seq_len):
        w = ids[i:i + seq_len]
        n = w.numel()
        if n < 2:
            continue
        pos = torch.arange(n)
        md = AttentionMetadata(
            slot_mapping=pos + bs, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            block_table=torch.arange(1, nblk + 1, dtype=torch.int32)[None], max_query_len=n, max_seq_len=n)
        hidden = runner.model(w, pos, runner.kv_caches, md)                  # [n, H]
        logits = runner.model.compute_logits(hidden)                         # [n, V] fp32
        total += float(torch.nn.functional.cross_entropy(logits[:-1], w[1:], reduction="sum"))
        count += n - 1
    return math.exp(total / count), count


def greedy(model_dir: Path, kv: str, max_tokens: int) -> list[list[int]]:
    from onecard import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", kv_cache_dtype=kv, max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(k / max(1, len(y)))
    return {"identical": same, "prompts": len(a), "mean_prefix_fraction": sum(prefix) / len(prefix)}


def main(argv: list[str] | None = None) -> int:
    from onecard.hub.resolve import default_model_path
    from onecard.quant.ppl import token_stream

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", nargs="+", default=["auto", "float16", "fp8_e5m2", "fp8_e4m3"])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=None, help="cut the held-out stream (smoke runs)")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--skip-greedy", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    model_dir = default_model_path()
    files, texts = heldout_texts()
    ids = token_stream(model_dir, texts)
    if a.max_tokens:
        ids = ids[:a.max_tokens]
    res: dict = {"model": "onecard-tiny-coder", "heldout_files": len(files), "seq_len": a.seq_len,
                 "python": sys.version.split()[0], "threads": torch.get_num_threads(), "ppl": {}, "greedy": {}}
    base = None
    for kv in [] if a.skip_ppl else a.kv:
        t0 = time.perf_counter()
        ppl, n = engine_perplexity(model_dir, kv, ids, a.seq_len)
        res["ppl"][kv] = {"ppl": round(ppl, 4), "tokens": n, "seconds": round(time.perf_counter() - t0, 1)}
        print(f"perplexity  kv {kv:<9} {ppl:9.4f} over {n} tokens ({time.perf_counter() - t0:.0f} s)", flush=True)
    toks = {} if a.skip_greedy else {kv: greedy(model_dir, kv, a.gen_tokens) for kv in a.kv}
    base = toks.get("float16") or toks.get(a.kv[0])
    for kv, kv_toks in toks.items():
        res["greedy"][kv] = agreement(kv_toks, base)
        print(f"greedy      kv {kv:<9} vs float16: {res['greedy'][kv]}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
