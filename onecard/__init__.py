"""onecard: a one-GPU inference server for 4-bit MoE coding models (V100 to H200).

Public offline API (vLLM-compatible): ``LLM``, ``SamplingParams`` and ``StructuredOutputsParams``.
"""
from onecard.outputs import CompletionOutput, RequestOutput
from onecard.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import onecard` (process A, CLI --help) does not import torch.
    if name == "LLM":
        from onecard.llm import LLM

        return LLM
    raise AttributeError(name)
