#!/usr/bin/env bash
# Row-split GRU stack on the H100 (carry .gpu and out/stack2, built here by
# `python3 -m tvmseq.bench.gru_stack --build out/stack2`): the benchmark (k-split and row-split stacks, the
# single-layer row-split GRU, odd sizes) against layer-by-layer and cuDNN, the gpu test of the odd-size
# kernels, and compute-sanitizer memcheck/racecheck on them. Results come back as $OUT/stack_rows.tgz.
set +e
source .gpu/env.sh || exit 1
RES=/tmp/res_stack; rm -rf $RES; mkdir -p $RES
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $RES/gpu.txt
timeout 300 python3 -m tvmseq.bench.gru_stack --prebuilt out/stack2 --out $RES > $RES/bench.log 2>&1
echo "bench rc=$?"; grep -v "^ *layers" $RES/bench.log | tail -40
TVMSEQ_STACK_PREBUILT=out/stack2 timeout 120 python3 -m pytest -q -m gpu tests/test_persistent_stack.py -p no:cacheprovider 2>&1 | tail -3
cat > /tmp/check_odd.py <<'PY'
import json
from tvmseq.bench.common import PrebuiltModules
from tvmseq.bench.gru_stack import NAME, check_kernels
index = json.load(open("out/stack2/index.json"))
print("problems:", check_kernels(PrebuiltModules("out/stack2").get(f"{NAME}.so"), index, launches=1))
PY
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --print-limit 20 python3 /tmp/check_odd.py > $RES/$tool.log 2>&1
  echo "== $tool rc=$?"; grep -v "^$" $RES/$tool.log | tail -8
done
tar czf $OUT/stack_rows.tgz -C $RES .
