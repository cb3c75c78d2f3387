#!/usr/bin/env bash
# GPU run for top-k (issue 6 follow-up): the GPU tests and the full benchmark grid (+ fp16 rows,
# + beam-search step) from the prebuilt CUDA kernels in out/topk_gpu. Logs, JSON and plot go to $OUT.
# Build the payload first on the CPU machine:
#   cd /work/main && PYTHONPATH=/work/main python3 -m tvmseq.bench.topk --build-only out/topk_gpu
# Run from the checkout root on the GPU machine, carrying .gpu and out/topk_gpu (~2 minutes).
set +e
source .gpu/env.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/topk_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.log"
TVMSEQ_TOPK_PREBUILT=$PWD/out/topk_gpu timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_topk.py 2>&1 | tail -20 | tee "$OUT/pytest_gpu_topk.log"
timeout 150 python3 -m tvmseq.bench.topk --prebuilt out/topk_gpu --fp16 --out "$OUT" 2>&1 \
  | tee "$OUT/bench_topk.log" | tail -75
