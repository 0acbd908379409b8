#!/usr/bin/env bash
# One device call: GPU facts, kernel checks, tiny-checkpoint engine checks, the full-size benchmark.
# Usage (repo root, on the H200): OUT=/some/dir bash bench/run_h200.sh [parts...]
# parts: probe kernels checks full hf floor   (default: probe kernels checks full floor)
set -u
export PYTHONPATH="$PWD" TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/onecard_out}"; mkdir -p "$OUT"
parts="${*:-probe kernels checks full floor}"
log() { echo "=== $* ($(date +%T))"; }
for p in $parts; do
  case $p in
    probe) log probe; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
           python3 -c "import torch,triton,transformers;print(torch.__version__,torch.version.cuda,triton.__version__,transformers.__version__)"
           [ -f onecard/hardware.py ] && timeout 60 python3 -m onecard.cli probe ;;
    kernels) log kernels; [ -f bench/kernels_gpu.py ] && timeout 180 python3 bench/kernels_gpu.py ;;
    checks) log checks; timeout 240 python3 bench/gpu_checks.py "$OUT/gpu_checks.json" 2>&1 | grep -v "Loading weights\|Writing" ;;
    full) log build; [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          log onecard; timeout 300 python3 bench/full_size.py onecard /tmp/q30 "$OUT/onecard.json" ;;
    hf) log hf; timeout 300 python3 bench/full_size.py hf "$OUT/hf.json" ;;
    floor) log floor; timeout 60 python3 bench/full_size.py floor "$OUT/floor.json" ;;
  esac
done
log done
