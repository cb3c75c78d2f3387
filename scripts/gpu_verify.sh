#!/usr/bin/env bash
# Short H100 check after a rebuild of out/pgru: GPU tests + the fp32 grid (uni, bi). -> $OUT/verify.tgz
set +e
RES=/tmp/verify_res; rm -rf $RES; mkdir -p $RES
source .gpu/env.sh > $RES/env.log 2>&1 || { cat $RES/env.log; exit 1; }
export PYTHONUNBUFFERED=1
timeout 60 python3 -m pytest -m gpu -q -rf tests/test_persistent_gru.py -p no:cacheprovider > $RES/pytest.log 2>&1; tail -1 $RES/pytest.log
B="python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru --out $RES --config-timeout 20 --load-timeout 40"
for dir in uni bi; do
  timeout 75 $B --dtype float32 --bidirectional $dir --budget 60 > "$RES/bench_float32_${dir}.log" 2>&1
  mv "$RES/persistent_gru.json" "$RES/persistent_gru_float32_${dir}.json" 2>/dev/null
  echo "== $dir"; grep -v "^wrote" "$RES/bench_float32_${dir}.log" | tail -13 | cut -c1-170
done
tar czf $OUT/verify.tgz -C $RES .
