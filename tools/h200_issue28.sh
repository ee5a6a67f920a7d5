#!/usr/bin/env bash
# One device call for issue 28's kernels (DSA indexer + sparse MLA, KDA via fla-core) and the long-prompt
# TTFT: the GPU tests, bench/dsa.py, bench/attention.py's prefill rows and a 128K TTFT on the
# gpt-oss-20b-shaped checkpoint; logs land in $OUT. Carry the wheels of tools/device_wheels.sh:
#   bash tools/device_wheels.sh    (here, once), then run(command="bash tools/h200_issue28.sh", carry=[".whl"])
set -u
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python bench/checkpoints.py gpt-oss-20b /tmp/gpt-oss-20b > $OUT/ckpt.log 2>&1 & CK=$!
timeout ${T_TESTS:-240} python -m pytest -q tests/kernels/test_dsa_index.py tests/kernels/test_attention_mla.py \
  tests/kernels/test_kda_fla.py tests/engine/test_cuda.py -rs > $OUT/tests.log 2>&1
grep -E "^FAILED|^SKIPPED|passed|failed" $OUT/tests.log | tail -12
timeout ${T_DSA:-150} python bench/dsa.py --quick > $OUT/dsa.log 2>&1; tail -12 $OUT/dsa.log
wait $CK
timeout ${T_E2E:-120} python bench/e2e.py --model /tmp/gpt-oss-20b --quick --no-transformers --modes async \
  --ttft 16384 131008 > $OUT/e2e.log 2>&1; tail -8 $OUT/e2e.log
