#!/usr/bin/env bash
# GPU session 1: demo, GPU tests, GRU benchmark (full TVM payload staged in .gpu)
set +e
source .gpu/env.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version(), 'tf32', torch.backends.cudnn.allow_tf32)"
python3 -m tvmseq.cli demo 2>&1 | tee $OUT/demo.log
timeout 240 python3 -m pytest -m gpu -q -x tests/test_gpu_gru.py -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/pytest_gpu.log
TVMSEQ_BENCH_DIR=$OUT timeout 300 python3 -m tvmseq.bench.gru 2>&1 | tee $OUT/bench_gru.log | tail -60
