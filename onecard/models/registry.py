"""HF architecture name → our model class, with a reason for architectures we know we do not run."""
from __future__ import annotations

from onecard.env import ConfigError
from onecard.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM

MODELS = {"Qwen3ForCausalLM": Qwen3ForCausalLM, "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM}
NOT_SUPPORTED = {
    "Qwen3NextForCausalLM": "its hybrid attention (Gated DeltaNet linear attention mixed with gated full "
                            "attention) is not supported by onecard",
}


def get_model_class(architecture: str):
    if architecture in MODELS:
        return MODELS[architecture]
    why = NOT_SUPPORTED.get(architecture, "onecard has no implementation of it")
    raise ConfigError(f"architecture {architecture!r} cannot be served: {why}. Supported architectures: "
                      + ", ".join(sorted(MODELS)) + ".")
