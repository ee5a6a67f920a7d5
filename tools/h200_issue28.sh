#!/usr/bin/env bash
# Device calls for issue 28 (DSA, V4, KDA on the H200); every log lands in $OUT. Carry the wheels of
# tools/device_wheels.sh (fla-core, einops):
#   bash tools/device_wheels.sh    (here, once), then run(command="PART=tests bash tools/h200_issue28.sh", carry=[".whl"])
# PART (one per call, each within a call's 600 s):
#   tests  the GPU tests of the issue's kernels and graphs (hyper-connections, V4 compressor and attention, DSA,
#          sparse MLA, KDA via fla,
#          graph replays against eager steps, the engine's bf16 kernels), then bench/v4.py, bench/dsa.py and
#          bench/kda.py
#   engine the engine's GPU tests alone (graph replays against eager steps, CUDA engine against CPU engine)
#   v32    the DeepSeek-V3.2-shaped checkpoint (4 layers, 15.9 GiB) and bench/e2e.py at 8K / 32K / 128K
#          prompts: TTFT and 16 decode steps at each context, graphs + async and eager
#   v4     the DeepSeek-V4-Flash-shaped checkpoint (8 layers) and bench/e2e.py (MODES, default async: decode
#          graphs): TTFT and decode at 8K and 128K (the target: decode at 128K and 1M within 2x of 8K);
#          V4_TTFT="1040000" E2E_ARGS=--long-only T_E2E=500 for the 1M request alone (its prefill takes minutes)
source "$(dirname "$0")/device_env.sh"
case "${PART:-tests}" in
  tests)
    timeout ${T_TESTS:-330} python -m pytest -q ${TESTS:-tests/kernels/test_v4_paged.py tests/kernels/test_linear_fp8.py \
      tests/kernels/test_kda_fla.py tests/engine/test_graphs.py tests/engine/test_cuda.py tests/kernels/test_hc.py \
      tests/kernels/test_v4.py tests/kernels/test_dsa_index.py tests/kernels/test_attention_mla.py} -rs > $OUT/tests.log 2>&1
    grep -E "^FAILED|^SKIPPED|passed|failed" $OUT/tests.log | tail -12
    timeout ${T_V4B:-90} python bench/v4.py > $OUT/v4.log 2>&1; tail -8 $OUT/v4.log
    timeout ${T_DSA:-60} python bench/dsa.py --quick > $OUT/dsa.log 2>&1; tail -8 $OUT/dsa.log
    timeout ${T_KDA:-170} python bench/kda.py --quick > $OUT/kda.log 2>&1; tail -12 $OUT/kda.log ;;
  engine)
    timeout ${T_TESTS:-300} python -m pytest -q tests/engine/test_graphs.py tests/engine/test_cuda.py -k "${K:-cuda}" -rs \
      > $OUT/engine.log 2>&1
    grep -E "^FAILED|^SKIPPED|passed|failed" $OUT/engine.log | tail -12 ;;
  v32)
    timeout ${T_E2E:-560} python bench/e2e.py --model /tmp/dsv32 --make deepseek-v3.2 --no-transformers \
      --modes ${MODES:-async eager} --ttft 8192 32768 131072 --long-decode 16 --kv-gib 24 > $OUT/e2e_v32.log 2>&1
    tail -16 $OUT/e2e_v32.log ;;
  v4)
    [ -f /tmp/dsv4/config.json ] || python bench/checkpoints.py deepseek-v4-flash /tmp/dsv4 --layers 8 > $OUT/ckpt_v4.log 2>&1
    timeout ${T_E2E:-450} python bench/e2e.py --model /tmp/dsv4 --quick --no-transformers --modes ${MODES:-async eager} \
      --ttft ${V4_TTFT:-8192 131072} --long-decode 16 ${E2E_ARGS:-} > $OUT/e2e_v4.log 2>&1
    tail -12 $OUT/e2e_v4.log ;;
  *) echo "PART must be tests, v32 or v4, got ${PART}" ;;
esac
