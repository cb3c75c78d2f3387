#!/usr/bin/env bash
# MetaSchedule's evolutionary search vs tvmseq's genetic search at 64/128/256 trials on the 2048^3 fp32 GEMM
# and the GRU input GEMM (schedules/compare_search.py), on the GPU machine WITH TVM's compiler: stage the full
# payload first (`../shared/gpu/stage`, no --runtime) and carry .gpu. The genetic curves are reused from
# artifacts/bench/search_compare.json (replayed on the pools measured on the H100); this run adds
# MetaSchedule's curves (random cost model, tvmseq's fast builder, 16 builder processes), then re-times both
# strategies' best schedules and cuBLAS the same way. MetaSchedule runs in rounds (every workload to 64
# trials, then 128, then 256) and starts no new batch after DEADLINE seconds (default 380). Measured on the
# H100 (2026-11-22): a 64-trial round takes 190-260 s for one workload (search 10 s, build 35-70 s, the
# runner the rest: its samples include 30-400 ms kernels), so one call of about 8 minutes gets ONE workload
# to 128 trials: run `--problems gemm2048` and `--problems gru_input` as separate calls, and carry the
# previous call's search_compare_work.tar.xz (see below) to go on to 256.
# Extra arguments go to compare_search.py (e.g. --problems gemm2048 --budgets 64,128); GPU_ENV names another
# env.sh (a payload staged elsewhere than .gpu). The full payload (~63.7 MB) plus the checkout must stay
# under the 64 MiB that travel: on 2026-11-22 it fitted only with tvm_rest.tar.xz repacked without tvm/src
# (C++ runtime sources, 0.2 MB of xz; out/gpufull/ holds that payload with its env.sh: GPU_ENV=out/gpufull/env.sh).
# Everything (JSON, png, log, MetaSchedule databases) comes back as $OUT/search_compare.tgz; then here:
#   mkdir -p /tmp/sc && tar xzf search_compare.tgz -C /tmp/sc && cp /tmp/sc/search_compare.{json,png} artifacts/bench/
#   cp /tmp/sc/search_compare_work.tar.xz out/      # (and carry it) to go on from there in the next run
set +e
FINAL=${OUT:-/tmp/search_compare_out}
mkdir -p "$FINAL"
RES=/tmp/search_compare; rm -rf $RES; mkdir -p $RES
source ${GPU_ENV:-.gpu/env.sh} > $RES/env.log 2>&1 || { cat $RES/env.log; exit 1; }
export PYTHONUNBUFFERED=1
if python3 -c 'import sys, tvm; sys.exit(0 if tvm.base._RUNTIME_ONLY else 1)'; then
  echo "TVM runtime only in .gpu: MetaSchedule needs TVM's compiler (run ../shared/gpu/stage without --runtime)"
  exit 1
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; echo "cores: $(nproc)"
  python3 -c "import torch; print('torch', torch.__version__)"; which nvcc; } >> $RES/env.log 2>&1
cat $RES/env.log
# MetaSchedule's databases: an earlier run's search_compare_work.tar.xz (10-50 KB; the databases themselves
# are too large to travel beside the full TVM payload), copied to out/ and carried, makes this run resume it
WORK=/tmp/search_compare_work; rm -rf $WORK; mkdir -p $WORK
[ -f out/search_compare_work.tar.xz ] && tar -xJf out/search_compare_work.tar.xz -C $WORK --strip-components=1 \
  && echo "resuming from out/search_compare_work.tar.xz: $(ls $WORK)"
timeout ${LIMIT:-520} python3 schedules/compare_search.py --out-dir $RES --work-dir $WORK \
  --deadline-s ${DEADLINE:-380} "$@" > $RES/compare.log 2>&1
echo "compare_search.py exit code $?" >> $RES/compare.log
# the progress lines (MetaSchedule's own task tables stay in the log)
grep -E "^==|^  |exit code|Error|error" $RES/compare.log | grep -v "^  *[0-9]* |" | tail -60
tar -cJf $RES/search_compare_work.tar.xz --exclude=logs -C /tmp search_compare_work
tar czf "$FINAL/search_compare.tgz" -C $RES --exclude='logs' --exclude='*.so' .
ls -la "$FINAL"
