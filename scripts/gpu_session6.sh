#!/usr/bin/env bash
# Session 6 on the H100, runtime-only TVM (carry .gpu and the out/ payloads built here):
#   bash scripts/gpu_session6.sh A   staged-state kernel with the image layout / clusters: gpu tests (out/pmma),
#                                    sweep (out/$SWEEP: pmma10-12), memcheck + racecheck of the image and
#                                    cluster cases (env SWEEP, CASES, RACE: the sweep and the sanitizers' -k)
#   bash scripts/gpu_session6.sh W   the warpgroup kernel: gpu cases (out/pwg), sweep (out/$WSWEEP), memcheck
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
elif [ "$PART" = P ]; then   # ncu of chosen sweep variants (env NCU_DIR, NCU_NAMES)
  timeout 400 ncu --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters \
    python3 scripts/pmma_profile.py out/$NCU_DIR $NCU_NAMES > $RES/ncu.log 2>&1
  echo "ncu rc=$?"; grep -E "m_(gru|rnn)|Throughput|Duration|Stall|Issued|Warp Cycles|Bank|Eligible|Active Warps|L2|Shared" $RES/ncu.log | cut -c1-150 | head -150
fi
tar czf $OUT/session6_$PART.tgz -C $RES .
