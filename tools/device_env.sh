# Sourced by the device-call scripts: the carried wheels (tools/device_wheels.sh) installed into /tmp/site,
# the repository on PYTHONPATH, Python's output unbuffered.
set -u
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=${PYTHONPATH:-}:.
