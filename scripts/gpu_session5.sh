#!/usr/bin/env bash
# Session 5 on the H100, runtime-only TVM (carry .gpu and the out/ payloads built here):
#   bash scripts/gpu_session5.sh A   staged-state kernel: gpu tests (out/pmma), sweep (out/pmma5, out/pmma5r),
#                                    compute-sanitizer on the float32 cases, ncu of chosen variants
#   bash scripts/gpu_session5.sh F   final: gpu tests, whole models, GRU grid (out/pgru5), RNN bench (out/prnn5)
# Results come back as $OUT/session5_<part>.tgz.
set +e
PART=${1:-A}
source .gpu/env.sh || exit 1
export PYTHONUNBUFFERED=1
RES=/tmp/res5_$PART; rm -rf $RES; mkdir -p $RES
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $RES/gpu.txt
if [ "$PART" = A ]; then
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 150 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; tail -1 $RES/pytest_pmma.log
  for d in pmma5 pmma5r; do
    timeout 200 python3 scripts/pmma_sweep.py run out/$d > $RES/sweep_$d.log 2>&1
    echo "sweep $d rc=$?"; cp out/$d/results.json $RES/results_$d.json 2>/dev/null
    cut -c1-150 $RES/sweep_$d.log | grep -v "^ *$" | tail -40
  done
  for tool in memcheck racecheck; do
    TVMSEQ_PMMA_PREBUILT=out/pmma timeout 240 compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest \
      -q -m gpu tests/test_persistent_mma.py -k "f32" -p no:cacheprovider > $RES/pmma_f32_$tool.log 2>&1
    echo "== $tool rc=$?"; grep -E "SUMMARY|passed|failed" $RES/pmma_f32_$tool.log | tail -3
  done
  if [ -n "$NCU_NAMES" ]; then
    timeout 200 ncu --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section LaunchStats python3 scripts/pmma_profile.py out/pmma5 $NCU_NAMES > $RES/ncu.log 2>&1
    echo "ncu rc=$?"; grep -E "m_|Throughput|Duration|Stall|Issued|Warp Cycles|Hit Rate|Eligible" $RES/ncu.log | head -80
  fi
elif [ "$PART" = B ]; then
  timeout 330 python3 scripts/pmma_sweep.py run out/pmma6 > $RES/sweep_pmma6.log 2>&1
  echo "sweep pmma6 rc=$?"; cp out/pmma6/results.json $RES/results_pmma6.json 2>/dev/null
  cut -c1-130 $RES/sweep_pmma6.log | grep -v "^ *$" | sed 's/.max_err.*ok/ ok/' | tail -60
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 200 compute-sanitizer --tool racecheck --print-limit 20 python3 -m pytest \
    -q -m gpu tests/test_persistent_mma.py -k "f32 and (h136 or h333)" -p no:cacheprovider > $RES/pmma_f32_racecheck.log 2>&1
  echo "== racecheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/pmma_f32_racecheck.log | tail -3
elif [ "$PART" = D ]; then   # sweep 7 (early_gate) + ncu stall reasons of two picks
  timeout 200 python3 scripts/pmma_sweep.py run out/pmma7 > $RES/sweep_pmma7.log 2>&1
  echo "sweep pmma7 rc=$?"; cp out/pmma7/results.json $RES/results_pmma7.json 2>/dev/null
  cut -c1-130 $RES/sweep_pmma7.log | grep -v "^ *$" | sed 's/.max_err.*ok/ ok/' | tail -40
  timeout 200 ncu -k regex:m_ --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,gpu__time_duration.sum" \
    python3 scripts/pmma_profile.py out/pmma7 $NCU_NAMES > $RES/ncu_stalls.log 2>&1
  echo "ncu rc=$?"; grep -E "m_|stalled|issue_active|lts__t|duration" $RES/ncu_stalls.log | awk '$NF+0 > 0.05 || /m_/' | head -80
elif [ "$PART" = E ]; then   # bulk staging: GPU cases, sanitizers on the bulk cases, sweep 8
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 150 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; tail -3 $RES/pytest_pmma.log | cut -c1-300
  timeout 120 compute-sanitizer --tool memcheck --print-limit 20 env TVMSEQ_PMMA_PREBUILT=out/pmma python3 -m pytest \
    -q -m gpu tests/test_persistent_mma.py -k "h300 or h129_b21 or h136_b47 or h256_b51" -p no:cacheprovider > $RES/bulk_memcheck.log 2>&1
  echo "== memcheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/bulk_memcheck.log | tail -3
  timeout 150 compute-sanitizer --tool racecheck --print-limit 20 env TVMSEQ_PMMA_PREBUILT=out/pmma python3 -m pytest \
    -q -m gpu tests/test_persistent_mma.py -k "h300 or h136_b47" -p no:cacheprovider > $RES/bulk_racecheck.log 2>&1
  echo "== racecheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/bulk_racecheck.log | tail -3
  timeout 200 python3 scripts/pmma_sweep.py run out/pmma8 > $RES/sweep_pmma8.log 2>&1
  echo "sweep pmma8 rc=$?"; cp out/pmma8/results.json $RES/results_pmma8.json 2>/dev/null
  cut -c1-130 $RES/sweep_pmma8.log | grep -v "^ *$" | sed 's/.max_err.*ok/ ok/' | tail -40
elif [ "$PART" = H ]; then   # final: models (float2 projection epilogue), projection tiles, the GRU grid
  TVMSEQ_GPU_MODELS=out/gm5 timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_models.py \
    -p no:cacheprovider > $RES/pytest_models.log 2>&1; tail -1 $RES/pytest_models.log
  timeout 60 python3 scripts/tc_projection_sweep.py run out/tcproj6 > $RES/tcproj6.log 2>&1
  echo "tcproj rc=$?"; cp out/tcproj6/results.json $RES/results_tcproj6.json; cut -c1-160 $RES/tcproj6.log
  timeout 400 python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru5 --out $RES --budget 360 > $RES/pgru.log 2>&1
  echo "pgru rc=$?"; grep -E "^ *(float|dtype)" $RES/pgru.log | sort -u | awk '!seen[$1 $2 $3 $4]++' | cut -c1-140
elif [ "$PART" = R ]; then   # the RNN bench with the final database, and the GRU grid once more (cuDNN's spread)
  timeout 150 python3 -m tvmseq.bench.persistent_rnn --prebuilt out/prnn5 --no-tests --out $RES > $RES/prnn.log 2>&1
  echo "prnn rc=$?"; tail -16 $RES/prnn.log | cut -c1-160
  mkdir -p $RES/grid3
  timeout 400 python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru5 --out $RES/grid3 --budget 360 > $RES/pgru3.log 2>&1
  echo "pgru rc=$?"; grep -E "^ *(float|dtype)" $RES/pgru3.log | sort -u | awk '!seen[$1 $2 $3 $4]++' | cut -c1-140
elif [ "$PART" = S9 ]; then   # sweep 9 (float32 product registers/unroll) + the GPU cases
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 150 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; tail -1 $RES/pytest_pmma.log
  timeout 200 python3 scripts/pmma_sweep.py run out/pmma9 > $RES/sweep_pmma9.log 2>&1
  echo "sweep pmma9 rc=$?"; cp out/pmma9/results.json $RES/results_pmma9.json 2>/dev/null
  cut -c1-130 $RES/sweep_pmma9.log | grep -v "^ *$" | sed 's/.max_err.*ok/ ok/' | tail -40
elif [ "$PART" = F ]; then   # the final build: whole models, the GRU grid twice (two processes: cuDNN's spread)
  TVMSEQ_GPU_MODELS=out/gm5 timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_models.py \
    -p no:cacheprovider > $RES/pytest_models.log 2>&1; tail -1 $RES/pytest_models.log
  for run in ${RUNS:-4 5}; do
    mkdir -p $RES/grid$run
    timeout 250 python3 -m tvmseq.bench.persistent_gru --prebuilt out/${PGRU:-pgru_final5} --out $RES/grid$run --budget 220 \
      > $RES/pgru$run.log 2>&1
    echo "pgru run $run rc=$?"; grep -E "^ *(float|dtype)" $RES/pgru$run.log | sort -u | awk '!seen[$1 $2 $3 $4]++' | cut -c1-140
  done
elif [ "$PART" = T ]; then   # the wgmma projection against the mma.sync one and cuBLAS
  timeout 120 python3 scripts/tc_projection_sweep.py run out/${TCDIR:-tcproj7} > $RES/tcproj.log 2>&1
  echo "tcproj rc=$?"; cp out/${TCDIR:-tcproj7}/results.json $RES/results_tcproj.json; cut -c1-170 $RES/tcproj.log
elif [ "$PART" = P ]; then   # tvmseq bench input_projection (fp16 rows: the importer's tensor-core kernel too)
  timeout 200 python3 -m tvmseq.bench.input_projection --prebuilt out/proj5 --out $RES > $RES/proj.log 2>&1
  echo "proj rc=$?"; tail -16 $RES/proj.log | cut -c1-250
elif [ "$PART" = C ]; then   # checks of the final build + the RNN bench + the projection tile sweep
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 150 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; tail -1 $RES/pytest_pmma.log
  TVMSEQ_GPU_MODELS=out/gm5 timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_models.py \
    -p no:cacheprovider > $RES/pytest_models.log 2>&1; tail -1 $RES/pytest_models.log
  for tool in memcheck racecheck; do
    TVMSEQ_PMMA_PREBUILT=out/pmma timeout 150 compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest \
      -q -m gpu tests/test_persistent_mma.py -k "h520 or h1000" -p no:cacheprovider > $RES/pmma_wide_$tool.log 2>&1
    echo "== $tool rc=$?"; grep -E "SUMMARY|passed|failed" $RES/pmma_wide_$tool.log | tail -3
  done
  timeout 60 python3 scripts/tc_projection_sweep.py run out/tcproj5 > $RES/tcproj5.log 2>&1
  echo "tcproj rc=$?"; cp out/tcproj5/results.json $RES/results_tcproj5.json; cut -c1-160 $RES/tcproj5.log
  timeout 150 python3 -m tvmseq.bench.persistent_rnn --prebuilt out/prnn5 --no-tests --out $RES > $RES/prnn.log 2>&1
  echo "prnn rc=$?"; tail -16 $RES/prnn.log | cut -c1-160
elif [ "$PART" = G ]; then   # the GRU grid, both dtypes
  timeout 560 python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru5 --out $RES --budget 520 > $RES/pgru.log 2>&1
  echo "pgru rc=$?"; grep -E "^ *(float|dtype)" $RES/pgru.log | sort -u | awk '!seen[$1 $2 $3 $4]++' | cut -c1-140
fi
tar czf $OUT/session5_$PART.tgz -C $RES .
