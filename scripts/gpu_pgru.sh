#!/usr/bin/env bash
# Persistent GRU on the H100 (about 4 minutes): GPU tests of the prebuilt kernels, then the benchmark
# against torch.nn.GRU (cuDNN): fp32 unidirectional, fp32 bidirectional, fp16. Needs out/pgru (built on the
# CPU machine: python3 -m tvmseq.bench.persistent_gru --build out/pgru --ptxas) and .gpu/ (TVM runtime).
# Full logs go to $OUT (at most 8 files): pytest.log (environment first), bench_fp32_uni.log,
# bench_fp32_bi.log, bench_fp16.log, persistent_gru_fp32_uni.json, persistent_gru_fp32_bi.json,
# persistent_gru.json (fp16) and persistent_gru.png. Worst case (every limit hit) about 4.5 minutes.
set +e
OUT=${OUT:-/tmp/pgru_out}
mkdir -p "$OUT"
source .gpu/env.sh > "$OUT/pytest.log" 2>&1 || { cat "$OUT/pytest.log"; exit 1; }
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"
  ls -la out/pgru; } >> "$OUT/pytest.log" 2>&1
# 1. correctness of the 8 test kernels (each launched twice; every failure prints its reason)
timeout 90 python3 -m pytest -m gpu -q -rf tests/test_persistent_gru.py -p no:cacheprovider >> "$OUT/pytest.log" 2>&1
tail -12 "$OUT/pytest.log"
# 2. benchmark: every config in a worker process that the supervisor kills after 20 s without a result
#    (recorded as status=timeout, then the next config); the JSON is rewritten after every row
B="python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru --out $OUT --config-timeout 20 --load-timeout 40"
timeout 100 $B --dtype float32 --bidirectional uni --budget 75 > "$OUT/bench_fp32_uni.log" 2>&1
mv "$OUT/persistent_gru.json" "$OUT/persistent_gru_fp32_uni.json" 2>/dev/null
timeout 60 $B --dtype float32 --bidirectional bi --budget 35 > "$OUT/bench_fp32_bi.log" 2>&1
mv "$OUT/persistent_gru.json" "$OUT/persistent_gru_fp32_bi.json" 2>/dev/null
timeout 50 $B --dtype float16 --quick --budget 25 > "$OUT/bench_fp16.log" 2>&1
for f in bench_fp32_uni bench_fp32_bi bench_fp16; do echo "== $f"; grep -v "^wrote" "$OUT/$f.log" | tail -14; done
