#!/usr/bin/env python3
"""Held-out perplexity of the float, GPTQ and round-to-nearest onecard-tiny-coder checkpoints.

Usage: python scripts/eval_ppl.py --float DIR --gptq DIR [--rtn DIR] --split split.json [--json OUT]
       [--seq-len 512] [--max-tokens N] [--device cuda|cpu]

The held-out files are split.json's "heldout" list (never trained on, see scripts/train_tokenizer.py). With no
--rtn, an RTN checkpoint with the GPTQ checkpoint's bits/group_size/sym is written next to --gptq (rtn/).
Prints a table and writes JSON: {"float": {"ppl", "tokens"}, "gptq": ..., "rtn": ...,
"gptq_increase", "rtn_increase", "gptq_better_than_rtn"}. Quantized weights are dequantized exactly and run in
HF transformers' Qwen3-MoE (float32), so the figures measure the weights, not onecard's kernels.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from onecard.quant.calibrate import quantize_model
from onecard.quant.ppl import perplexity
from onecard.quant.quantizer import QuantSpec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--float", dest="float_dir", required=True)
    ap.add_argument("--gptq", required=True)
    ap.add_argument("--rtn", default=None)
    ap.add_argument("--split", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    split = json.loads(Path(args.split).read_text())
    root = Path(split["stdlib"])
    texts = [(root / f).read_text(encoding="utf-8") for f in split["heldout"]]
    rtn_dir = Path(args.rtn) if args.rtn else Path(args.gptq).parent / "rtn"
    if not args.rtn:
        q = json.loads((Path(args.gptq) / "quantize_config.json").read_text())
        spec = QuantSpec(bits=q["bits"], group_size=q["group_size"], sym=q["sym"], desc_act=False)
        quantize_model(Path(args.float_dir), rtn_dir, spec, None, method="rtn",
                       checkpoint_format=q.get("checkpoint_format", "gptq"))
    res: dict = {"heldout_files": len(texts), "seq_len": args.seq_len}
    for name, d in (("float", args.float_dir), ("gptq", args.gptq), ("rtn", rtn_dir)):
        ppl, n = perplexity(Path(d), texts, args.seq_len, args.device, args.max_tokens)
        res[name] = {"ppl": round(ppl, 4), "tokens": n}
    res["gptq_increase"] = round(res["gptq"]["ppl"] - res["float"]["ppl"], 4)
    res["rtn_increase"] = round(res["rtn"]["ppl"] - res["float"]["ppl"], 4)
    res["gptq_better_than_rtn"] = res["gptq_increase"] < res["rtn_increase"]
    print(f"held-out perplexity ({len(texts)} files, {res['float']['tokens']} tokens, seq_len {args.seq_len})")
    print(f"{'model':<8}{'ppl':>10}{'increase':>10}")
    for name in ("float", "gptq", "rtn"):
        inc = "" if name == "float" else f"{res[name + '_increase']:+.3f}"
        print(f"{name:<8}{res[name]['ppl']:>10.3f}{inc:>10}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
