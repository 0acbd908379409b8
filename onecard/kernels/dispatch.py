"""Pick a kernel backend per device and call it. The op signatures here ARE the contract.

Backends: "ref" (plain PyTorch, any device) and "triton" (CUDA, or CPU under TRITON_INTERPRET=1).
"auto" = triton on CUDA, ref elsewhere. Which Triton/cuBLAS path an op takes for a shape and a capability
is kernels/paths.py's table; ``init_paths(device)`` decides what depends on the device at start-up. ``use_backend("ref")`` is a context manager for tests; the
runner sets the process default once from ``Env.kernel_backend`` with ``set_default_backend``.

Ops (all tensors on one device; "T" = flattened tokens):
  w4a16_gemm(x[M,K], w: GPTQWeight, bias[N]|None) -> [M,N] in x.dtype
  fused_moe(x[T,H], router_logits[T,E], w_gate, w_up, w_down: MoEWeight, top_k, renormalize) -> [T,H]
      router: softmax (fp32) -> top-k -> renormalise if `renormalize`; out = sum_k p_k * down(silu(gate) * up)
      float MoEWeight layout [E, K, N]: w_gate/w_up [E, H, I], w_down [E, I, H]
  moe_router(x[T,H], weight[E,H]) -> router_logits[T,E] in x.dtype  (= F.linear(x, weight))
  norm_moe(x[T,H], residual[T,H]|None, norm_weight[H], eps, gate[E,H], w_gate, w_up, w_down, top_k, renormalize)
      -> (out[T,H], residual_out[T,H]): rms_norm, then fused_moe(h, moe_router(h, gate), ...); out in the model
      dtype or float32 (the Triton batch-1 path: the next rms_norm takes it as x). folded=FoldedRoute|None (keyword,
      last): attention_block's hand-over (fused_moe/router_fold.py); a path that cannot use it ignores it
  store_kv(k[T,Hkv,D], v[T,Hkv,D], k_cache[NB,BS,Hkv,D], v_cache, slot_mapping[T], k_scale=1.0, v_scale=1.0)
      -> None (in place; -1 skipped). The cache's dtype is its format: the model dtype, or torch.float8_e5m2 /
      float8_e4m3fn for an fp8 cache (stored = value / scale, see onecard/kv_dtype.py and attention/fp8.py)
  paged_attention(q[T,Hq,D], k_cache, v_cache, md: AttentionMetadata, scale, k_scale=1.0, v_scale=1.0)
      -> [T,Hq,D]  (causal, GQA; an fp8 cache is read as stored x k_scale / v_scale). With md's host copies
      (eager steps) the Triton backend sends prefill chunks to PyTorch's SDPA below sm80 (attention/sdpa.py)
  kv_touch(k_cache, v_cache, md, max_positions, out=None, evict_last=True)
      -> fp32 [ceil(max_positions / KV_PREFETCH_CHUNK)]: reads sequence 0's K and V rows below
      min(seq_lens[0], max_positions) (model-dtype caches) and returns each chunk's sum: on the Triton backend
      with eviction priority evict_last, the batch-1 read of the next layer's KV into L2
      (paths.batch1_kv_prefetch, layers/kv_prefetch.py)
  rms_norm(x[T,H], weight[H], eps, residual[T,H]|None) -> (out[T,H], residual_out[T,H])
      residual None: residual_out = x; else residual_out = x + residual; out = norm(residual_out) * weight
      (statistics in fp32; outputs in residual's dtype, x's without one; x may be fp32 with a residual)
  qk_norm_rope(q[T,Hq,D], k[T,Hkv,D], q_weight[D], k_weight[D], positions[T], cos_sin_cache[P,D], eps)
      -> (q_out, k_out): per-head RMSNorm then neox RoPE; cos_sin_cache fp32 = cat(cos[P,D/2], sin[P,D/2])
  qk_norm_rope_store(q, k, v[T,Hkv,D], q_weight, k_weight, positions, cos_sin_cache, eps, k_cache, v_cache,
      slot_mapping, k_scale=1.0, v_scale=1.0) -> q_out: qk_norm_rope, then store_kv(k_out, v, ...) (one launch
      on the Triton backend)
  norm_qkv_rope_store(x[T,H], residual[T,H]|None, norm_weight[H], eps, w, bias[N]|None, q_weight, k_weight,
      positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> (q_out[T,Hq,D],
      residual_out[T,H]): rms_norm, the fused q | k | v projection w (GPTQWeight, or float [N, H]), then
      qk_norm_rope_store (attn_in/ref.py), each step as dispatched
  attention_block(x[T,H], residual[T,H]|None, norm_weight[H], eps, w_qkv, b_qkv[N]|None, q_weight, k_weight,
      positions, cos_sin_cache, k_cache, v_cache, md, scale, w_o, b_o[H]|None, k_scale=1.0, v_scale=1.0)
      -> (out[T,H], residual_out[T,H]): norm_qkv_rope_store, paged_attention, the o projection w_o (attn_in/ref.py);
      out in the model dtype, or fp32 on the Triton batch-1 path with accumulating GEMVs (paths.batch1_accumulate;
      the next rms_norm / norm_moe takes it as x). router_fold=RouterFold|None (keyword, last): given, the call
      returns (out, residual_out, FoldedRoute | None): the folded router's sums for norm_moe where the Triton
      batch-1 path computed them (paths.batch1_router_fold), else None
  silu_and_mul(x[T,2I]) -> [T,I]   (silu(x[:, :I]) * x[:, I:])
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator

import torch

from onecard.kernels import paths

_OPS = {
    "w4a16_gemm": "gptq_gemm",
    "fused_moe": "fused_moe",
    "moe_router": "fused_moe",
    "norm_moe": "fused_moe",
    "store_kv": "attention",
    "paged_attention": "attention",
    "kv_touch": "attention",
    "rms_norm": "norm",
    "qk_norm_rope": "rope",
    "qk_norm_rope_store": "rope",
    "silu_and_mul": "activation",
}
_BACKENDS = ("auto", "ref", "triton")


class _State:
    """The process-wide backend choice (set once by the runner; tests override with use_backend)."""

    default = "auto"
    interpret = False          # TRITON_INTERPRET=1: "auto" picks triton on CPU too


def set_default_backend(name: str, interpret: bool = False) -> None:
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend {name!r} is unknown; use one of {_BACKENDS}.")
    _State.default = name
    _State.interpret = interpret


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    old = _State.default
    set_default_backend(name, _State.interpret)
    try:
        yield
    finally:
        _State.default = old


def backend_for(device: torch.device) -> str:
    if _State.default != "auto":
        return _State.default
    return "triton" if (device.type == "cuda" or _State.interpret) else "ref"


def _impl(op: str, device: torch.device):
    backend = backend_for(device)
    module = importlib.import_module(f"onecard.kernels.{_OPS[op]}.{backend}")
    return getattr(module, op)


def init_paths(device: torch.device) -> dict[str, object]:
    """Decide at start-up what depends on the device (the runner calls it before the first forward): the
    capability every choice uses (kernels/paths.capability: ONECARD_EMULATE_CC honoured), on sm80+ which
    dtypes PyTorch's grouped GEMM runs, below sm80 whether SDPA's memory-efficient kernel runs the prefill
    attention (tiny probes; the prefill paths are chosen from them, never learnt from a failing prefill).
    -> what was decided, for the log."""
    if device.type != "cuda" or backend_for(device) != "triton":
        return {}
    from onecard.kernels.fused_moe import grouped

    cc = paths.capability(device)
    out: dict[str, object] = {"capability": cc, "real_capability": paths.real_capability(device),
                              "emulated": paths.emulated_capability() is not None}
    out["grouped_gemm_dtypes"] = sorted(grouped.supported_dtypes(device)) if not grouped.per_expert(device) else []
    if paths.prefill_sdpa_on(cc):                                        # below sm80: SDPA's kernel probed
        from onecard.kernels.attention import sdpa

        out["prefill_attention_sdpa"] = sdpa.available(device)
    return out


# Prefill-sized GEMMs are compute-bound: on a GPU they dequantize to fp16 and use tensor-core libraries
# (cuBLAS / grouped GEMM), which beat an int4 Triton GEMM there; small M stays in Triton (memory-bound).
# The thresholds and the capability branches are kernels/paths.py's.
def w4a16_gemm(x, w, bias=None):
    if (x.is_cuda and backend_for(x.device) == "triton"
            and paths.choose_dense_gemm(x.shape[0], paths.capability(x.device)) == "cublas"):
        from onecard.kernels.gptq_gemm.triton import dequantize

        y = torch.matmul(x, dequantize(w, x.dtype))
        return y if bias is None else y + bias
    return _impl("w4a16_gemm", x.device)(x, w, bias)


_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def fused_moe(x, router_logits, w_gate, w_up, w_down, top_k, renormalize):
    if x.is_cuda and backend_for(x.device) == "triton" and x.shape[0] >= paths.GROUPED_MIN_TOKENS:
        from onecard.kernels.fused_moe import grouped

        cc = paths.capability(x.device)
        path = paths.choose_moe(x.shape[0], cc, act=_DTYPE_NAMES.get(x.dtype, str(x.dtype)),
                                grouped_dtypes=() if paths.per_expert_moe(cc) else grouped.supported_dtypes(x.device))
        if path in ("grouped", "per-expert"):
            # grouped.per_expert (the same table) picks the GEMM loop: bench/capability_ab.py toggles it there
            return grouped.fused_moe(x, router_logits, w_gate, w_up, w_down, top_k, renormalize)
    return _impl("fused_moe", x.device)(x, router_logits, w_gate, w_up, w_down, top_k, renormalize)


def norm_moe(x, residual, norm_weight, eps, gate, w_gate, w_up, w_down, top_k, renormalize, folded=None):
    if x.shape[0] == 1 or backend_for(x.device) == "ref":
        more = {"folded": folded} if folded is not None and backend_for(x.device) == "triton" else {}
        return _impl("norm_moe", x.device)(x, residual, norm_weight, eps, gate, w_gate, w_up, w_down, top_k,
                                           renormalize, **more)
    h, residual = rms_norm(x, norm_weight, eps, residual)                 # the grouped prefill path lives here
    return fused_moe(h, moe_router(h, gate), w_gate, w_up, w_down, top_k, renormalize), residual


def moe_router(x, weight):
    return _impl("moe_router", x.device)(x, weight)


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    return _impl("store_kv", k.device)(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(q, k_cache, v_cache, md, scale, k_scale=1.0, v_scale=1.0):
    return _impl("paged_attention", q.device)(q, k_cache, v_cache, md, scale, k_scale, v_scale)


def kv_touch(k_cache, v_cache, md, max_positions, out=None, evict_last=True):
    return _impl("kv_touch", k_cache.device)(k_cache, v_cache, md, max_positions, out, evict_last)


def rms_norm(x, weight, eps, residual=None):
    return _impl("rms_norm", x.device)(x, weight, eps, residual)


def qk_norm_rope(q, k, q_weight, k_weight, positions, cos_sin_cache, eps):
    return _impl("qk_norm_rope", q.device)(q, k, q_weight, k_weight, positions, cos_sin_cache, eps)


def qk_norm_rope_store(q, k, v, q_weight, k_weight, positions, cos_sin_cache, eps, k_cache, v_cache, slot_mapping,
                       k_scale=1.0, v_scale=1.0):
    return _impl("qk_norm_rope_store", q.device)(q, k, v, q_weight, k_weight, positions, cos_sin_cache, eps,
                                                  k_cache, v_cache, slot_mapping, k_scale, v_scale)


def norm_qkv_rope_store(x, residual, norm_weight, eps, w, bias, q_weight, k_weight, positions, cos_sin_cache,
                        k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    from onecard.kernels.attn_in import ref

    return ref.norm_qkv_rope_store(x, residual, norm_weight, eps, w, bias, q_weight, k_weight, positions,
                                   cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                                   ops=sys.modules[__name__])             # the three ops, each as dispatched


def attention_block(x, residual, norm_weight, eps, w_qkv, b_qkv, q_weight, k_weight, positions, cos_sin_cache,
                    k_cache, v_cache, md, scale, w_o, b_o, k_scale=1.0, v_scale=1.0, router_fold=None):
    from onecard.kernels.attn_in import ref

    args = (x, residual, norm_weight, eps, w_qkv, b_qkv, q_weight, k_weight, positions, cos_sin_cache, k_cache,
            v_cache, md, scale, w_o, b_o, k_scale, v_scale)
    if backend_for(x.device) == "triton" and paths.batch1_accumulate(x.shape[0]):
        from onecard.kernels.attn_in import triton as tk

        if tk.accumulate_supported(x, residual, w_qkv, w_o, k_cache):
            if router_fold is not None and b_o is None and paths.batch1_router_fold(x.shape[0]):
                return tk.attention_block(*args, router_fold=router_fold)
            out = tk.attention_block(*args)
            return out if router_fold is None else (*out, None)
    out = ref.attention_block(*args, ops=sys.modules[__name__])          # the three ops, each as dispatched
    return out if router_fold is None else (*out, None)


def silu_and_mul(x):
    return _impl("silu_and_mul", x.device)(x)
