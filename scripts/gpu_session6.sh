#!/usr/bin/env bash
# Session 6 on the H100, runtime-only TVM (carry .gpu and the out/ payloads built here):
#   bash scripts/gpu_session6.sh A   staged-state kernel with the image layout / clusters: gpu tests (out/pmma),
#                                    sweep (out/$SWEEP: pmma10-12), memcheck + racecheck of the image and
#                                    cluster cases (env SWEEP, CASES, RACE: the sweep and the sanitizers' -k)
#   bash scripts/gpu_session6.sh W   the warpgroup kernel: gpu cases (out/pwg), sweep (out/$WSWEEP), memcheck
#   bash scripts/gpu_session6.sh G   grid barrier probe (out/gsync), the GRU grid (out/$PGRU, runs $RUNS)
#   bash scripts/gpu_session6.sh B   grid barrier A/B (out/pmma13a|b, out/pwg3a|b), GPU cases, sanitizers
#   bash scripts/gpu_session6.sh F   final: GPU cases, models (out/gm6), sanitizers, GRU grid x RUNS, RNN bench
#   bash scripts/gpu_session6.sh Z   warpgroup kernel final build: cases, sanitizers, sweep w4, fp16 grid (out/pgru8)
#   bash scripts/gpu_session6.sh T   final code: GPU cases (out/pmma, out/pwg) and models (out/gm6s)
#   bash scripts/gpu_session6.sh P   ncu of sweep variants (env NCU_DIR, NCU_NAMES)
# Results come back as $OUT/session6_<part>.tgz.
set +e
PART=${1:-A}
SWEEP=${SWEEP:-pmma11}
source .gpu/env.sh || exit 1
export PYTHONUNBUFFERED=1
RES=/tmp/res6_$PART; rm -rf $RES; mkdir -p $RES
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $RES/gpu.txt
IMAGE_CASES=${CASES:-"h1024_b60 or h1016 or h500_b90 or h250_b23 or (h1024_b64_nolens) or h512_b64_lens_f32 or h128_b47"}
RACE_CASES=${RACE:-"h500_b90 or h128_b47 or h250_b23"}
if [ "$PART" = A ]; then
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 150 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; grep -E "FAILED|Error|passed|failed" $RES/pytest_pmma.log | tail -8 | cut -c1-300
  timeout 240 python3 scripts/pmma_sweep.py run out/$SWEEP > $RES/sweep_$SWEEP.log 2>&1
  echo "sweep $SWEEP rc=$?"; cp out/$SWEEP/results.json $RES/results_$SWEEP.json 2>/dev/null
  cut -c1-150 $RES/sweep_$SWEEP.log | grep -v "^ *$" | sed 's/.max_err.*ok/ ok/' | tail -45
  for tool in memcheck racecheck; do
    [ $tool = racecheck ] && IMAGE_CASES=$RACE_CASES   # racecheck: the small ones
    timeout 110 compute-sanitizer --tool $tool --print-limit 20 env TVMSEQ_PMMA_PREBUILT=out/pmma python3 -m pytest \
      -q -m gpu tests/test_persistent_mma.py -k "$IMAGE_CASES" -p no:cacheprovider > $RES/image_$tool.log 2>&1
    echo "== $tool rc=$?"; grep -E "SUMMARY|passed|failed" $RES/image_$tool.log | tail -3
  done
elif [ "$PART" = W ]; then   # the warpgroup kernel: gpu cases (out/pwg), its sweep (out/$WSWEEP), memcheck
  TVMSEQ_PWG_PREBUILT=out/pwg timeout 120 python3 -m pytest -q -m gpu tests/test_persistent_wgmma.py \
    -p no:cacheprovider > $RES/pytest_pwg.log 2>&1; grep -E "FAILED|Error|passed|failed" $RES/pytest_pwg.log | tail -8 | cut -c1-300
  timeout 200 python3 scripts/pmma_sweep.py run out/${WSWEEP:-pwg2} > $RES/sweep_wg.log 2>&1
  echo "sweep ${WSWEEP:-pwg2} rc=$?"; cp out/${WSWEEP:-pwg2}/results.json $RES/results_${WSWEEP:-pwg2}.json 2>/dev/null
  cut -c1-150 $RES/sweep_wg.log | grep -v "^ *$" | sed 's/.max_err.*ok/ ok/' | tail -30
  timeout 120 compute-sanitizer --tool memcheck --print-limit 20 env TVMSEQ_PWG_PREBUILT=out/pwg python3 -m pytest \
    -q -m gpu tests/test_persistent_wgmma.py -p no:cacheprovider > $RES/pwg_memcheck.log 2>&1
  echo "== memcheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/pwg_memcheck.log | tail -3
elif [ "$PART" = G ]; then   # the grid barrier's cost, then the GRU grid (env PGRU, RUNS) on the final build
  timeout 60 python3 scripts/grid_sync_probe.py run out/gsync > $RES/gsync.log 2>&1; echo "gsync rc=$?"; cat $RES/gsync.log
  cp out/gsync/results.json $RES/gsync.json 2>/dev/null
  for run in ${RUNS:-1}; do
    mkdir -p $RES/grid$run
    timeout 270 python3 -m tvmseq.bench.persistent_gru --prebuilt out/${PGRU:-pgru6} --out $RES/grid$run --budget 240 \
      > $RES/pgru$run.log 2>&1
    echo "pgru run $run rc=$?"; grep -E "^ *(float|dtype)" $RES/pgru$run.log | sort -u | awk '!seen[$1 $2 $3 $4]++' | cut -c1-140
  done
elif [ "$PART" = B ]; then   # A/B of the grid barrier: sweeps built before (a) and after (b), one process each,
  # alternating; the GPU cases of both kernels on the new barrier; memcheck + racecheck on small cases
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 120 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; tail -1 $RES/pytest_pmma.log
  TVMSEQ_PWG_PREBUILT=out/pwg timeout 120 python3 -m pytest -q -m gpu tests/test_persistent_wgmma.py \
    -p no:cacheprovider > $RES/pytest_pwg.log 2>&1; tail -1 $RES/pytest_pwg.log
  for d in pmma13a pmma13b pwg3a pwg3b pmma13a pmma13b pwg3a pwg3b; do
    timeout 100 python3 scripts/pmma_sweep.py run out/$d > $RES/sweep_$d.log 2>&1
    cp out/$d/results.json $RES/results_${d}_$(date +%s).json
    echo "== $d"; cut -c1-120 $RES/sweep_$d.log | grep -v "^ *$" | sed 's/.max_err.*ok/ ok/'
  done
  timeout 100 compute-sanitizer --tool memcheck --print-limit 20 env TVMSEQ_PWG_PREBUILT=out/pwg python3 -m pytest \
    -q -m gpu tests/test_persistent_wgmma.py -p no:cacheprovider > $RES/pwg_memcheck.log 2>&1
  echo "== pwg memcheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/pwg_memcheck.log | tail -2
  timeout 150 compute-sanitizer --tool racecheck --print-limit 20 env TVMSEQ_PWG_PREBUILT=out/pwg python3 -m pytest \
    -q -m gpu tests/test_persistent_wgmma.py -k "h136 or h300 or h256_b150" -p no:cacheprovider > $RES/pwg_racecheck.log 2>&1
  echo "== pwg racecheck rc=$?"; grep -E "SUMMARY|passed|failed" $RES/pwg_racecheck.log | tail -2
elif [ "$PART" = F ]; then   # the final build: GPU cases of both kernels, whole models, sanitizers on the warpgroup
  # kernel, the GRU grid in $RUNS processes (out/$PGRU), the RNN bench (out/prnn6)
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 120 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; tail -1 $RES/pytest_pmma.log
  TVMSEQ_PWG_PREBUILT=out/pwg timeout 120 python3 -m pytest -q -m gpu tests/test_persistent_wgmma.py \
    -p no:cacheprovider > $RES/pytest_pwg.log 2>&1; tail -1 $RES/pytest_pwg.log
  TVMSEQ_GPU_MODELS=out/gm6s timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_models.py \
    -p no:cacheprovider > $RES/pytest_models.log 2>&1; grep -E "FAILED|passed|failed" $RES/pytest_models.log | tail -3
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool --print-limit 20 env TVMSEQ_PWG_PREBUILT=out/pwg python3 -m pytest \
      -q -m gpu tests/test_persistent_wgmma.py -k "h136 or h300 or h256_b150 or h1024_b64" -p no:cacheprovider \
      > $RES/pwg_$tool.log 2>&1
    echo "== pwg $tool rc=$?"; grep -E "SUMMARY|passed|failed" $RES/pwg_$tool.log | tail -2
  done
  for run in ${RUNS:-1 2 3}; do
    mkdir -p $RES/grid$run
    timeout 200 python3 -m tvmseq.bench.persistent_gru --prebuilt out/${PGRU:-pgru7} --out $RES/grid$run --budget 180 \
      > $RES/pgru$run.log 2>&1
    echo "pgru run $run rc=$?"
  done
  timeout 150 python3 -m tvmseq.bench.persistent_rnn --prebuilt out/prnn6 --no-tests --out $RES > $RES/prnn.log 2>&1
  echo "prnn rc=$?"; tail -14 $RES/prnn.log | cut -c1-160
elif [ "$PART" = D ]; then   # racecheck diagnosis of the warpgroup kernel (out/pwgdiag, tag $TAG)
  for k in ${KS:-b150u b64 b150}; do
    timeout 100 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 6 python3 \
      scripts/_pwg_diag_run.py out/pwgdiag ${TAG:-a} _$k > $RES/diag_$k.log 2>&1
    echo "== $k rc=$?"; grep -E "SUMMARY|ran" $RES/diag_$k.log | tail -3
    grep -v "Host Frame" $RES/diag_$k.log | grep -A7 -m3 "Error\|Warning" | cut -c1-200
  done
elif [ "$PART" = Z ]; then   # the warpgroup kernel's final build: GPU cases, memcheck + racecheck of all of them,
  # sweep w4 (out/pwg4), the float16 GRU grid on the final build (out/pgru8) in $RUNS processes
  TVMSEQ_PWG_PREBUILT=out/pwg timeout 120 python3 -m pytest -q -m gpu tests/test_persistent_wgmma.py \
    -p no:cacheprovider > $RES/pytest_pwg.log 2>&1; tail -1 $RES/pytest_pwg.log
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --print-limit 20 env TVMSEQ_PWG_PREBUILT=out/pwg python3 -m pytest \
      -q -m gpu tests/test_persistent_wgmma.py -p no:cacheprovider > $RES/pwg_$tool.log 2>&1
    echo "== pwg $tool rc=$?"; grep -E "SUMMARY|passed|failed" $RES/pwg_$tool.log | tail -2
  done
  timeout 100 python3 scripts/pmma_sweep.py run out/${WSWEEP:-pwg5} > $RES/sweep_wg.log 2>&1
  echo "sweep ${WSWEEP:-pwg5} rc=$?"; cp out/${WSWEEP:-pwg5}/results.json $RES/results_${WSWEEP:-pwg5}.json 2>/dev/null
  cut -c1-120 $RES/sweep_wg.log | grep -v "^ *$" | sed 's/.max_err.*ok/ ok/'
  for run in ${RUNS:-1 2}; do
    mkdir -p $RES/grid$run
    timeout 150 python3 -m tvmseq.bench.persistent_gru --prebuilt out/${PGRU:-pgru8} --dtype float16 --out $RES/grid$run \
      --budget 130 > $RES/pgru$run.log 2>&1
    echo "pgru run $run rc=$?"
  done
elif [ "$PART" = R ]; then   # more grid runs of the final builds: float16 (out/pgru8) x RUNS, float32 (out/pgru7) x 1
  for run in ${RUNS:-3 4}; do
    mkdir -p $RES/grid$run
    timeout 150 python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru8 --dtype float16 --out $RES/grid$run \
      --budget 130 > $RES/pgru$run.log 2>&1; echo "pgru fp16 run $run rc=$?"
  done
  mkdir -p $RES/grid32
  timeout 200 python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru7 --dtype float32 --out $RES/grid32 \
    --budget 170 > $RES/pgru32.log 2>&1; echo "pgru fp32 rc=$?"
elif [ "$PART" = T ]; then   # the final code's GPU cases of both staged-state kernels and the whole models
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 120 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; tail -1 $RES/pytest_pmma.log
  TVMSEQ_PWG_PREBUILT=out/pwg timeout 120 python3 -m pytest -q -m gpu tests/test_persistent_wgmma.py \
    -p no:cacheprovider > $RES/pytest_pwg.log 2>&1; tail -1 $RES/pytest_pwg.log
  TVMSEQ_GPU_MODELS=out/gm6s timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_models.py \
    -p no:cacheprovider > $RES/pytest_models.log 2>&1; tail -1 $RES/pytest_models.log
elif [ "$PART" = P ]; then   # ncu of chosen sweep variants (env NCU_DIR, NCU_NAMES)
  timeout 400 ncu --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters \
    python3 scripts/pmma_profile.py out/$NCU_DIR $NCU_NAMES > $RES/ncu.log 2>&1
  echo "ncu rc=$?"; grep -E "m_(gru|rnn)|Throughput|Duration|Stall|Issued|Warp Cycles|Bank|Eligible|Active Warps|L2|Shared" $RES/ncu.log | cut -c1-150 | head -150
  timeout 200 ncu -k regex:"^(m|w)_" --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed" \
    python3 scripts/pmma_profile.py out/$NCU_DIR $NCU_NAMES > $RES/ncu_stalls.log 2>&1
  echo "ncu stalls rc=$?"; grep -E "(m|w)_gru|stalled|issue_active|lts__t|duration|sm__throughput" $RES/ncu_stalls.log | awk '$NF+0 > 0.1 || /_gru/' | cut -c1-130 | head -60
fi
tar czf $OUT/session6_$PART.tgz -C $RES .
