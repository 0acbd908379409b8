"""Layer-by-layer GPTQ of a Qwen3 / Qwen3-MoE HF checkpoint (GPTQModel's "true sequential" order), run
through onecard's own model (models/qwen3.py) on the reference kernels.

Contract: ``quantize_model(model_dir, out_dir, spec, calibration, ...)`` tokenizes the calibration text into
``num_samples`` windows of ``seq_len`` tokens, embeds them, and for every decoder layer in turn fills the
layer's declared weights (``weight_specs``) from the float checkpoint, then for each group of the model's
``sequential_modules`` (q/k/v, o, gate/up, down) reruns the layer with the earlier groups quantized,
records the group's inputs (experts: only the tokens the float router sends them, ``fused_moe.ref.expert_inputs``)
and quantizes it; the layer's output with every weight quantized is the next layer's input. Router gates,
norms, embeddings and lm_head stay float (fp16 on disk). ``method="rtn"`` skips calibration and rounds every
linear to nearest (the baseline). Writes the checkpoint via ``write_gptq_checkpoint``.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from onecard.kernels import dispatch as ops
from onecard.kernels.attention.metadata import AttentionMetadata
from onecard.kernels.fused_moe.ref import expert_inputs
from onecard.models.registry import get_model_class
from onecard.models.weights import ExpertsSpec, LinearSpec, Param, Spec
from onecard.quant.checkpoint import FloatCheckpoint, write_gptq_checkpoint
from onecard.quant.gptq import HessianAccumulator, gptq_quantize
from onecard.quant.quantizer import QuantSpec, quantize_rtn

log = logging.getLogger(__name__)

_SUPPORTED = ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM")


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


def layer_specs(model) -> dict[int, list[Spec]]:
    """Decoder layer -> its declared weights."""
    out: dict[int, list[Spec]] = {}
    for s in model.weight_specs():
        if s.layer is not None:
            out.setdefault(s.layer, []).append(s)
    return out


def _layer_modules(specs: list[Spec]) -> list[str]:
    """The quantized linears of one layer (checkpoint module names), in declaration order."""
    out: list[str] = []
    for s in specs:
        if isinstance(s, LinearSpec):
            out += s.modules
        elif isinstance(s, ExpertsSpec):
            out += [f"{s.prefix}.{e}.{p.name}" for e in range(s.num_experts) for p in s.projs]
    return out


def prefill_metadata(batch: int, seq_len: int, device: torch.device) -> AttentionMetadata:
    """``batch`` whole sequences of ``seq_len`` tokens, one cache block each (block b = sequence b)."""
    t = batch * seq_len
    return AttentionMetadata(
        slot_mapping=torch.arange(t, device=device),
        query_start_loc=torch.arange(0, t + 1, seq_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        block_table=torch.arange(batch, dtype=torch.int32, device=device).view(batch, 1),
        max_query_len=seq_len, max_seq_len=seq_len)


class CalibrationLayer:
    """Decoder layer ``i`` of the model with float weights from the checkpoint; its linears' current weights
    (float, then dequantized once quantized) and the Hessians recorded by forward pre-hooks."""

    def __init__(self, model, specs: list[Spec], ckpt: FloatCheckpoint, device: torch.device):
        self.model, self.layer, self.specs = model, model.layers[specs[0].layer], specs
        self.linears = [s for s in specs if isinstance(s, LinearSpec)]
        self.experts = [s for s in specs if isinstance(s, ExpertsSpec)]
        for p in specs:
            if isinstance(p, Param):
                setattr(p.owner, p.attr, ckpt.get(p.key, device))
        self.w: dict[str, torch.Tensor] = {}                                    # module -> [N, K]
        for n in _layer_modules(specs):
            if not ckpt.has(n + ".weight"):
                raise ValueError(f"expected weight {n}.weight is missing from the checkpoint.")
            self.w[n] = ckpt.get(n + ".weight", device)
        self.float_w = dict(self.w)
        for s in self.linears:
            if ckpt.has(s.modules[0] + ".bias"):
                s.linear.bias = torch.cat([ckpt.get(n + ".bias", device) for n in s.modules])
        self.acc: dict[str, HessianAccumulator] = {}
        self.record_experts = False
        attn = set(self.layer.self_attn.modules())
        self.attn_modules = {n for s in self.linears if s.linear in attn for n in s.modules}
        self.hooks = [s.linear.register_forward_pre_hook(self._hook(s.modules)) for s in self.linears]
        self.install()

    def _hook(self, modules: list[str]):
        def record(_module, args) -> None:
            for acc in {id(a): a for a in (self.acc.get(n) for n in modules) if a is not None}.values():
                acc.add(args[0])          # a fused Linear's modules share one input, so one Hessian
        return record

    def install(self) -> None:
        """The current weights into the model: fused Linears concatenated, experts stacked [E, K, N]."""
        for s in self.linears:
            s.linear.weight = torch.cat([self.w[n] for n in s.modules])
        for ex in self.experts:
            for p in ex.projs:
                w = [self.w[f"{ex.prefix}.{e}.{p.name}"].t() for e in range(ex.num_experts)]
                setattr(ex.owner, p.attr, torch.stack(w))

    def start(self, modules: list[str] | set[str], device: torch.device) -> None:
        """Record the inputs of ``modules`` in the next forwards (modules of one Linear share a Hessian)."""
        self.acc = {}
        self.record_experts = False
        modules = set(modules)
        for s in self.linears:
            mine = [n for n in s.modules if n in modules]
            if mine:
                acc = HessianAccumulator(s.linear.in_features, device)
                self.acc.update(dict.fromkeys(mine, acc))
        for ex in self.experts:
            for p in ex.projs:
                for e in range(ex.num_experts):
                    n = f"{ex.prefix}.{e}.{p.name}"
                    if n in modules:
                        self.acc[n] = HessianAccumulator(p.in_features, device)
                        self.record_experts = True

    @torch.no_grad()
    def attention(self, h: torch.Tensor, positions: torch.Tensor, kv, md: AttentionMetadata) -> torch.Tensor:
        """h [T, H] -> h + attn (the residual stream after attention)."""
        x, _ = ops.rms_norm(h, self.layer.input_layernorm, self.layer.eps)
        return h + self.layer.self_attn(x, positions, self.model.cos_sin, kv, md)

    @torch.no_grad()
    def mlp(self, h2: torch.Tensor, output: bool = True) -> torch.Tensor | None:
        """h2 [T, H] -> h2 + mlp: the layer's output (None when not ``output`` and the experts were recorded)."""
        hn, _ = ops.rms_norm(h2, self.layer.post_attention_layernorm, self.layer.eps)
        m = self.layer.mlp
        if self.record_experts:
            ex = self.experts[0]
            takes = {"w_gate": 0, "w_up": 0, "w_down": 1}          # fused_moe's contract: gate/up read x, down h
            for e, _, _, xe, mid in expert_inputs(hn, ops.moe_router(hn, m.gate), m.w_gate, m.w_up, m.top_k,
                                                  m.renormalize):
                for p in ex.projs:
                    acc = self.acc.get(f"{ex.prefix}.{e}.{p.name}")
                    if acc is not None:
                        acc.add((xe, mid)[takes[p.attr]])
            if not output:
                return None
        return h2 + m(hn)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv, md: AttentionMetadata) -> torch.Tensor:
        """h [T, H] -> the layer's output, recording what ``start`` asked."""
        return self.mlp(self.attention(h, positions, kv, md))

    def drop(self) -> None:
        for hk in self.hooks:
            hk.remove()
        for s in self.specs:
            if isinstance(s, Param):
                setattr(s.owner, s.attr, None)
            elif isinstance(s, LinearSpec):
                s.linear.weight = s.linear.bias = None
            else:
                for p in s.projs:
                    setattr(s.owner, p.attr, None)


def quantize_model(model_dir: Path, out_dir: Path, spec: QuantSpec, calibration: Path | None,
                   num_samples: int = 128, seq_len: int = 512, damp: float = 0.01, block_size: int = 128,
                   device: torch.device | str = "cpu", checkpoint_format: str = "gptq", method: str = "gptq",
                   batch_size: int = 8) -> dict[str, float]:
    """Quantize and write; returns per-linear relative output error on the calibration data (GPTQ only)."""
    device = torch.device(device)
    ckpt = FloatCheckpoint(model_dir)
    archs = ckpt.config.get("architectures") or [
        {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(ckpt.config.get("model_type"), "")]
    arch = next((a for a in archs if a in _SUPPORTED), None)
    if arch is None:
        raise ValueError(f"architectures {archs}: the quantizer supports {', '.join(_SUPPORTED)}.")
    model = get_model_class(arch)(ckpt.config, seq_len)                      # float: q/k/v and gate/up fused
    model.set_device(device, torch.float32)
    by_layer = layer_specs(model)
    packed: dict[str, dict[str, torch.Tensor]] = {}
    errors: dict[str, float] = {}
    t0 = time.time()

    if method == "rtn":
        for i in range(model.num_layers):
            for n in _layer_modules(by_layer[i]):
                if not ckpt.has(n + ".weight"):
                    raise ValueError(f"expected weight {n}.weight is missing from the checkpoint.")
                ql = quantize_rtn(ckpt.get(n + ".weight", device), spec.group_size, spec.sym, min_zero=1,
                                  bits=spec.bits)
                packed[n] = ql.disk_tensors(checkpoint_format)
        write_gptq_checkpoint(ckpt, out_dir, packed, spec, checkpoint_format, damp, method)
        return errors
    if calibration is None:
        raise ValueError("--calibration is required for GPTQ (use --rtn for round-to-nearest).")

    tokens = calibration_tokens(model_dir, calibration, num_samples, seq_len)    # [S, L]
    s_len = tokens.shape[1]
    log.info("calibration: %d samples x %d tokens", tokens.shape[0], s_len)
    embed = ckpt.get("model.embed_tokens.weight", device)
    batches = [b.to(device) for b in tokens.split(batch_size)]                   # [b, L] each
    hidden = [embed[b.reshape(-1)] for b in batches]                             # [b*L, H] each
    del embed
    mds = [prefill_metadata(b.shape[0], s_len, device) for b in batches]
    positions = [torch.arange(s_len, device=device).repeat(b.shape[0]) for b in batches]
    kv_shape = (batch_size, s_len, model.num_kv_heads, model.head_dim)           # block b = sequence b
    kv = (torch.zeros(kv_shape, device=device), torch.zeros(kv_shape, device=device))

    with ops.use_backend("ref"):
        for i in range(model.num_layers):
            layer = CalibrationLayer(model, by_layer[i], ckpt, device)
            modules = _layer_modules(by_layer[i])
            post: list[torch.Tensor | None] = [None] * len(hidden)           # h + attn per batch, while valid
            for group in model.sequential_modules:
                names = [n for n in modules if n.rsplit(".", 1)[1] in group]
                attn_group = any(n in layer.attn_modules for n in names)
                layer.start(names, device)
                for bi, (h, pos, md) in enumerate(zip(hidden, positions, mds)):
                    if attn_group or post[bi] is None:
                        post[bi] = layer.attention(h, pos, kv, md)
                    if not attn_group:
                        layer.mlp(post[bi], output=False)
                for n in names:
                    acc = layer.acc[n]
                    res = gptq_quantize(layer.float_w[n], acc.H, spec, damp, block_size)
                    wq = res.dequant.t().contiguous()                          # [N, K]
                    errors[n] = _relative_output_error(acc.H, layer.float_w[n], wq)
                    layer.w[n] = wq
                    packed[n] = res.disk_tensors(checkpoint_format)
                layer.start([], device)
                layer.install()
                if attn_group:
                    post = [None] * len(hidden)                                # attention's weights changed
            hidden = [layer.mlp(h2 if h2 is not None else layer.attention(h, pos, kv, md))
                      for h, h2, pos, md in zip(hidden, post, positions, mds)]
            layer.drop()
            log.info("layer %d/%d quantized (%.1fs); mean rel. output error %.4f", i + 1, model.num_layers,
                     time.time() - t0, _mean([errors[n] for n in modules]))
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
