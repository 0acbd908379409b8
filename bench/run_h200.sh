#!/usr/bin/env bash
# One device call: GPU facts, kernel checks, tiny-checkpoint engine checks, the full-size benchmark.
# Usage (repo root, on the H200): OUT=/some/dir bash bench/run_h200.sh [parts...]
# parts: next15 removaltests moehost kvl2 kvpf kvpftests preamperetests half2tests slicestests slicestrace3 switchab ab resttests specverify apimem probe kernels checks full asyncab kvdtype capab capbisect hosttier loadab nopdl pdl16 emu70 longctx attnsweep gputests startup serve rss overhead hf floor profile tune diag   (default: probe kernels checks full floor)
#   emu70: the full-size bench with every kernel-path decision on sm70's branch (ONECARD_EMULATE_CC=70): run it
#          beside `full` in one call for the relative figure (a functional check, not a V100 timing)
#   specverify: issue 30: verify-step latency vs tokens per sequence (1..9) at batch 1 and 16 (the cost model's
#          table), the expert union, the projected speed-up (SPEC_ACCEPTANCE=bench/spec_acceptance.py's JSON, if
#          given), then end-to-end tok/s with the engine's verify graphs: off (sync loop, async loop), teacher-forced
#          drafts and random prompts with the policy; capture time and memory of the verify graphs;
#          SPEC_CONTEXTS=512,8192,32768: the table at those KV contexts too (the first at full detail; +60 s, so 610 s with the build)
#   longctx: decode at batch 1 with 32k and 64k of context, batch 16 with 8k each, vs the bandwidth floor
#   attnsweep: decode attention alone (CUDA graphs of 48 launches, no checkpoint) at 1x512 / 1x32k / 1x64k /
#          16x8k (+ fp8_e5m2 1x32k): segments, tiles, stages, block-table prefetch, reduce vs the copy floor (~6 min)
set -u
# the server's dependencies the device lacks, from the carried .whl/ (bench/device_wheels.sh)
if [ -d .whl ]; then bash bench/device_wheels.sh install && EXTRA_PYTHONPATH="/tmp/site${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}"; fi
export PYTHONPATH="$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/onecard_out}"; mkdir -p "$OUT"
parts="${*:-probe kernels checks full floor}"
log() { echo "=== $* ($(date +%T))"; }
# abrun SCENARIOS POLICIES [SECONDS]: bench/long_context.py's A/B in ONE engine (one graph set per policy, runs
# alternating, medians of 3) on the full-size checkpoint (built first if missing); each scenario's JSON line is
# kept as it finishes, then bench/ab_table.py's markdown table of every finished scenario
abrun() {
  [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30 > /dev/null
  timeout "${3:-240}" python3 bench/long_context.py /tmp/q30 "$OUT/switch_ab.json" --scenarios "$1" --policies "$2" \
      | tee "$OUT/switch_ab.log" | grep -v '^{'
  python3 bench/ab_table.py "$OUT/switch_ab.log"
}
for p in $parts; do
  case $p in
    apimem) log apimem  # issue 28: only the engine process may hold GPU memory (nvidia-smi), bundled model
          timeout 600 python3 bench/api_gpu_memory.py "$OUT/api_gpu_memory.json" ;;
    specverify) log specverify  # two processes (the table, then the engine runs); with the build <= 550 s
          [ -d /tmp/q30 ] || timeout 200 python3 bench/full_size.py build /tmp/q30
          timeout $((150${SPEC_CONTEXTS:+ + 60})) python3 bench/spec_verify.py /tmp/q30 "$OUT" --parts verify ${SPEC_ACCEPTANCE:+--acceptance "$SPEC_ACCEPTANCE"} ${SPEC_CONTEXTS:+--contexts "$SPEC_CONTEXTS"}
          timeout 200 python3 bench/spec_verify.py /tmp/q30 "$OUT" --parts e2e,random ${SPEC_ACCEPTANCE:+--acceptance "$SPEC_ACCEPTANCE"} ;;
    probe) log probe; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
           python3 -c "import torch,triton,transformers;print(torch.__version__,torch.version.cuda,triton.__version__,transformers.__version__)"
           [ -f onecard/hardware.py ] && timeout 60 python3 -m onecard.cli probe ;;
    kernels) log kernels; [ -f bench/kernels_gpu.py ] && timeout 180 python3 bench/kernels_gpu.py ;;
    checks) log checks; timeout 240 python3 bench/gpu_checks.py "$OUT/gpu_checks.json" 2>&1 | grep -v "Loading weights\|Writing" ;;
    full) log build; [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          log onecard; timeout 300 python3 bench/full_size.py onecard /tmp/q30 "$OUT/onecard.json" ;;
    asyncab) log asyncab  # decode with the synchronous loop vs --async-scheduling, alternating, one engine
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          timeout 300 python3 bench/async_ab.py /tmp/q30 "$OUT/async_ab.json" ;;
    kvdtype) log kvdtype  # KV tokens at util 0.9, decode bs1/bs16 and prefill 4k: fp16 vs fp8_e5m2 (and fp8_e4m3 on sm89+)
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          timeout 540 python3 bench/kv_dtype.py /tmp/q30 "$OUT/kv_dtype.json" ;;
    hosttier) log hosttier  # TTFT of a 32k-token prompt cold vs from the host KV tier (--kv-offloading-size)
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          timeout 400 python3 bench/host_tier.py /tmp/q30 "$OUT/host_tier.json" ;;
    capab) log capab  # issue 29: the lead's process-wide patch (torch + onecard answer 8.0 from import) vs native,
          # decode measured three ways (lead's t2-t1, warmed, arrival), two processes (~2.5 min)
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          timeout 170 python3 bench/capability_ab.py /tmp/q30 "$OUT/cap_native.json"
          timeout 110 python3 bench/capability_ab.py /tmp/q30 "$OUT/cap_emu80.json" --emulate 80 ;;
    capbisect) log capbisect  # issue 29: each capability consumer alone at sm80 (pdl80 grouped80 torch80
          # torch_native_off onecard80 lead80 triton_pin native), 3 alternating rounds in one engine, the guard
          # (native vs the best), decode kernel profile native vs lead80, t1 first/again profile (~3.5 min)
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          timeout 260 python3 bench/capability_bisect.py /tmp/q30 "$OUT/cap_bisect.json" ;;
    loadab) log loadab  # weight loading, committed loader vs .ab/loader_old.py (when carried), alternating
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          for i in 1 2; do
            [ -f .ab/loader_old.py ] && timeout 120 python3 bench/load_time.py /tmp/q30 "$OUT/load.jsonl" old .ab/loader_old.py
            timeout 120 python3 bench/load_time.py /tmp/q30 "$OUT/load.jsonl" new
          done ;;
    nopdl) log onecard_nopdl  # the same engine bench with programmatic dependent launch off (A/B)
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          ONECARD_PDL_MAX_TOKENS=0 timeout 300 python3 bench/full_size.py onecard /tmp/q30 "$OUT/onecard_nopdl.json" ;;
    pdl16) log onecard_pdl16  # PDL for every decode batch size (the default is batch 1 only)
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          ONECARD_PDL_MAX_TOKENS=16 timeout 300 python3 bench/full_size.py onecard /tmp/q30 "$OUT/onecard_pdl16.json" ;;
    emu70) log onecard_emu70  # the pre-sm80 (V100) paths on this card: decisions of sm70, Triton compiling for this one
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          ONECARD_EMULATE_CC=70 timeout 400 python3 bench/full_size.py onecard /tmp/q30 "$OUT/onecard_emu70.json" ;;
    longctx) log long_context  # decode at 512 / 32k / 64k (bs1) and 512 / 8k (bs16) of context, medians of 3,
          # split-KV policies legacy vs fill (and fill at 5 programs/SM) alternating in one engine (~3-4 min)
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          # LONGCTX_POLICIES overrides the list; after attnsweep in the same call, its fastest knobs are A/B'd too
          timeout 330 python3 bench/long_context.py /tmp/q30 "$OUT/long_context.json" \
              --policies "${LONGCTX_POLICIES:-legacy,fill,fill:5}" \
              $([ -f "$OUT/attn_sweep.json" ] && echo --sweep "$OUT/attn_sweep.json") ;;
    switchab) log switchab  # issue 25: the decode paths' switches A/B'd in ONE engine (bench/long_context.py
          # policies "fill+SWITCH+...": one graph set each, runs alternating; SWITCH_POLICIES overrides the list),
          # after the kernels alone (graph replay; the M=1/16 GEMMs and T=1/16 MoE with each switch on) and before
          # the GPU tests of the kernels and the engine (~6 min; each scenario's JSON line is kept as it finishes;
          # AB_TIMEOUT: the A/B's seconds, default 220; AB_TESTS=0: no tests)
          timeout "${AB_KTIMEOUT:-100}" python3 bench/kernels_gpu.py --quick --only "${AB_KERNELS:-attention block,M=1,T=1}"
          abrun "${AB_SCENARIOS:-1x512,16x512}" "${SWITCH_POLICIES:-fill,fill+no_slices_half2}" "${AB_TIMEOUT:-220}"
          [ "${AB_TESTS:-1}" = 1 ] && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
              tests/gpu/test_engine_gpu.py 2>&1 | tail -8 ;;
    kvpf) log kvpf  # issue 25 item 3 (prepared 2026-12-07, not run): the batch-1 read of the next layer's KV into L2
          # during each MoE (paths.BATCH1_KV_PREFETCH, off): the probe (part kvl2), then in one engine at 1x512,
          # 1x32768 and 1x65536 the shipped path against the read at 24 MB a layer and at 36 (~9 min with the build;
          # the scenarios finished when the A/B's timeout cuts it are kept). Its GPU tests: part kvpftests
          bash "$0" kvl2
          log kvpf-ab
          abrun "${AB_SCENARIOS:-1x32768,1x512,1x65536}" "${SWITCH_POLICIES:-fill,fill+kv_prefetch,fill+kv_prefetch+kvpf36}" \
            "${AB_TIMEOUT:-420}" ;;
    kvpftests) log kvpftests  # part kvpf's GPU tests (~3 min): the tiny coder's tokens with the read on = off
          # (graphs and eager), kv_touch against its reference at the served shape
          timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kv_prefetch_gpu.py 2>&1 | tail -6 ;;
    preamperetests) log preamperetests  # the pre-sm80 paths built 2026-12-07 (not run yet; ~6 min with the build):
          # SDPA's memory-efficient kernel for prefill attention (paths.prefill_sdpa) and the decode MoE's row step
          # (paths.decode_rows) at the served shapes against the reference under the emulated sm70, with the
          # attention's memory; then the emulated engine's greedy text and the full-size logits at 16 and 80 tokens
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30 > /dev/null
          timeout 500 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pre_ampere_gpu.py \
            tests/gpu/test_emulation_gpu.py 2>&1 | tail -8 ;;
    moehost) log moehost  # the per-expert prefill MoE's host cost (~1 min): µs a GEMM of its loop (and of PyTorch's
          # _grouped_mm fallback) and host vs wall time at 256 / 512 / 4,096 tokens: the V100 estimate's assumption
          timeout 240 python3 bench/prefill_moe_host.py "$OUT/prefill_moe_host.json" ;;
    kvl2) log kvl2  # issue 25 item 3, a probe (~1 min): one layer's batch-1 decode attention at 32k and 64k after an
          # L2 flush, with the first 25/40/60% of its KV read into L2 first (evict_last or not, with a layer's other
          # weights streamed between or not): would prefetching the next layer's KV during the MoE pay?
          timeout 240 python3 bench/kv_l2_probe.py "$OUT/kv_l2_probe.json" --ctx 32768,65536 ;;
    removaltests) log removaltests  # the GPU tests of what the 2026-12-07 removal touched (~8 min; run after next15
          # on the warm machine): every kernel against its reference at the real shapes (attention, split-KV, the
          # decode MoE's silu, the router), graphs = eager and async = sync in the engine, the precompile (also at a
          # 2,048-token bound whose decode graphs split their KV and launch the reduce)
          timeout 580 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_split_kv_gpu.py \
            tests/gpu/test_engine_gpu.py tests/gpu/test_precompile_gpu.py 2>&1 | tail -10 ;;
    next15) log next15  # the first call of the next session (~8 min with the build): the issue's figures on whatever
          # card comes (full: decode bs1/bs16, prefill, TTFT, logits; long contexts under the shipped split-KV policy),
          # then the slices' GPU tests through the shipped packed-fp16 dots
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30 > /dev/null
          timeout 150 python3 bench/full_size.py onecard /tmp/q30 "$OUT/onecard.json" | grep -E "decode_bs|prefill|ttft|logits|argmax"
          LONGCTX_POLICIES=fill bash "$0" longctx | grep -v '^{'
          timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_slices_gpu.py -k "half2 or emulated or fold" 2>&1 | tail -6 ;;
    half2tests) log half2tests  # the slices' GPU tests (their packed-fp16 dots as shipped, the fp32 dots, emulated
          # sm70, the router fold) and the MoE kernel rows at the real shapes (~6 min)
          timeout 500 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_slices_gpu.py tests/gpu/test_kernels_gpu.py \
            -k "slices or norm_moe" 2>&1 | tail -8 ;;
    slicestrace3) log slicestrace3  # bench/slices_trace.py on the shipped slices (the gate/up loop pipelined 3 deep),
          # then on the one-ahead loop (the pre-Ampere config), to compare the phases (~3 min with the build)
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30 > /dev/null
          timeout 150 python3 bench/slices_trace.py /tmp/q30 "$OUT/slices_trace.json" 512
          SLICES_TRACE_CONFIG=32,32,1024,8,1 timeout 150 python3 bench/slices_trace.py /tmp/q30 \
            "$OUT/slices_trace_one_ahead.json" 512 ;;
    slicestests) log slicestests  # the batch-1 MoE slices' GPU tests (~3 min): the coder's greedy tokens with them in
          # graphs == eager == the two-launch stages; the precompile covers them; the slices rows vs reference
          timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_slices_gpu.py \
            tests/gpu/test_precompile_gpu.py::test_precompile_covers_the_moe_slices \
            tests/gpu/test_kernels_gpu.py -k "slices or norm_moe" 2>&1 | tail -8 ;;
    ab) log ab  # A/B of source files, arms built as copies of this tree with files swapped in: AB_SWAP="PATH:.ab/FILE ..."
          # makes the base (/tmp/base: e.g. onecard/kernels/gptq_gemm/int4.py:.ab/int4_old.py, issue 25's dequant
          # A/B), AB_NEW the new arm (/tmp/new; unset: this tree as it is; e.g. a paths.py with a switch on),
          # AB_ALT (optional) a third (/tmp/alt); at least AB_SWAP or AB_NEW. Then the batch-1 kernels alone (graph
          # replay) in each arm and the full model at batch 1, 512 tokens, one process per arm and repeat,
          # alternating base, new(, alt), base, new(, alt) (~4 min for two arms)
          : "${AB_SWAP:-${AB_NEW:?AB_SWAP or AB_NEW: PATH:.ab/FILE ...}}"
          rm -rf /tmp/base /tmp/new /tmp/alt
          arm() {  # arm DIR "PATH:FILE ...": a copy of this tree with those files
            mkdir -p "$1" && cp -r onecard bench tests "$1/"
            for sw in $2; do cp "${sw#*:}" "$1/${sw%%:*}"; done
          }
          arm /tmp/base "${AB_SWAP:-}"
          if [ -n "${AB_NEW:-}" ]; then arm /tmp/new "$AB_NEW"; trees="/tmp/base /tmp/new"; else trees="/tmp/base $PWD"; fi
          if [ -n "${AB_ALT:-}" ]; then arm /tmp/alt "$AB_ALT"; trees="$trees /tmp/alt"; fi
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30 > /dev/null
          for tree in $trees; do
            echo "--- kernels, $tree"
            (cd "$tree" && PYTHONPATH="$tree${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" timeout 120 python3 bench/kernels_gpu.py \
              --quick --only "${AB_KERNELS:-M=1,fused_moe T=1,norm_moe T=1}")
          done
          i=0
          for tree in $trees $trees; do
            i=$((i + 1)); tag=$(case "$tree" in /tmp/base) echo base;; /tmp/alt) echo alt;; *) echo new;; esac)
            (cd "$tree" && PYTHONPATH="$tree${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}" timeout 120 python3 bench/long_context.py \
              /tmp/q30 "$OUT/ab_${tag}_$i.json" --policies fill --scenarios "${AB_SCENARIOS:-1x512}" | grep "tok/s" \
              | sed "s/^/$tag $i: /")
          done ;;
    attnsweep) log attn_sweep  # issue 25 item 3: one call of <= 400 s; JSON + a short table
          timeout 390 python3 bench/attn_sweep.py "$OUT/attn_sweep.json" --budget "${ATTN_BUDGET:-320}" ;;
    resttests) log resttests  # tests/gpu without what part slicestests ran (its file, its precompile case): after
          # it, the rest of gputests in a call of its own (RESTTESTS_TIMEOUT, default 560 s)
          timeout "${RESTTESTS_TIMEOUT:-560}" python3 -m pytest -x -q -p no:cacheprovider tests/gpu \
            --ignore=tests/gpu/test_moe_slices_gpu.py -k "not covers_the_moe_slices" 2>&1 | tail -15 ;;
    gputests) log gputests; timeout 590 python3 -m pytest -x -q -p no:cacheprovider tests/gpu 2>&1 | tail -15 ;;
    startup) log startup  # cold (fresh Triton cache) with precompile, warm, cold without precompile
          [ -d /tmp/q30 ] || timeout 240 python3 bench/full_size.py build /tmp/q30
          rm -rf /tmp/tcache_a /tmp/tcache_b
          TRITON_CACHE_DIR=/tmp/tcache_a timeout 150 python3 bench/startup.py /tmp/q30 "$OUT/startup.jsonl" cold_precompile
          TRITON_CACHE_DIR=/tmp/tcache_a timeout 150 python3 bench/startup.py /tmp/q30 "$OUT/startup.jsonl" warm
          TRITON_CACHE_DIR=/tmp/tcache_b ONECARD_PRECOMPILE=0 timeout 150 python3 bench/startup.py /tmp/q30 "$OUT/startup.jsonl" cold_jit ;;
    serve) log serve  # the real `onecard serve` with the deployment's flags: seconds from exec to /health 200
          cp onecard/data/onecard-tiny-coder/tokenizer* onecard/data/onecard-tiny-coder/chat_template.jinja /tmp/q30/ 2>/dev/null
          python3 -c "import fastapi, uvicorn" || { echo "no fastapi/uvicorn here: serve skipped"; continue; }
          t0=$(date +%s.%N)
          python3 -m onecard.cli serve /tmp/q30 --served-model-name coder reasoning --quantization=gptq \
            --dtype=float16 --kv-cache-dtype=auto --max-model-len=65536 --tensor-parallel-size=1 \
            --pipeline-parallel-size=1 --gpu-memory-utilization=0.90 --max-num-seqs=16 \
            --max-num-batched-tokens=8192 --long-prefill-token-threshold=2048 --enable-chunked-prefill \
            --enable-prefix-caching --reasoning-parser=qwen3 --enable-auto-tool-choice --tool-call-parser=hermes \
            --host=127.0.0.1 --port=8080 > "$OUT/serve.log" 2>&1 &
          spid=$!
          for i in $(seq 1 900); do
            code=$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8080/health); [ "$code" = 200 ] && break; sleep 0.1
          done
          t1=$(date +%s.%N); echo "serve: /health 200 after $(python3 -c "print(round($t1 - $t0, 2))") s"
          for m in coder reasoning; do curl -s -w ' %{http_code} %{time_total}s\n' http://127.0.0.1:8080/v1/chat/completions \
            -H 'content-type: application/json' \
            -d "{\"model\":\"$m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":8}" | tail -c 300; done
          kill -TERM $spid; wait $spid; echo "serve exit $?"; tail -5 "$OUT/serve.log" ;;
    profile) log profile; [ -d /tmp/q8 ] || ONECARD_BENCH_LAYERS=8 timeout 120 python3 bench/full_size.py build /tmp/q8
          timeout 240 python3 bench/profile_decode.py /tmp/q8 "$OUT/profile.json" ;;
    tune) log tune; timeout 330 python3 bench/tune_decode.py "$OUT/tune.json" ${TUNE_PARTS:-} ;;
    diag) log diag; timeout 120 python3 bench/diag_skinny.py ;;
    rss) log rss; timeout 120 python3 bench/load_rss.py --device cuda ;;
    overhead) log overhead; timeout 60 python3 bench/step_overhead.py --device cuda ;;
    hf) log hf; timeout 300 python3 bench/full_size.py hf "$OUT/hf.json" ;;
    floor) log floor; timeout 60 python3 bench/full_size.py floor "$OUT/floor.json" ;;
  esac
done
log done
