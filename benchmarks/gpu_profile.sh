#!/usr/bin/env bash
# A lent GPU's first call: where a split training step's time goes (benchmarks/profile_step.py,
# both sides under torch.profiler), then a short run of benchmarks/gpu.py (the phases most likely
# to fail on a device: XL training's memory, the compiled reference). ~5 minutes on an H100.
#
#   make gpu-wheels
#   run(command="bash benchmarks/gpu_profile.sh", carry=[".whl"], timeout_s=420)
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 2
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/device.txt"
{
timeout 150 python3 benchmarks/profile_step.py --device cuda --steps 8 --torch-profile "$OUT/prof" --trace
timeout 60 python3 benchmarks/profile_step.py --device cuda --steps 5 --wire float32 --transports unix
timeout 60 python3 benchmarks/profile_step.py --device cuda --steps 5 --micro 4
} 2>&1 | grep -v "Loading weights\|USDT" | tee "$OUT/prof.log"
rm -f "$OUT/prof/tcp.json"; gzip -f "$OUT/prof/unix.json"  # at most 8 files come back
mv "$OUT"/prof/* "$OUT"/ && rmdir "$OUT/prof"
{ timeout 100 python3 benchmarks/gpu.py --phases train-xl --rounds 2 --repeats 1 --out /tmp/gpu-xl
  timeout 100 python3 benchmarks/gpu.py --phases greedy --rounds 2 --repeats 1 --out /tmp/gpu-out
} 2>&1 | grep -v "Loading weights" | tee "$OUT/gpu.log"
ls -la "$OUT"
