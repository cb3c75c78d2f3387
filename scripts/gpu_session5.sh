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
fi
tar czf $OUT/session5_$PART.tgz -C $RES .
