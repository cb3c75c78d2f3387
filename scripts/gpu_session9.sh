#!/usr/bin/env bash
# Session 9 on the H100, runtime-only TVM (carry .gpu and the out/ payloads built here):
#   bash scripts/gpu_session9.sh G   the GRU grid vs cuDNN (out/$PGRU; RUNS processes per dtype in DTYPES)
#   bash scripts/gpu_session9.sh V   the engine's reduction padding: A/B (out/redab3), the persistent GRU GPU tests
#                                    (out/$PGRU) with memcheck and racecheck of two of them, the recurrent GEMM (out/$RG)
#                                    and RNN (out/$PRNN) GPU tests
#   bash scripts/gpu_session9.sh T   GPU tests: whole models through the importer (out/$GM), the warpgroup kernels'
#                                    prebuilt cases (out/$PWG) with memcheck
# Results come back under $OUT.
set +e
PART=${1:-G}
source scripts/gpu_start.sh
if [ "$PART" = G ]; then   # the GRU grid (out/$PGRU) in RUNS processes per dtype
  for run in ${RUNS:-1}; do
    for dt in ${DTYPES:-float32 float16}; do
      mkdir -p $RES/grid_${dt}_$run
      timeout ${GRID_T:-170} python3 -m tvmseq.bench.persistent_gru --prebuilt out/${PGRU:-pgru9} --dtype $dt \
        --out $RES/grid_${dt}_$run --budget $(( ${GRID_T:-170} - 20 )) > $RES/pgru_${dt}_$run.log 2>&1
      echo "pgru $dt run $run rc=$?"; tail -26 $RES/pgru_${dt}_$run.log | cut -c1-150
    done
  done
  # few files come back from a call: the runs' JSON and logs as one archive
  (cd $RES && tar czf grids.tgz grid_*/persistent_gru.json pgru_*.log && rm -rf grid_* pgru_*.log)
elif [ "$PART" = V ]; then
  [ -d out/redab3 ] && { timeout 120 python3 scripts/reduce_ab.py run out/redab3 2>&1 | tail -6 | cut -c1-160; cp out/redab3/results.json $RES/results_redab3.json; }
  TVMSEQ_PGRU_PREBUILT=out/$PGRU timeout 200 python3 -m pytest -q -m gpu tests/test_persistent_gru.py -p no:cacheprovider \
    > $RES/pytest_pgru.log 2>&1; echo "pgru tests: $(tail -1 $RES/pytest_pgru.log)"; grep -E "FAILED" $RES/pytest_pgru.log | head
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool $tool --print-limit 20 env TVMSEQ_PGRU_PREBUILT=out/$PGRU python3 -m pytest -q -m gpu \
      tests/test_persistent_gru.py -k "${SAN_CASES:-h1024_b64 or float16_h1024_b8}" -p no:cacheprovider > $RES/pgru_$tool.log 2>&1
    echo "== $tool rc=$?: $(grep -E "SUMMARY" $RES/pgru_$tool.log | tail -1) $(grep -E "passed|failed" $RES/pgru_$tool.log | tail -1)"
  done
  [ -n "$RG" ] && { TVMSEQ_RG_PREBUILT=out/$RG timeout 200 python3 -m pytest -q -m gpu tests/test_recurrent_gemm.py -p no:cacheprovider \
    > $RES/pytest_rg.log 2>&1; echo "rg tests: $(tail -1 $RES/pytest_rg.log)"; grep FAILED $RES/pytest_rg.log | head; }
  [ -n "$PRNN" ] && { TVMSEQ_PRNN_PREBUILT=out/$PRNN timeout 200 python3 -m pytest -q -m gpu tests/test_persistent_rnn_gpu.py -p no:cacheprovider \
    > $RES/pytest_prnn.log 2>&1; echo "prnn tests: $(tail -1 $RES/pytest_prnn.log)"; grep FAILED $RES/pytest_prnn.log | head; }
elif [ "$PART" = T ]; then
  if [ -n "$GM" ]; then
    TVMSEQ_GPU_MODELS=out/$GM timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_models.py \
      -p no:cacheprovider > $RES/pytest_models.log 2>&1; tail -1 $RES/pytest_models.log
    grep -E "FAILED|Error" $RES/pytest_models.log | head -10 | cut -c1-300
  fi
  if [ -n "$PWG" ]; then
    TVMSEQ_PWG_PREBUILT=out/$PWG timeout 200 python3 -m pytest -q -m gpu tests/test_persistent_wgmma.py \
      -p no:cacheprovider > $RES/pytest_pwg.log 2>&1; tail -1 $RES/pytest_pwg.log
    grep -E "FAILED|Error" $RES/pytest_pwg.log | head -10 | cut -c1-300
    timeout 250 compute-sanitizer --tool memcheck --print-limit 20 env TVMSEQ_PWG_PREBUILT=out/$PWG python3 -m pytest \
      -q -m gpu tests/test_persistent_wgmma.py -k "${MEM_CASES:-fp16_gate or gate_dtype}" -p no:cacheprovider > $RES/pwg_memcheck.log 2>&1
    echo "== memcheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/pwg_memcheck.log | tail -3
  fi
fi
