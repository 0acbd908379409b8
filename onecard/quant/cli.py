"""`onecard quantize MODEL_DIR OUT_DIR ...`: GPTQ-quantize a float Qwen3 / Qwen3-MoE checkpoint to 4 bits.

Contract: ``main(argv) -> int`` (0 written, 2 bad arguments or input; see ``build_parser``) runs
quant/calibrate.quantize_model, which drives quant/gptq.py per layer. Also ``python -m onecard.quant.cli``.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from onecard.config import ConfigError
from onecard.quant.calibrate import quantize_model
from onecard.quant.quantizer import QuantSpec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onecard quantize",
                                description="GPTQ-quantize a Hugging Face Qwen3 / Qwen3-MoE checkpoint to 4 bits "
                                            "in the GPTQModel/AutoGPTQ format.")
    p.add_argument("model_dir", help="float HF checkpoint directory (config.json, safetensors, tokenizer)")
    p.add_argument("out_dir", help="where the GPTQ checkpoint is written")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128, help="-1 = one group per column")
    p.add_argument("--desc-act", action="store_true", help="act-order: quantize columns by decreasing diag(H)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=True)
    sym.add_argument("--asym", dest="sym", action="store_false")
    p.add_argument("--calibration", required=True,
                   help="calibration text: a file (.txt/.py/.jsonl with a 'text' field) or a folder of .py files")
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--damp", type=float, default=0.01, help="damping as a fraction of mean(diag(H))")
    p.add_argument("--block-size", type=int, default=128, help="lazy-batch block size")
    p.add_argument("--checkpoint-format", choices=["gptq", "gptq_v2"], default="gptq",
                   help="gptq = v1 (zeros - 1, GPTQModel's default), gptq_v2 = true zeros")
    p.add_argument("--rtn", action="store_true", help="round-to-nearest instead of GPTQ (for comparison)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.bits != 4:
        print(f"error: --bits {args.bits} is not supported; onecard's kernels run 4-bit GPTQ (use --bits 4).")
        return 2
    if args.group_size not in (-1,) and (args.group_size <= 0 or args.group_size % 8):
        print(f"error: --group-size {args.group_size}: use -1 or a positive multiple of 8 (e.g. 128).")
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = QuantSpec(bits=args.bits, group_size=args.group_size, sym=args.sym, desc_act=args.desc_act)
    try:
        quantize_model(Path(args.model_dir), Path(args.out_dir), spec, calibration=Path(args.calibration),
                       num_samples=args.num_samples, seq_len=args.seq_len, damp=args.damp,
                       block_size=args.block_size, device=torch.device(device),
                       checkpoint_format=args.checkpoint_format, method="rtn" if args.rtn else "gptq")
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}")
        return 2
    print(f"wrote {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
