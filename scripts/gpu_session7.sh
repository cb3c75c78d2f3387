#!/usr/bin/env bash
# Session 7 on the H100, runtime-only TVM (carry .gpu and the out/ payloads built here):
#   bash scripts/gpu_session7.sh A   cluster_sync GPU cases (out/pmma) + sanitizers on them, the TMA projection
#                                    sweep (out/tcproj10), the RNN bench (out/prnn7)
#   bash scripts/gpu_session7.sh B   the TMA projection's GPU cases (out/ptma) + memcheck, racecheck of two cluster_sync
#                                    cases (three did not finish in 150 s under racecheck)
# Results come back under $OUT.
set +e
PART=${1:-A}
source scripts/gpu_start.sh
CS_CASES="h250_b61 or h256_b37 or h200_b70 or h256_b7_ or h500_b66 or h250_b90"
if [ "$PART" = A ]; then
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 150 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; grep -E "FAILED|Error|passed|failed" $RES/pytest_pmma.log | tail -8 | cut -c1-300
  timeout 150 python3 scripts/tc_projection_sweep.py run out/tcproj10 > $RES/tcproj10.log 2>&1
  echo "tcproj rc=$?"; cp out/tcproj10/results.json $RES/tcproj10_results.json 2>/dev/null
  sed 's/.ptxas.*//' $RES/tcproj10.log | cut -c1-170 | tail -36
  timeout 150 python3 -m tvmseq.bench.persistent_rnn --prebuilt out/prnn7 --no-tests --out $RES > $RES/prnn.log 2>&1
  echo "prnn rc=$?"; tail -14 $RES/prnn.log | cut -c1-160
  timeout 100 compute-sanitizer --tool memcheck --print-limit 20 env TVMSEQ_PMMA_PREBUILT=out/pmma python3 -m pytest \
    -q -m gpu tests/test_persistent_mma.py -k "$CS_CASES" -p no:cacheprovider > $RES/cs_memcheck.log 2>&1
  echo "== memcheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/cs_memcheck.log | tail -3
elif [ "$PART" = B ]; then
  TVMSEQ_PTMA_PREBUILT=out/ptma timeout 100 python3 -m pytest -q -m gpu tests/test_projection_tma.py \
    -p no:cacheprovider 2>&1 | tail -2
  timeout 100 compute-sanitizer --tool memcheck --print-limit 10 env TVMSEQ_PTMA_PREBUILT=out/ptma python3 -m pytest \
    -q -m gpu tests/test_projection_tma.py -p no:cacheprovider > $RES/ptma_memcheck.log 2>&1
  echo "== memcheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/ptma_memcheck.log | tail -2
  timeout 300 compute-sanitizer --tool racecheck --print-limit 20 env TVMSEQ_PMMA_PREBUILT=out/pmma python3 -m pytest \
    -q -m gpu tests/test_persistent_mma.py -k "h256_b7_ or h250_b61" -p no:cacheprovider > $RES/cs_racecheck.log 2>&1
  echo "== racecheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/cs_racecheck.log | tail -3
fi
