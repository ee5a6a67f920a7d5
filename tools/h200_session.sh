#!/usr/bin/env bash
# Device calls of the 2026-12-06 session (issues 29, 31, 32, 33, 34); every log lands in $OUT. Carry the
# wheels the image lacks (bash tools/device_wheels.sh: fla-core, llguidance):
#   run(command="PART=tests bash tools/h200_session.sh", carry=[".whl"])
# PART (one per call, each within a call's 600 s):
#   tests   the GPU tests of the session's changes: NCCL at world size 1 with per-rank graphs and the expert
#           dispatch, the engine's graph and CUDA tests, the new families (GLM-4.x, Qwen3.5) and their fla GDN
#           kernels, Kimi K2.5's encoder kernel and images on CUDA, constrained decoding with graphs + async
#   bench   the gpt-oss-20b-shaped checkpoint: dayzero bench with and without --json-schema (the cost of
#           constrained decoding), bench/structured.py (the mask per step), and the OOM recovery test
#   vision  bench/vision.py on the Kimi K2.5-shaped checkpoint: encoder images/s at 1024x1024, one-image TTFT
#   multi       (kind nvidia-h200-x2) the NCCL tests: every family at tp 2 and ep 2 against one GPU, a killed rank
#   multibench  (kind nvidia-h200-x2) bench/parallel.py: KIND=gpt-oss-20b (default) or KIND=deepseek-v4-flash
#               LAYERS=12; SPLITS (default 1x1 2x1 1x2), PAR_ARGS (more bench/parallel.py flags)
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${PART:-tests}" in
  tests)
    timeout -s INT ${T_A:-260} python -m pytest -q ${TESTS_A:-tests/parallel/test_nccl_world1.py tests/engine/test_graphs.py \
      tests/engine/test_cuda.py tests/engine/test_structured.py} -rfs > $OUT/tests_a.log 2>&1
    grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_a.log | tail -8
    timeout -s INT ${T_B:-250} python -m pytest -q ${TESTS_B:-tests/models/test_cuda.py tests/kernels/test_gdn_fla.py \
      tests/kernels/test_kda_fla.py tests/kernels/test_vision.py} -rfs > $OUT/tests_b.log 2>&1
    grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_b.log | tail -8 ;;
  bench)
    [ -f /tmp/gpt-oss-20b/config.json ] || { python bench/checkpoints.py gpt-oss-20b /tmp/gpt-oss-20b > $OUT/ckpt.log 2>&1 \
      && python bench/tokenizer.py /tmp/gpt-oss-20b >> $OUT/ckpt.log 2>&1; }
    tail -2 $OUT/ckpt.log
    B="python -m dayzero bench /tmp/gpt-oss-20b --device cuda --dtype bfloat16 --num-prompts 64 --input-len 128 \
      --output-len 64 --max-concurrency 1 64 --kv-cache-gib 8 --disable-tqdm"
    timeout ${T_PLAIN:-120} $B --output-file $OUT/plain.json > $OUT/bench_plain.log 2>&1
    grep -E "concurrency|Output token|Median TPOT" $OUT/bench_plain.log
    timeout ${T_JSON:-150} $B --json-schema --output-file $OUT/json.json > $OUT/bench_json.log 2>&1
    grep -E "concurrency|Output token|Median TPOT" $OUT/bench_json.log
    timeout ${T_MASK:-60} python bench/structured.py --tokenizer /tmp/gpt-oss-20b --device cuda > $OUT/structured.log 2>&1
    tail -8 $OUT/structured.log
    [ -n "${OOM_TEST:-}" ] && timeout ${T_OOM:-120} python -m pytest -q $OOM_TEST -rs > $OUT/oom.log 2>&1
    [ -n "${OOM_TEST:-}" ] && tail -15 $OUT/oom.log ;;
  vision)
    timeout ${T_VISION:-300} python bench/vision.py --model /tmp/kimi-k25 --make ${VISION_ARGS:-} > $OUT/vision.log 2>&1
    tail -20 $OUT/vision.log ;;
  all)
    TESTS_R="${ALL_TESTS}" PART=rerun bash "$0"
    T_MASK=${T_MASK:-1} PART=bench bash "$0"
    PART=vision bash "$0" ;;
  multi)  # issue 30, on nvidia-h200-x2 (two GPUs, NCCL): every family split against one GPU, a rank killed
    timeout -s INT ${T_MULTI:-500} python -m pytest -q tests/parallel/test_nccl_multi_gpu.py tests/parallel/test_nccl_world1.py \
      -rfs > $OUT/multi.log 2>&1
    grep -E "^FAILED|^ERROR|passed|failed" $OUT/multi.log | tail -12 ;;
  multibench)  # issue 30: decode tok/s of each split at batch 1 / 64 / 256 against one GPU, the collectives' share
    KIND=${KIND:-gpt-oss-20b}; M=${MODEL_DIR:-/tmp/$KIND}
    timeout ${T_PAR:-560} python bench/parallel.py --model $M --make $KIND ${LAYERS:+--layers $LAYERS} \
      --splits ${SPLITS:-1x1 2x1 1x2} ${PAR_ARGS:-} --json $OUT/parallel-$KIND.json > $OUT/parallel-$KIND.log 2>&1
    grep -vE "^\[parallel\]|USDT" $OUT/parallel-$KIND.log | tail -14 ;;
  rerun)
    timeout -s INT ${T_R:-200} python -m pytest -q ${TESTS_R} -rfs > $OUT/rerun.log 2>&1
    grep -E "^FAILED|^ERROR|passed|failed" $OUT/rerun.log | tail -12 ;;
  *) echo "PART must be tests, rerun, bench, vision, multi or multibench, got ${PART}" ;;
esac
# PART=all (the session's last call): ALL_TESTS rerun, then bench without structured.py, then vision
