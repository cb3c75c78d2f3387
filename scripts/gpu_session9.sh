#!/usr/bin/env bash
# Session 9 on the H100, runtime-only TVM (carry .gpu and the out/ payloads built here):
#   bash scripts/gpu_session9.sh G   the GRU grid vs cuDNN (out/$PGRU; RUNS processes per dtype in DTYPES)
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
