"""Perplexity of a float or GPTQ checkpoint on a text, with HF transformers' own model classes.

Contract: ``perplexity(model_dir, texts, seq_len=512, device="cpu", max_tokens=None) -> (ppl, n_tokens)``.
Each text is tokenized with the checkpoint's tokenizer and prefixed with <|endoftext|> (when the vocabulary
has it, so the first real token is predicted too); texts are joined into one stream and cut into
non-overlapping windows of ``seq_len``; the figure is exp(mean next-token NLL) over every predicted token.
A GPTQ checkpoint is dequantized exactly (documented unpacking) into a temporary float checkpoint first, so
this measures the quantized weights independently of onecard's kernels.
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch

from onecard.quant.checkpoint import dequantize_checkpoint


def is_gptq(model_dir: Path) -> bool:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(cfg.get("quantization_config"))


def token_stream(model_dir: Path, texts: list[str]) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for t in texts:
        if isinstance(eot, int) and eot != tok.unk_token_id:
            ids.append(eot)
        ids.extend(tok(t, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def stream_nll(model, ids: torch.Tensor, seq_len: int, device: torch.device, batch: int = 16) -> tuple[float, int]:
    """Sum of next-token NLL over non-overlapping windows (the last one may be short)."""
    windows = [ids[i:i + seq_len] for i in range(0, ids.numel() - 1, seq_len)]
    windows = [w for w in windows if w.numel() >= 2]
    total, count = 0.0, 0
    full = [w for w in windows if w.numel() == seq_len]
    rest = [w for w in windows if w.numel() != seq_len]
    groups = [torch.stack(full[i:i + batch]) for i in range(0, len(full), batch)] + [w.view(1, -1) for w in rest]
    for x in groups:
        x = x.to(device)
        logits = model(input_ids=x).logits.float()                          # [B, L, V]
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                x[:, 1:].reshape(-1), reduction="sum")
        total += float(nll)
        count += x[:, 1:].numel()
    return total, count


def perplexity(model_dir: Path, texts: list[str], seq_len: int = 512, device: str | torch.device = "cpu",
               max_tokens: int | None = None) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    device = torch.device(device)
    ids = token_stream(model_dir, texts)
    if max_tokens:
        ids = ids[:max_tokens]
    with tempfile.TemporaryDirectory() as tmp:
        src = dequantize_checkpoint(model_dir, Path(tmp) / "float") if is_gptq(model_dir) else model_dir
        try:    # eager experts: float32 everywhere (grouped_mm kernels are not built for every dtype/device)
            model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, experts_implementation="eager")
        except (TypeError, ValueError):
            model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        model = model.to(device).eval()
        total, count = stream_nll(model, ids, seq_len, device)
    return math.exp(total / max(1, count)), count
