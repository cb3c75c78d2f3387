#!/usr/bin/env bash
# H100: the pipelined GRU stack benchmark, the recurrent GEMM grid + schedule sweep, and the recurrent
# GEMM GPU tests (carry .gpu, out/stack, out/rg; built here with `python3 -m tvmseq.bench.gru_stack --build
# out/stack` and `python3 -m tvmseq.bench.recurrent_gemm --build out/rg`). Results: $OUT/stack_rg.tgz.
set +e
RES=/tmp/srg_res; rm -rf $RES; mkdir -p $RES
source .gpu/env.sh > $RES/env.log 2>&1 || { cat $RES/env.log; exit 1; }
export PYTHONUNBUFFERED=1
timeout 150 python3 -m tvmseq.bench.gru_stack --prebuilt out/stack --out $RES > $RES/stack.log 2>&1
echo "== stack"; tail -10 $RES/stack.log | cut -c1-220
timeout 60 python3 -m pytest -m gpu -q -rf tests/test_recurrent_gemm.py -p no:cacheprovider > $RES/rg_pytest.log 2>&1
echo "== rg pytest"; tail -2 $RES/rg_pytest.log
timeout 200 python3 -m tvmseq.bench.recurrent_gemm --prebuilt out/rg --sweep --dtype float32,float16 --out $RES > $RES/rg.log 2>&1
echo "== rg"; grep -E "^ *[0-9]+ +[0-9]+ +float" $RES/rg.log | cut -c1-200 | head -60
tar czf $OUT/stack_rg.tgz -C $RES .
