#!/usr/bin/env bash
# Build onecard-tiny-coder end to end: tokenizer -> pretraining -> GPTQ 4-bit -> held-out eval -> package.
#
# Usage: scripts/build_default_model.sh OUT_DIR [WORK_DIR]
#   env: MINUTES (training budget, default 5: the whole build then takes ~7 min on an H200), DEVICE (default cuda if available), SMOKE=1 (tiny CPU run:
#        few files and steps), INSTALL=1 (also copy the checkpoint into onecard/data/onecard-tiny-coder/),
#        TRAIN_ARGS (extra flags for scripts/train_tiny.py).
# OUT_DIR receives few, small files (fits the device tool's $OUT: <= 8 files of <= 16 MiB):
#   onecard-tiny-coder.tar  the 4-bit checkpoint folder (extract with: tar -xf ... -C onecard/data/)
#   eval.json               held-out perplexity of float / GPTQ / RTN (scripts/eval_ppl.py)
#   train_log.json          training arguments, data sizes and loss curve
#   build.log               everything printed
# Intermediate files (float checkpoint, RTN copy) stay in WORK_DIR (default: a temporary folder).
# Needs only python with torch + transformers (tokenizers, safetensors come with it); no network.
set -euo pipefail

OUT_DIR=${1:?usage: build_default_model.sh OUT_DIR [WORK_DIR]}
WORK_DIR=${2:-$(mktemp -d)}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
MINUTES=${MINUTES:-5}
DEVICE=${DEVICE:-$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}
mkdir -p "$OUT_DIR" "$WORK_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
exec > >(tee "$OUT_DIR/build.log") 2>&1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"
start=$(date +%s)
echo "== onecard-tiny-coder build: device=$DEVICE minutes=$MINUTES work=$WORK_DIR smoke=${SMOKE:-0}"

if [[ "${SMOKE:-0}" == 1 ]]; then
  TOK_ARGS=(--max-files 60)
  TRAIN=(--max-steps 3 --batch-size 2 --seq-len 64 --warmup 1)
  QUANT=(--num-samples 8 --seq-len 64)
  EVAL=(--max-tokens 2048 --seq-len 128)
else
  TOK_ARGS=()
  TRAIN=(--minutes "$MINUTES")
  QUANT=(--num-samples 128 --seq-len 512)
  EVAL=(--seq-len 512)
fi

echo "== 1/5 tokenizer"
$PY scripts/train_tokenizer.py "$WORK_DIR" "${TOK_ARGS[@]}"

echo "== 2/5 pretraining"
# shellcheck disable=SC2086
$PY scripts/train_tiny.py "$WORK_DIR" --device "$DEVICE" "${TRAIN[@]}" ${TRAIN_ARGS:-}
cp "$WORK_DIR/train_log.json" "$OUT_DIR/"

echo "== 3/5 GPTQ"
# calibration: training files only (never the held-out ones), a deterministic sample
$PY - "$WORK_DIR" <<'EOF'
import json, random, sys
from pathlib import Path
work = Path(sys.argv[1])
split = json.loads((work / "split.json").read_text())
files = list(split["train"])
random.Random(1234).shuffle(files)
parts, total = [], 0
for f in files:
    t = (Path(split["stdlib"]) / f).read_text(encoding="utf-8")
    parts.append(t)
    total += len(t)
    if total > 3_000_000:
        break
(work / "calib.txt").write_text("\n".join(parts))
print(f"calibration text: {len(parts)} files, {total / 1e6:.1f} M chars")
EOF
rm -rf "$WORK_DIR/gptq"
$PY -m onecard.quant.cli "$WORK_DIR/float" "$WORK_DIR/gptq" --bits 4 --group-size 128 --sym \
    --calibration "$WORK_DIR/calib.txt" --device "$DEVICE" "${QUANT[@]}"

echo "== 4/5 held-out perplexity"
$PY scripts/eval_ppl.py --float "$WORK_DIR/float" --gptq "$WORK_DIR/gptq" --split "$WORK_DIR/split.json" \
    --json "$OUT_DIR/eval.json" --device "$DEVICE" "${EVAL[@]}"

echo "== 5/5 package"
PKG="$WORK_DIR/onecard-tiny-coder"
rm -rf "$PKG"
cp -r "$WORK_DIR/gptq" "$PKG"
# the figure the CI test compares against (tests/unit/test_default_model.py), measured on CPU in float32
$PY - "$PKG" "$REPO/tests/data/heldout_snippet.py" "$OUT_DIR/eval.json" <<'EOF'
import json, sys
from pathlib import Path
from onecard.quant.ppl import perplexity
pkg, snippet, ev = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
ppl, n = perplexity(pkg, [snippet.read_text()], seq_len=512, device="cpu")
rel = {"heldout_snippet": "tests/data/heldout_snippet.py", "heldout_snippet_ppl": round(ppl, 4),
       "tokens": n, "margin": 0.05, "seq_len": 512,
       "heldout_stdlib_ppl": {k: ev[k]["ppl"] for k in ("float", "gptq", "rtn")}}
(pkg / "release_ppl.json").write_text(json.dumps(rel, indent=1) + "\n")
print("release_ppl.json:", rel)
EOF
size=$(du -sb "$PKG" | cut -f1)
echo "checkpoint size: $size bytes"
if (( size > 20000000 )); then echo "ERROR: checkpoint is over 20 MB" >&2; exit 1; fi
tar -cf "$OUT_DIR/onecard-tiny-coder.tar" -C "$WORK_DIR" onecard-tiny-coder
tsize=$(stat -c %s "$OUT_DIR/onecard-tiny-coder.tar")
if (( tsize > 16777216 )); then echo "WARNING: the tar is $tsize bytes, over the 16 MiB a fetched file may have" >&2; fi
if [[ "${INSTALL:-0}" == 1 ]]; then
  rm -rf "$REPO/onecard/data/onecard-tiny-coder"
  mkdir -p "$REPO/onecard/data"
  cp -r "$PKG" "$REPO/onecard/data/onecard-tiny-coder"
  echo "installed into onecard/data/onecard-tiny-coder"
fi
echo "== done in $(( $(date +%s) - start ))s: $OUT_DIR"
ls -la "$OUT_DIR"
