#!/usr/bin/env bash
# Prepared in session 10 for the H100 (the GPU machine was withdrawn before it ran), runtime-only TVM (carry .gpu
# and the out/ payloads). Build here first, in this order (each step reads the databases the one before merged):
#   tvmseq tune persistent_gru build out/psw          # 32 cells (GRU, RNN) x (model, database, per (blocks, warps) 2 + fewest passes)
#   ... S, then: tvmseq tune persistent_gru merge $RES/psw_results.json
#   tvmseq tune persistent_mma build out/pmma         # the staged-state variants + the (re-tuned) engine beside them
#   ... P, then: append $RES/pmma_results.json to artifacts/bench/pmma_sweep.json; tvmseq tune persistent_mma merge
#   python -m tvmseq.bench.persistent_gru --build out/pgru11     # the grid with the merged picks
#   tvmseq tune step_gemm build out/sg11              # incl. 16 (tile, split) pairs for fp32 bi H1024 B64
#   bash scripts/gpu_session10.sh S|P|G|B ...   (several parts run in order; T_S, T_P, T_B: their time limits in s)
set +e
source scripts/gpu_start.sh
for PART in "${@:-S}"; do
case "$PART" in
  S) timeout ${T_S:-500} python3 scripts/pgru_sweep.py run out/${PSW:-psw} 2>&1 | grep -v '^{' | tail -30
     cp out/${PSW:-psw}/results.json $RES/psw_results.json ;;
  P) timeout ${T_P:-500} python3 schedules/tune_persistent_mma.py run out/${PMMA:-pmma} 2>&1 | tail -40 | cut -c1-200
     cp out/${PMMA:-pmma}/results.json $RES/pmma_results.json ;;
  G) RUNS="${RUNS:-1 2 3}" PGRU=${PGRU:-pgru11} bash scripts/gpu_session9.sh G ;;
  B) timeout ${T_B:-500} python3 -m tvmseq.bench.gru --prebuilt out/${SG:-sg11} --sweep-only --out $RES/sg > $RES/sg.log 2>&1
     echo "step-GEMM sweep rc=$?"; tail -30 $RES/sg.log | cut -c1-200 ;;
esac
done
