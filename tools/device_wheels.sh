#!/usr/bin/env bash
# Wheels the H200 image lacks (fla-core for KDA and Gated DeltaNet, einops, its one need; llguidance for
# structured outputs, an abi3 wheel), downloaded into
# .whl (ignored through .git/info/exclude) for a device call to carry: run(carry=[".whl"]) and begin the
# command with: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#   --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit;
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 -d .whl "fla-core==0.6.0" "einops==0.8.1" "llguidance==1.9.1" \
  jsonschema jsonschema-specifications referencing rpds-py  # jsonschema: the structured-output tests
ls -la .whl
