"""Weight loading alone, measured: seconds from ``load_model`` to the weights resident on the GPU.

Usage (on the GPU, repo root): python bench/load_time.py MODEL_DIR OUT.jsonl [label] [loader.py]
With a fourth argument, that file replaces onecard/models/loader.py for this process (an A/B of two loader
versions in one device run: bench/run_h200.sh part "loadab" runs the committed loader and the previous one
alternately, so page-cache state and the host are the same for both). Appends one JSON line to OUT.jsonl.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    label = sys.argv[3] if len(sys.argv) > 3 else "load"
    if len(sys.argv) > 4:
        spec = importlib.util.spec_from_file_location("onecard.models.loader", sys.argv[4])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["onecard.models.loader"] = mod
        spec.loader.exec_module(mod)
    from onecard.config import EngineArgs
    from onecard.models.loader import load_model

    cfg = EngineArgs(model=model_dir, dtype="float16", quantization="gptq").create_config()
    torch.cuda.init()
    torch.empty(1, device="cuda")                                         # context creation not counted
    t0 = time.perf_counter()
    model = load_model(cfg.model, torch.device("cuda"), torch.float16)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    res = {"label": label, "load_s": secs, "weights_gib": model.weights_bytes / 2**30,
           "gib_per_s": model.weights_bytes / 2**30 / secs}
    print(json.dumps(res))
    with open(out, "a") as f:
        f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
