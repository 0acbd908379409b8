#!/usr/bin/env python3
"""Pretrain onecard-tiny-coder: a small Qwen3MoeForCausalLM on the CPython standard library.

Usage: python scripts/train_tiny.py BUILD_DIR [--minutes 5] [--max-steps N] [--device cuda|cpu] ...

Reads BUILD_DIR/tokenizer and BUILD_DIR/split.json (from scripts/train_tokenizer.py) and writes the float
checkpoint to BUILD_DIR/float (save_pretrained, fp32, generation_config with eos = <|im_end|> and
<|endoftext|>, tokenizer files) plus BUILD_DIR/train_log.json. The corpus is every training file as plain code
and, for functions with a docstring, a chat sample
  <|im_start|>user\\nWrite a Python function `sig` that <docstring summary>.<|im_end|>\\n
  <|im_start|>assistant\\n[<think>\\n\\n</think>\\n\\n]```python\\n<source>\\n```<|im_end|>
so that the model picks up the chat format. Documents are joined with <|endoftext|> into one stream and
trained on random windows (next-token loss + the router's load-balancing loss), AdamW, bf16 autocast on CUDA,
linear warm-up then cosine decay over the wall-clock budget (or --max-steps, whichever ends first).
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import random
import time
from pathlib import Path

import torch

# 4 layers untied: the 4-bit checkpoint is ~16.3 MB (fp16 embed + lm_head 8.4 MB, 1.8 MB per layer), under
# both the 20 MB budget and the 16 MiB a single file may have when fetched from the build machine
ARCH_DEFAULTS = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=4, moe_inter=256)


def chat_samples(source: str, rng: random.Random, max_chars: int = 1500) -> list[str]:
    """Instruction/answer pairs from the documented functions of one file."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno is None:
            continue
        # slicing lines (not ast.get_source_segment, which re-splits the file per call: quadratic)
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        body = lines[first - 1:node.end_lineno]
        ind = node.col_offset
        # methods: dedent so the answer is a top-level function
        code = "\n".join(line[ind:] if line[:ind].isspace() or not line[:ind] else line for line in body)
        if len(code) > max_chars:
            continue
        summary = doc.strip().splitlines()[0].strip().rstrip(".")
        if not summary:
            continue
        sig = f"{node.name}({ast.unparse(node.args)})"
        think = "<think>\n\n</think>\n\n" if rng.random() < 0.5 else ""
        out.append(f"<|im_start|>user\nWrite a Python function `{sig}` that {summary[0].lower() + summary[1:]}."
                   f"<|im_end|>\n<|im_start|>assistant\n{think}```python\n{code}\n```<|im_end|>\n")
    return out


def build_stream(build: Path, tok, rng: random.Random) -> tuple[torch.Tensor, dict]:
    split = json.loads((build / "split.json").read_text())
    root = Path(split["stdlib"])
    docs: list[str] = []
    n_chat = 0
    for rel in split["train"]:
        text = (root / rel).read_text(encoding="utf-8")
        docs.append(text)
        chats = chat_samples(text, rng)
        n_chat += len(chats)
        docs.extend(chats)
    rng.shuffle(docs)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    enc = tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False)
    ids: list[int] = []
    for e in enc:
        ids.extend(e.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32), {"files": len(split["train"]), "chat_samples": n_chat,
                                                  "tokens": len(ids)}


def make_model(tok, args: argparse.Namespace):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_inter, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, num_experts=args.experts,
        num_experts_per_tok=args.top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=args.max_position, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.01,
        bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    if args.experts_impl is None:
        return Qwen3MoeForCausalLM._from_config(cfg)
    try:
        return Qwen3MoeForCausalLM._from_config(cfg, experts_implementation=args.experts_impl)
    except TypeError:     # older transformers: no such keyword
        cfg._experts_implementation = args.experts_impl
        return Qwen3MoeForCausalLM._from_config(cfg)


def make_optimizer(model, args: argparse.Namespace, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                             fused=device.type == "cuda")


def lr_at(progress: float, step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build_dir")
    ap.add_argument("--minutes", type=float, default=5.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-position", type=int, default=4096)
    ap.add_argument("--experts-impl", default=None, help="HF experts implementation (default: HF's choice)")
    for k, v in ARCH_DEFAULTS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer, GenerationConfig

    build = Path(args.build_dir)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tok = AutoTokenizer.from_pretrained(str(build / "tokenizer"))
    t0 = time.time()
    stream, info = build_stream(build, tok, rng)
    print(f"data: {info} ({time.time() - t0:.1f}s)", flush=True)
    device = torch.device(args.device)
    model = make_model(tok, args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters, experts impl "
          f"{getattr(model.config, '_experts_implementation', '?')}", flush=True)
    opt = make_optimizer(model, args, device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    gen = torch.Generator().manual_seed(args.seed)
    n_windows = stream.numel() - args.seq_len
    budget = args.minutes * 60.0
    log: list[dict] = []
    step, t_train = 0, time.time()
    model.train()
    while True:
        elapsed = time.time() - t_train
        progress = elapsed / budget if budget > 0 else 1.0
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        if progress >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        starts = torch.randint(0, n_windows, (args.batch_size,), generator=gen)
        batch = torch.stack([stream[s:s + args.seq_len] for s in starts.tolist()]).long().to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, step, args)
        try:
            with amp:
                out = model(input_ids=batch, labels=batch)        # HF shifts the labels itself
            loss = out.loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except (RuntimeError, NotImplementedError) as e:
            if step > 0 or args.experts_impl == "eager":
                raise
            # grouped_mm (HF's default experts kernel) is not available everywhere: fall back once to eager
            print(f"experts implementation failed on the first step ({e}); retrying with eager", flush=True)
            args.experts_impl = "eager"
            state = model.state_dict()
            model = make_model(tok, args).to(device)
            model.load_state_dict(state)
            model.train()
            opt = make_optimizer(model, args, device)
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step <= 3:
            aux = float(out.aux_loss.detach()) if out.aux_loss is not None else 0.0
            rec = {"step": step, "loss": round(loss.item(), 4),
                   "lm_loss": round(loss.item() - model.config.router_aux_loss_coef * aux, 4),
                   "lr": opt.param_groups[0]["lr"], "elapsed_s": round(time.time() - t_train, 1)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
    print(f"trained {step} steps, {step * args.batch_size * args.seq_len / 1e6:.1f} M tokens, "
          f"{time.time() - t_train:.0f}s", flush=True)

    model.config.output_router_logits = False
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), do_sample=True, temperature=0.7, top_p=0.8,
        top_k=20)
    out_dir = build / "float"
    model.float().save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    (build / "train_log.json").write_text(json.dumps({"args": vars(args), "data": info, "params": n_params,
                                                      "steps": step, "log": log}, indent=1) + "\n")
    print(f"saved {out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
