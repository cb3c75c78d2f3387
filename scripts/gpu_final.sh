#!/usr/bin/env bash
# Last H100 call of session 2: pipelined stack variants, per-step GRU (tiled step GEMM) tests + grid,
# recurrent GEMM tests + grid + schedule sweep. Carry .gpu out/stack out/gru out/rg. -> $OUT/final.tgz
set +e
RES=/tmp/final_res; rm -rf $RES; mkdir -p $RES
source .gpu/env.sh > $RES/env.log 2>&1 || { cat $RES/env.log; exit 1; }
export PYTHONUNBUFFERED=1
timeout 100 python3 -m tvmseq.bench.gru_stack --prebuilt out/stack --out $RES > $RES/stack.log 2>&1
echo "== stack"; grep -v "^wrote" $RES/stack.log | tail -11 | cut -c1-200
timeout 60 python3 -m pytest -m gpu -q -rf tests/test_gpu_gru.py -k prebuilt -p no:cacheprovider > $RES/gru_pytest.log 2>&1
echo "== gru pytest"; tail -2 $RES/gru_pytest.log
timeout 170 python3 -m tvmseq.bench.gru --prebuilt out/gru --out $RES --no-sweep > $RES/gru.log 2>&1
echo "== gru"; grep -E "^ *float" $RES/gru.log | tail -50 | cut -c1-170
timeout 40 python3 -m pytest -m gpu -q -rf tests/test_recurrent_gemm.py -p no:cacheprovider > $RES/rg_pytest.log 2>&1
echo "== rg pytest"; tail -2 $RES/rg_pytest.log
timeout 120 python3 -m tvmseq.bench.recurrent_gemm --prebuilt out/rg --sweep --out $RES > $RES/rg.log 2>&1
echo "== rg"; grep -E "^ *[0-9]+ +[0-9]+ +float" $RES/rg.log | cut -c1-150 | head -45
tar czf $OUT/final.tgz -C $RES .
