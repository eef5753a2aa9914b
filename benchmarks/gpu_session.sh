#!/usr/bin/env bash
# The one prepared script for a session lent a GPU: benchmarks/gpu.py (the table of issue 42), the
# CUDA tests, then where a step's time goes (benchmarks/profile_step.py, both processes under
# torch.profiler), in ~9 minutes on an H100. Prepare the wheels here first (once; .whl/ is
# gitignored), then run it through the device tool from the repository root, carrying them:
#
#   make gpu-wheels
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# The GPU image has torch 2.11+cu130 and an older transformers and reaches no registry: the
# wheels go to /tmp/site, on PYTHONPATH with the source tree. What comes back under $OUT (at most
# 10 files): device.txt, gpu.log, latest.json, latest.md, the run's dated JSON, graphs.log and
# graphs.json (the greedy rows with --decode-graphs 4), tests.log and profile.txt; copy the JSON and .md to benchmarks/results/gpu/ and commit them. GPU_ARGS adds
# arguments to gpu.py (default: 3 rounds, 1 repeat, 32 new tokens: the session's device time is
# short). Exit status: non-zero if the benchmark or the tests failed.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run 'make gpu-wheels' here and carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 2
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/device.txt"

# the GPU table; each finished phase is written at once (a run cut short keeps them)
timeout "${GPU_TIMEOUT:-230}" python3 benchmarks/gpu.py ${GPU_ARGS:---rounds 3 --repeats 1 --new-tokens 32} 2>&1 \
    | grep -v "Loading weights" | tee "$OUT/gpu.log"
bench=$?
cp benchmarks/results/gpu/latest.json benchmarks/results/gpu/latest.md "$OUT/" 2>/dev/null
dated=$(ls -t benchmarks/results/gpu/20*.json 2>/dev/null | head -1)
[ -n "$dated" ] && cp "$dated" "$OUT/"

# the greedy rows again with the decode's CUDA graphs (--decode-graphs, off by default until measured)
timeout "${GRAPHS_TIMEOUT:-100}" python3 benchmarks/gpu.py --phases greedy,decode --rounds 1 --repeats 1 --new-tokens 32 \
    --no-compile --server-args "--decode-graphs 4" --out /tmp/graphs 2>&1 | grep -v "Loading weights" \
    | tail -20 | tee "$OUT/graphs.log"
cp /tmp/graphs/latest.json "$OUT/graphs.json" 2>/dev/null

# the CUDA tests: the device region (0 host bytes), pinned TCP, the device digest, the memory model,
# the decode graphs' tokens, the server's host waits per route
timeout 120 python3 -m pytest -p no:cacheprovider -q -rs tests/test_transport_cuda.py tests/test_server_graphs.py \
    "tests/test_server_ledger.py::test_an_answer_on_the_gpu_is_digested_there_and_names_its_tensors" \
    "tests/test_server_ledger.py::test_a_gpu_answers_socket_body_is_one_pinned_copy" \
    "tests/test_server_budget.py::test_on_cuda_the_price_is_within_1_5x_of_the_measured_peak" \
    "tests/test_transport_unix.py::test_a_pipelined_piece_sent_again_goes_on_its_own_lane" 2>&1 | tee "$OUT/tests.log"
tests=$?

# where a unix:// training step's time goes: this process and the server's (--profile-dir)
timeout 60 python3 benchmarks/profile_step.py --device cuda --steps 3 --transports unix --torch-profile /tmp/prof \
    2>&1 | grep -v "Loading weights\|USDT" > /tmp/prof.log
{ cat /tmp/prof.log; echo "## client (this process)"; cat /tmp/prof/unix.txt; echo "## server"; cat /tmp/prof/server-profile.txt; } \
    > "$OUT/profile.txt" 2>&1
echo "benchmark: exit $bench; tests: exit $tests"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
