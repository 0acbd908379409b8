"""Layer-by-layer GPTQ of a Qwen3 / Qwen3-MoE HF checkpoint (GPTQModel's "true sequential" order).

Contract: ``quantize_model(model_dir, out_dir, spec, calibration, ...)`` tokenizes the calibration text into
``num_samples`` windows of ``seq_len`` tokens, embeds them, and for every decoder layer in turn
  1. records the inputs of q/k/v_proj, quantizes them;
  2. reruns attention with the quantized q/k/v, records o_proj's input, quantizes it;
  3. reruns attention fully quantized, records each expert's gate/up inputs (only the tokens routed to
     that expert by the float router), quantizes them;
  4. records each expert's down_proj input (from the quantized gate/up), quantizes it;
  5. computes the layer output with every weight quantized: that is the next layer's input.
Router gates, norms, embeddings and lm_head stay float (fp16 on disk). ``method="rtn"`` skips calibration
and rounds every linear to nearest (the baseline). Writes the checkpoint via ``write_gptq_checkpoint``.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from onecard.quant.checkpoint import FloatCheckpoint, write_gptq_checkpoint
from onecard.quant.gptq import HessianAccumulator, gptq_quantize
from onecard.quant.quantizer import QuantSpec, quantize_rtn
from onecard.quant.qwen3_forward import ArchInfo, attention_parts, dense_mlp, moe_parts, rms_norm, rotary

log = logging.getLogger(__name__)

_SUPPORTED = ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM")


def layer_linears(arch: ArchInfo, ckpt: FloatCheckpoint, i: int) -> list[list[str]]:
    """The quantized linears of layer i, grouped by the stage that records their inputs."""
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    stages = [[attn + n for n in ("q_proj", "k_proj", "v_proj")], [attn + "o_proj"]]
    if arch.moe_layers[i]:
        ex = [f"{p}mlp.experts.{e}." for e in range(arch.num_experts)]
        stages += [[e + n for e in ex for n in ("gate_proj", "up_proj")], [e + "down_proj" for e in ex]]
    else:
        stages += [[p + "mlp.gate_proj", p + "mlp.up_proj"], [p + "mlp.down_proj"]]
    for names in stages:
        for n in names:
            if not ckpt.has(n + ".weight"):
                raise ValueError(f"expected weight {n}.weight is missing from the checkpoint.")
    return stages


def read_calibration(path: Path, max_chars: int) -> str:
    """A text file, a .jsonl of {"text": ...}, or a folder of .py files (sorted, concatenated)."""
    path = Path(path)
    if path.is_dir():
        parts, total = [], 0
        for f in sorted(path.rglob("*.py")):
            t = f.read_text(encoding="utf-8", errors="replace")
            parts.append(t)
            total += len(t)
            if total >= max_chars:
                break
        text = "\n".join(parts)
    elif path.suffix == ".jsonl":
        text = "\n".join(json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip())
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"calibration data {path} is empty.")
    return text[:max_chars]


def calibration_tokens(model_dir: Path, calibration: Path, num_samples: int, seq_len: int) -> torch.Tensor:
    """int64 [S, L] windows at evenly spaced offsets of the tokenized calibration text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = read_calibration(calibration, max_chars=num_samples * seq_len * 8)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if ids.numel() < seq_len:
        log.warning("calibration text has only %d tokens (< seq_len %d): one short sample", ids.numel(), seq_len)
        return ids.view(1, -1)
    n_windows = ids.numel() - seq_len + 1
    n = min(num_samples, max(1, ids.numel() // seq_len))
    if n < num_samples:
        log.warning("calibration text gives %d non-overlapping windows of %d tokens (asked %d)", n, seq_len,
                    num_samples)
    starts = torch.linspace(0, n_windows - 1, n).long()
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


class _LayerState:
    """Float and quantized weights of the current layer, and the Hessians being recorded."""

    def __init__(self, ckpt: FloatCheckpoint, device: torch.device) -> None:
        self.ckpt, self.device = ckpt, device
        self.float_w: dict[str, torch.Tensor] = {}
        self.quant_w: dict[str, torch.Tensor] = {}
        self.bias: dict[str, torch.Tensor | None] = {}
        self.acc: dict[str, HessianAccumulator] = {}

    def load(self, names: list[str]) -> None:
        for n in names:
            self.float_w[n] = self.ckpt.get(n + ".weight", self.device)
            self.bias[n] = self.ckpt.get(n + ".bias", self.device) if self.ckpt.has(n + ".bias") else None

    def proj(self, name: str, x: torch.Tensor) -> torch.Tensor:
        acc = self.acc.get(name)
        if acc is not None:
            acc.add(x)
        w = self.quant_w.get(name, self.float_w[name])                       # [N, K]
        y = x.float() @ w.t()
        b = self.bias[name]
        return y if b is None else y + b


def quantize_model(model_dir: Path, out_dir: Path, spec: QuantSpec, calibration: Path | None,
                   num_samples: int = 128, seq_len: int = 512, damp: float = 0.01, block_size: int = 128,
                   device: torch.device | str = "cpu", checkpoint_format: str = "gptq", method: str = "gptq",
                   batch_size: int = 8) -> dict[str, float]:
    """Quantize and write; returns per-linear relative output error on the calibration data (GPTQ only)."""
    device = torch.device(device)
    ckpt = FloatCheckpoint(model_dir)
    archs = ckpt.config.get("architectures") or [
        {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(ckpt.config.get("model_type"), "")]
    if not any(a in _SUPPORTED for a in archs):
        raise ValueError(f"architectures {archs}: the quantizer supports {', '.join(_SUPPORTED)}.")
    arch = ArchInfo.from_config(ckpt.config)
    packed: dict[str, dict[str, torch.Tensor]] = {}
    errors: dict[str, float] = {}
    t0 = time.time()

    if method == "rtn":
        for i in range(arch.num_layers):
            for names in layer_linears(arch, ckpt, i):
                for n in names:
                    ql = quantize_rtn(ckpt.get(n + ".weight", device), spec.group_size, spec.sym, min_zero=1,
                                      bits=spec.bits)
                    packed[n] = ql.disk_tensors(checkpoint_format)
        write_gptq_checkpoint(ckpt, out_dir, packed, spec, checkpoint_format, damp, method)
        return errors
    if calibration is None:
        raise ValueError("--calibration is required for GPTQ (use --rtn for round-to-nearest).")

    tokens = calibration_tokens(model_dir, calibration, num_samples, seq_len)    # [S, L]
    log.info("calibration: %d samples x %d tokens", tokens.shape[0], tokens.shape[1])
    embed = ckpt.get("model.embed_tokens.weight", device)
    hidden = [embed[b.to(device)] for b in tokens.split(batch_size)]             # list of [b, L, H]
    del embed
    cos, sin = rotary(arch, tokens.shape[1], device)

    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        ln1 = ckpt.get(p + "input_layernorm.weight", device)
        ln2 = ckpt.get(p + "post_attention_layernorm.weight", device)
        small = {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight", p + "mlp.gate.weight"}
        w = {k: ckpt.get(k, device) for k in small if ckpt.has(k)}
        attn_p, mlp_p = p + "self_attn.", p + "mlp."
        st = _LayerState(ckpt, device)
        stages = layer_linears(arch, ckpt, i)
        for names in stages:
            st.load(names)

        def run_mlp(x: torch.Tensor, stage: str) -> torch.Tensor | None:
            if arch.moe_layers[i]:
                return moe_parts(arch, w, mlp_p, x, st.proj, stage)
            return dense_mlp(mlp_p, x, st.proj, stage)

        post_attn: list[torch.Tensor] = []
        for s, names in enumerate(stages):
            st.acc = {n: HessianAccumulator(st.float_w[n].shape[1], device) for n in names}
            with torch.no_grad():
                for bi, h in enumerate(hidden):
                    if s == 0:
                        attention_parts(arch, w, attn_p, rms_norm(h, ln1, arch.eps), cos, sin, st.proj, "qkv")
                    elif s == 1:
                        attention_parts(arch, w, attn_p, rms_norm(h, ln1, arch.eps), cos, sin, st.proj, "all")
                    elif s == 2:
                        h2 = h + attention_parts(arch, w, attn_p, rms_norm(h, ln1, arch.eps), cos, sin,
                                                 st.proj, "all")
                        post_attn.append(h2)
                        run_mlp(rms_norm(h2, ln2, arch.eps), "gate_up")
                    else:
                        run_mlp(rms_norm(post_attn[bi], ln2, arch.eps), "all")
            for n in names:
                acc = st.acc[n]
                res = gptq_quantize(st.float_w[n], acc.H, spec, damp, block_size)
                wq = res.dequant.t().contiguous()                          # [N, K]
                errors[n] = _relative_output_error(acc.H, st.float_w[n], wq)
                st.quant_w[n] = wq
                packed[n] = res.disk_tensors(checkpoint_format)
            st.acc = {}
        with torch.no_grad():
            hidden = [h2 + run_mlp(rms_norm(h2, ln2, arch.eps), "all") for h2 in post_attn]
        log.info("layer %d/%d quantized (%.1fs); mean rel. output error %.4f", i + 1, arch.num_layers,
                 time.time() - t0, _mean([errors[n] for names in stages for n in names]))
    write_gptq_checkpoint(ckpt, out_dir, packed, spec, checkpoint_format, damp, method)
    return errors


def _relative_output_error(H: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    """||X (Wq - W)^T||^2 / ||X W^T||^2 through H = 2/n X^T X (no activations kept)."""
    if not bool(torch.any(H.diag() > 0)):
        return 0.0
    d = wq - w                                                               # [N, K]
    num = torch.einsum("nk,kj,nj->", d, H, d)
    den = torch.einsum("nk,kj,nj->", w, H, w)
    return float(num / den.clamp_min(1e-30))


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))
