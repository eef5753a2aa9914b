#!/usr/bin/env bash
# The one prepared script for a session lent a GPU: the CUDA tests, then benchmarks/gpu.py, in
# ~8 minutes on an H100. Prepare the wheels here first (once; .whl/ is gitignored), then run it
# through the device tool from the repository root, carrying them:
#
#   make gpu-wheels
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# The GPU image has torch 2.11+cu130 and an older transformers and reaches no registry: the
# wheels go to /tmp/site, on PYTHONPATH with the source tree. What comes back under $OUT (at most
# 8 files): device.txt, tests.log, gpu.log, latest.json, latest.md and the run's dated JSON; copy
# the last three to benchmarks/results/gpu/ and commit them. Exit status: non-zero if the tests or
# the benchmark failed.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run 'make gpu-wheels' here and carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 2
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/device.txt"

# the CUDA tests: the device region, devices, the memory model against the measured peak (~1 min)
timeout 180 python3 -m pytest -p no:cacheprovider -q -rs tests/test_transport_cuda.py tests/test_devices.py \
    "tests/test_server_budget.py::test_on_cuda_the_price_is_within_1_5x_of_the_measured_peak" 2>&1 | tee "$OUT/tests.log"
tests=$?

# the GPU table (at most ~7 minutes)
timeout 420 python3 benchmarks/gpu.py 2>&1 | tee "$OUT/gpu.log"
bench=$?
cp benchmarks/results/gpu/latest.json benchmarks/results/gpu/latest.md "$OUT/" 2>/dev/null
dated=$(ls -t benchmarks/results/gpu/20*.json 2>/dev/null | head -1)
[ -n "$dated" ] && cp "$dated" "$OUT/"
echo "tests: exit $tests; benchmark: exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
