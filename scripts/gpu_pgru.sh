#!/usr/bin/env bash
# Persistent GRU on the H100 (about 6 minutes): GPU tests of the prebuilt kernels, then the benchmark
# against torch.nn.GRU (cuDNN) over hidden {256,512,1024} x batch {1,8,64,256}, uni/bi, fp32/fp16.
# Needs out/pgru (built here: python3 -m tvmseq.bench.persistent_gru --build out/pgru --ptxas) and .gpu/.
# Logs and JSON go to $OUT/pgru.tgz.
set +e
RES=/tmp/pgru_res; rm -rf $RES; mkdir -p $RES
source .gpu/env.sh > "$RES/pytest.log" 2>&1 || { cat "$RES/pytest.log"; exit 1; }
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"; } >> "$RES/pytest.log" 2>&1
timeout 100 python3 -m pytest -m gpu -q -rf tests/test_persistent_gru.py -p no:cacheprovider >> "$RES/pytest.log" 2>&1
tail -4 "$RES/pytest.log"
B="python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru --out $RES --config-timeout 20 --load-timeout 40"
for dt in float32 float16; do for dir in uni bi; do
  timeout 100 $B --dtype $dt --bidirectional $dir --budget $([ $dt = float32 ] && echo 80 || echo 55) > "$RES/bench_${dt}_${dir}.log" 2>&1
  mv "$RES/persistent_gru.json" "$RES/persistent_gru_${dt}_${dir}.json" 2>/dev/null
  echo "== $dt $dir"; grep -v "^wrote" "$RES/bench_${dt}_${dir}.log" | tail -13 | cut -c1-200
done; done
tar czf $OUT/pgru.tgz -C $RES .
