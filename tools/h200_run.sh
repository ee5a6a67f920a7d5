#!/usr/bin/env bash
# One device call: the GPU tests of the engine, the graph-step profile, bench/e2e.py and dayzero bench
# on the gpt-oss-20b-shaped checkpoint; every log lands in $OUT as it is written.
set -u
python bench/checkpoints.py gpt-oss-20b /tmp/gpt-oss-20b > $OUT/ckpt.log 2>&1 & CK=$!
timeout ${T_TESTS:-150} python -m pytest -q ${TESTS:-tests/engine/test_graphs.py tests/engine/test_cuda.py} > $OUT/tests.log 2>&1
tail -4 $OUT/tests.log
wait $CK
timeout ${T_PROF:-120} python tools/profile_graph_step.py /tmp/gpt-oss-20b --batch 1 64 > $OUT/prof.log 2>&1
grep -E "^batch|host|capture" $OUT/prof.log
timeout ${T_E2E:-200} python bench/e2e.py --model /tmp/gpt-oss-20b --quick --modes graphs --ttft > $OUT/e2e.log 2>&1
tail -12 $OUT/e2e.log
timeout ${T_BENCH:-120} python -m dayzero bench /tmp/gpt-oss-20b --device cuda --dtype bfloat16 --num-prompts 64 \
  --input-len 128 --output-len 64 --max-concurrency 1 64 --kv-cache-gib 8 --disable-tqdm --output-file $OUT/bench.json > $OUT/bench.log 2>&1
tail -40 $OUT/bench.log
