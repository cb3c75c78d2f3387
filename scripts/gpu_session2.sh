#!/usr/bin/env bash
# One H100 call: the pipelined GRU stack benchmark, then scripts/gpu_pgru.sh (persistent GRU tests + grid).
# Carry .gpu, out/pgru, out/stack. Results: $OUT/stack.tgz and $OUT/pgru.tgz.
set +e
RES=/tmp/stack_res; rm -rf $RES; mkdir -p $RES
source .gpu/env.sh > $RES/env.log 2>&1 || { cat $RES/env.log; exit 1; }
export PYTHONUNBUFFERED=1
timeout 120 python3 -m tvmseq.bench.gru_stack --prebuilt out/stack --out $RES > $RES/stack.log 2>&1
echo "== stack"; grep -v "^wrote" $RES/stack.log | tail -9 | cut -c1-230
tar czf $OUT/stack.tgz -C $RES .
bash scripts/gpu_pgru.sh
