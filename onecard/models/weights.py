"""What a model declares about its weights: which checkpoint tensors fill which parameter, with which shape.

Contract: a model class takes ``can_fuse(module_names) -> bool`` in its constructor (the loader answers from
the checkpoint's formats) and exposes ``weight_specs() -> list[Spec]`` and ``tie_weights()``. The loader
(models/loader.py) iterates shards, routes every tensor to the spec that ``owns`` it, assembles float and GPTQ
tensors as the spec says, and reports ``missing_weights(specs)``. ``layer`` is the decoder layer a spec
belongs to (None: embeddings, final norm, lm_head), so a tool can fill one layer at a time (quant/calibrate.py).
  Param        one float tensor ``key`` of ``shape`` -> ``setattr(owner, attr, t)``
  LinearSpec   checkpoint modules (``.weight`` [N_i, K] or GPTQ parts, optional ``.bias``) concatenated along
               N into one ``Linear`` (fused q/k/v, gate/up), ``out_features`` N_i each
  ExpertsSpec  per-expert modules ``{prefix}.{e}.{proj}`` (GPTQ or float [N, K]) or the transformers-5 fused
               tensors ``{prefix}.{name}`` [E, sum N_i, K] (``fused``: name -> projections, split along dim 1)
               -> ``owner.<attr>`` per projection: float [E, K, N] or a stacked GPTQWeight
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onecard.layers.linear import Linear


@dataclass(slots=True)
class Param:
    key: str
    shape: tuple[int, ...]
    owner: Any
    attr: str
    layer: int | None = None

    def owns(self, key: str) -> bool:
        return key == self.key

    def missing(self) -> list[str]:
        return [self.key] if getattr(self.owner, self.attr) is None else []


@dataclass(slots=True)
class LinearSpec:
    linear: Linear
    modules: list[str]
    out_features: list[int]
    layer: int | None = None
    hint: str = ""                     # appended to the "missing" message

    def owns(self, key: str) -> bool:
        return key.rpartition(".")[0] in self.modules

    def missing(self) -> list[str]:
        if self.linear.weight is None and self.linear.gptq is None:
            return [f"{self.modules[0]}.weight (or .qweight){self.hint}"]
        return []


@dataclass(slots=True)
class ExpertProj:
    name: str                          # checkpoint module suffix, e.g. "gate_proj"
    attr: str                          # owner attribute, e.g. "w_gate"
    in_features: int
    out_features: int


@dataclass(slots=True)
class ExpertsSpec:
    prefix: str
    owner: Any
    num_experts: int
    projs: list[ExpertProj]
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    layer: int | None = None

    def owns(self, key: str) -> bool:
        return key.startswith(self.prefix + ".")

    def proj(self, name: str) -> ExpertProj:
        return next(p for p in self.projs if p.name == name)

    def missing(self) -> list[str]:
        if any(getattr(self.owner, p.attr) is None for p in self.projs):
            return [f"{self.prefix} (some expert tensors)"]
        return []


Spec = Param | LinearSpec | ExpertsSpec


def missing_weights(specs: list[Spec]) -> list[str]:
    """Names of every declared weight that was not filled, in declaration order."""
    return [m for s in specs for m in s.missing()]
