#!/usr/bin/env bash
# Session 8 on the H100, runtime-only TVM (carry .gpu and the out/ payloads built here):
#   bash scripts/gpu_session8.sh A   persistent_mma GPU cases (out/pmma, 8 new dsmem cases) + memcheck of the dsmem
#                                    cases, sweep 15 (out/pmma15: dsmem vs cluster_sync) and the SIMT engine at the
#                                    same small batches (out/peng15)
#   bash scripts/gpu_session8.sh P   sweep 15b (out/pmma15 rebuilt: the bidirectional picks added) + the engine again
#                                    (out/peng15), ncu warp stalls of cluster_sync vs dsmem (NCU_NAMES)
#   bash scripts/gpu_session8.sh G   the GRU grid vs cuDNN (out/pgru10; RUNS processes per dtype)
#   bash scripts/gpu_session8.sh F   final code: persistent_mma GPU cases (out/pmma) + memcheck of the dsmem cases and the
#                                    0/1/2-step test, the dsmem sweep re-timed (out/pmma16), the SIMT engine's H1024 B8
#                                    configs (out/psweep8, built by scripts/pgru_sweep.py's build with that dict)
#   bash scripts/gpu_session8.sh R   whole models through the importer (out/gm8), racecheck of two dsmem cases, the
#                                    RNN bench with its odd-size GPU tests (out/prnn8)
# Results come back under $OUT.
set +e
PART=${1:-A}
source scripts/gpu_start.sh
DS_CASES="rnn_reverse_h250_b61 or h256_b39 or h200_b29 or h256_b1_ or gru_forward_h256_b64 or h250_b7_ or h500_b50 or h136_b23"
if [ "$PART" = A ]; then
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 150 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; grep -E "FAILED|Error|passed|failed" $RES/pytest_pmma.log | tail -12 | cut -c1-300
  for sw in ${SWEEPS:-pmma15 peng15}; do
    timeout 120 python3 scripts/pmma_sweep.py run out/$sw > $RES/$sw.log 2>&1
    echo "sweep $sw rc=$?"; cp out/$sw/results.json $RES/results_$sw.json 2>/dev/null
    cut -c1-130 $RES/$sw.log | grep -v "^ *$" | sed 's/.max_err.*ok/ ok/'
  done
  timeout 150 compute-sanitizer --tool memcheck --print-limit 20 env TVMSEQ_PMMA_PREBUILT=out/pmma python3 -m pytest \
    -q -m gpu tests/test_persistent_mma.py -k "$DS_CASES" -p no:cacheprovider > $RES/ds_memcheck.log 2>&1
  echo "== memcheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/ds_memcheck.log | tail -3
elif [ "$PART" = P ]; then
  for sw in ${SWEEPS:-pmma15 peng15}; do
    timeout 120 python3 scripts/pmma_sweep.py run out/$sw > $RES/$sw.log 2>&1
    echo "sweep $sw rc=$?"; cp out/$sw/results.json $RES/results_$sw.json 2>/dev/null
    cut -c1-130 $RES/$sw.log | grep -v "^ *$" | sed 's/.max_err.*ok/ ok/'
  done
  timeout 300 ncu -k regex:"^m_" --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum" \
    python3 scripts/pmma_profile.py out/pmma15 $NCU_NAMES > $RES/ncu_stalls.log 2>&1
  echo "ncu stalls rc=$?"; grep -E "m_(gru|rnn)|stalled|issue_active|duration" $RES/ncu_stalls.log | awk '$NF+0 > 0.1 || /m_(gru|rnn)/' | cut -c1-130 | head -90
elif [ "$PART" = G ]; then   # the GRU grid (out/$PGRU) in RUNS processes per dtype
  for run in ${RUNS:-1}; do
    for dt in ${DTYPES:-float32 float16}; do
      mkdir -p $RES/grid_${dt}_$run
      timeout ${GRID_T:-170} python3 -m tvmseq.bench.persistent_gru --prebuilt out/${PGRU:-pgru10} --dtype $dt \
        --out $RES/grid_${dt}_$run --budget $(( ${GRID_T:-170} - 20 )) > $RES/pgru_${dt}_$run.log 2>&1
      echo "pgru $dt run $run rc=$?"; tail -26 $RES/pgru_${dt}_$run.log | cut -c1-150
    done
  done
  # few files come back from a call: the runs' JSON and logs as one archive
  (cd $RES && tar czf grids.tgz grid_*/persistent_gru.json pgru_*.log && rm -rf grid_* pgru_*.log)
elif [ "$PART" = F ]; then
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 150 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider 2>&1 | tail -1
  timeout 200 compute-sanitizer --tool memcheck --print-limit 20 env TVMSEQ_PMMA_PREBUILT=out/pmma python3 -m pytest \
    -q -m gpu tests/test_persistent_mma.py -k "short_sequences or $DS_CASES" -p no:cacheprovider 2>&1 \
    | grep -E "SUMMARY|passed|failed" | tail -3
  timeout 120 python3 scripts/pmma_sweep.py run out/pmma16 > $RES/pmma16.log 2>&1; echo "sweep rc=$?"
  cp out/pmma16/results.json $RES/results_pmma16.json
  if [ -d out/psweep8 ]; then
    timeout 400 python3 scripts/pgru_sweep.py run out/psweep8 > $RES/psweep.log 2>&1; echo "engine sweep rc=$?"
    cp out/psweep8/results.json $RES/results_psweep8.json
  fi
elif [ "$PART" = R ]; then   # whole models (out/gm8), racecheck of two dsmem cases, the RNN bench (out/prnn8)
  TVMSEQ_GPU_MODELS=out/${GM:-gm8s} timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_models.py \
    -p no:cacheprovider > $RES/pytest_models.log 2>&1; tail -1 $RES/pytest_models.log
  timeout 150 compute-sanitizer --tool racecheck --print-limit 20 env TVMSEQ_PMMA_PREBUILT=out/pmma python3 -m pytest \
    -q -m gpu tests/test_persistent_mma.py -k "${RACE_CASES:-h256_b1_ or h250_b7_}" -p no:cacheprovider > $RES/ds_racecheck.log 2>&1
  echo "== racecheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/ds_racecheck.log | tail -3
  timeout 200 python3 -m tvmseq.bench.persistent_rnn --prebuilt out/${PRNN:-prnn8} --out $RES > $RES/prnn.log 2>&1
  echo "prnn rc=$?"; tail -16 $RES/prnn.log | cut -c1-160
fi
