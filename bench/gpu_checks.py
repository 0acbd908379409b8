"""GPU correctness checks on the tiny checkpoints (run on the H200; tests/gpu wraps the same functions).

For the dense, MoE and GPTQ-MoE fixtures: greedy tokens with the Triton backend vs the reference backend
(same device, same dtype), CUDA-graph replay vs eager, and async scheduling vs the synchronous loop (CUDA
graphs; the next step's input ids come from the step in flight). Prints one line per check and a JSON summary.
Under ONECARD_EMULATE_CC=70 every kernel-path decision takes sm70's branch on this card (tests/gpu runs it
so); the summary's "_paths" entry records the capability the checks ran with.
Usage: python bench/gpu_checks.py [OUT.json]
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from onecard.config import EngineArgs
from onecard.core.engine_core import EngineCore
from onecard.protocol import EngineRequest
from onecard.sampling_params import SamplingParams

LENGTHS = (1, 3, 17, 40, 77, 120, 160, 200)


def build_fixtures(root: Path) -> dict[str, Path]:
    from tests.fixtures import checkpoints

    tok = checkpoints.build_tokenizer(root / "tok")
    dense = checkpoints.build_dense(root / "dense", tok)
    moe = checkpoints.build_moe(root / "moe", tok)
    gptq = checkpoints.build_moe_gptq(root / "moe_gptq", moe)
    return {"dense": dense, "moe": moe, "moe_gptq": gptq}


# the bundled tiny coder (GPTQ g128, head_dim 64): the batch-1 fused kernels apply to it (the fixtures' g32
# GPTQ does not), so it runs one request at a time
CODER = Path(__file__).resolve().parent.parent / "onecard" / "data" / "onecard-tiny-coder"


def greedy(path: Path, backend: str, dtype: str, eager: bool, async_scheduling: bool = False, new: int = 16,
           serial: bool = False, speculative: dict | None = None, max_model_len: int = 256) -> list[list[int]]:
    cfg = EngineArgs(model=str(path), device="cuda", dtype=dtype, max_model_len=max_model_len, enforce_eager=eager,
                     kv_cache_memory_bytes=64 << 20, max_num_seqs=16,
                     async_scheduling=async_scheduling if speculative is None else None,
                     speculative_config=speculative).create_config()
    cfg.env.kernel_backend = backend
    core = EngineCore(cfg)
    vocab = int(cfg.model.hf_config["vocab_size"])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    got: dict[str, list[int]] = {}

    def drain() -> None:
        while core.has_unfinished():
            for o in core.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(str(i), p, sp, time.monotonic(), []))
        if serial:
            drain()                        # one request at a time: every decode step is a batch-1 step
    drain()
    return [got[str(i)] for i in range(len(prompts))]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of sequences identical up to the first divergence, averaged as matched-prefix length."""
    tot = hit = 0
    for x, y in zip(a, b):
        n = 0
        while n < len(x) and x[n] == y[n]:
            n += 1
        hit += n
        tot += len(x)
    return hit / tot


def capability_record() -> dict:
    """The capability every decision used (emulated or not) and the card's own."""
    from onecard.kernels import paths as kpaths

    return {"capability": kpaths.capability(), "real_capability": kpaths.real_capability(),
            "emulated": kpaths.emulated_capability()}


def main(out: str | None = None) -> dict:
    res: dict = {"_paths": capability_record()}
    with tempfile.TemporaryDirectory() as d:
        paths = build_fixtures(Path(d))
        paths["coder_gptq_batch1"] = CODER
        # the bundled coder (g128: one group per K tile) all at once: its skinny GEMMs and T > 1 MoE stages take
        # the exact-integer dot (paths.DECODE_INT_DOT)
        paths["coder_gptq_batched"] = CODER
        for name, path in paths.items():
            dtype = "float16" if "gptq" in name else "float32"
            serial = name.endswith("batch1")
            checks = {
                "triton_vs_ref": (("ref", dtype, True), ("triton", dtype, True)),
                "graphs_vs_eager": (("triton", dtype, True), ("triton", dtype, False)),
                "async_vs_sync": (("triton", dtype, False), ("triton", dtype, False, True)),
            }
            for check, (a_args, b_args) in checks.items():
                try:
                    a, b = greedy(path, *a_args, serial=serial), greedy(path, *b_args, serial=serial)
                    res[f"{name}/{check}"] = {"identical": a == b, "prefix_agreement": agreement(a, b)}
                except Exception as e:
                    res[f"{name}/{check}"] = {"error": repr(e)[:500]}
                print(f"{name:9s} {check:16s} {res[f'{name}/{check}']}", flush=True)
    if out:
        Path(out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
