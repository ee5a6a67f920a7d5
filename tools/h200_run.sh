#!/usr/bin/env bash
# One device call: the GPU tests of the engine, the graph-step profile, bench/e2e.py and dayzero bench
# on the gpt-oss-20b-shaped checkpoint; every log lands in $OUT as it is written. Skip a part with T_X=0;
# E2E_ARGS: bench/e2e.py flags (default "--ttft": no TTFT; e.g. "--modes graphs async --no-transformers --ttft 4096").
set -u
python bench/checkpoints.py gpt-oss-20b /tmp/gpt-oss-20b > $OUT/ckpt.log 2>&1 & CK=$!
timeout ${T_TESTS:-150} python -m pytest -q ${TESTS:-tests/engine/test_graphs.py tests/engine/test_cuda.py} > $OUT/tests.log 2>&1
grep -E "^FAILED|passed|failed" $OUT/tests.log | tail -8
wait $CK
[ -f /tmp/gpt-oss-20b/config.json ] || tail -5 $OUT/ckpt.log  # the checkpoint writer failed: say why
[ "${T_PROF:-120}" != 0 ] && timeout ${T_PROF:-120} python tools/profile_graph_step.py /tmp/gpt-oss-20b --batch 1 64 > $OUT/prof.log 2>&1
grep -E "^batch|host|capture|Error" $OUT/prof.log
[ "${T_E2E:-200}" != 0 ] && timeout ${T_E2E:-200} python bench/e2e.py --model /tmp/gpt-oss-20b --quick ${E2E_ARGS:---ttft} > $OUT/e2e.log 2>&1
tail -14 $OUT/e2e.log
[ "${T_BENCH:-120}" != 0 ] && timeout ${T_BENCH:-120} python -m dayzero bench /tmp/gpt-oss-20b --device cuda --dtype bfloat16 --num-prompts 64 \
  --input-len 128 --output-len 64 --max-concurrency 1 64 --kv-cache-gib 8 --disable-tqdm --output-file $OUT/bench.json > $OUT/bench.log 2>&1
grep -E "concurrency|Output token|Median TPOT|Median TTFT" $OUT/bench.log
