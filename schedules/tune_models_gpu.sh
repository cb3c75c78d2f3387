#!/usr/bin/env bash
# What MetaSchedule tuning of the stock operators buys on whole models (issue #22, item 4): for each benchmark
# architecture (tvmseq/bench/architectures.py: exported from torch.nn here) at each batch size, `tvmseq tune`
# (tvmseq.tune.model.tune_model, imported as the bench compiles it: lifted weights, exposed state) at the static
# shape [frames, batch, ...], then the same static shapes compiled with the default schedules and with the
# database, both timed (plain and in a CUDA graph) in one process next to PyTorch and onnxruntime:
# `tvmseq bench model --tune TRIALS --static-only` (columns tvmseq_static_ms, tvmseq_tuned_ms, tuned_speedup, ...).
#
# Runs on the GPU machine with TVM's FULL compiler (tuning builds and measures candidates there): in this
# checkout `../shared/gpu/stage` (no --runtime), carry .gpu, then from the checkout's root:
#   source .gpu/env.sh && bash schedules/tune_models_gpu.sh
# Writes under $OUT (default /tmp/tune_models): tune_models.log (everything), bench/model.json + model.png (the
# rows), tuning_db/ (the MetaSchedule database: `tvmseq compile --tuned` takes it), gpu.txt.
#
# Knobs (environment): ARCHES (default denoiser,crnn,vad,asr: tuned in this order while the budget lasts),
# BATCH (1,8), FRAMES (100), TRIALS (measured candidates per model and batch, default 64), TASKS (heaviest
# functions tuned per model and batch, default 4: 16 candidates each, one round, which the 16 build workers take
# in one go), STRATEGY (default replay-trace: with no xgboost on the GPU machine the cost model is random, and
# the evolutionary search's 2048-schedule population per round would cost seconds for nothing), TUNE_BUDGET
# (seconds of tuning in all, default 200: the models and batches past it are compiled with what the database
# holds, i.e. no record, and show a ratio of ~1), T (wall limit of the whole run, default 500 s), DRY_BUILD=DIR
# (a machine without a GPU: the build half only, into DIR, to check the plumbing: MetaSchedule builds its
# candidates but cannot run them, so the database gets no valid record and the tuned builds equal the default).
# MODELS="a.onnx b.onnx.xz" (ONNX files, xz-compressed allowed): after the architectures, each model as shipped
# (`tvmseq bench model FILE --tune ...`, weights embedded, every symbolic dim at FRAMES, one row per model)
# against onnxruntime, in the time the wall limit leaves (the architectures get ARCH_T = T - 150 s then; give
# them less tuning too: TUNE_BUDGET=110). Of the corpus (tests/corpus.py) only gtcrn fits a call beside the
# full compiler: 535 KB, 100 KB as .xz (out/tune_models/gtcrn_simple.onnx.xz, not committed: carry it); the
# others are 1-10 MB even compressed.
# Expected: ~7-8 minutes with the defaults on an H100 host (16 cores): ~3.5 min tuning (8 runs of ~25-30 s, the
# first ~15 s more for MetaSchedule's tensor-intrinsic registry), ~3 min exporting and compiling 16 static
# builds, ~1 min timing. Everything before the timing is building: if the wall limit cuts the run there, no row
# is measured, so lower TUNE_BUDGET rather than raise T past the 10-minute call.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
RES=${OUT:-/tmp/tune_models}
mkdir -p "$RES"
PY=${PYTHON:-python3}
ARCHES=${ARCHES:-denoiser,crnn,vad,asr}
BATCH=${BATCH:-1,8}
FRAMES=${FRAMES:-100}
TRIALS=${TRIALS:-64}
TASKS=${TASKS:-4}
TUNE_BUDGET=${TUNE_BUDGET:-200}
STRATEGY=${STRATEGY:-replay-trace}
T=${T:-500}
ARCH_T=${ARCH_T:-$([ -n "${MODELS:-}" ] && echo $((T - 150)) || echo "$T")}   # the architectures' share of T
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | tee "$RES/gpu.txt"
if ! $PY -c 'import sys, tvm; sys.exit(1 if tvm.base._RUNTIME_ONLY else 0)'; then
  echo "TVM runtime only in .gpu: tuning compiles and measures here; stage without --runtime" >&2
  exit 1
fi
echo "tune_models: arches $ARCHES, batch $BATCH, frames $FRAMES, $TRIALS trials x $TASKS tasks per model and batch," \
  "tuning budget ${TUNE_BUDGET} s, wall limit ${T} s; start $(date -u +%T)"
start=$(date +%s)
# one process: the TVM import and MetaSchedule's tensor-intrinsic registry (~15 s) are paid once, and every
# default/tuned pair is timed in the same process
timeout "$ARCH_T" $PY -m tvmseq.cli bench model --arch "$ARCHES" --batch "$BATCH" --frames "$FRAMES" \
  --tune "$TRIALS" --tune-tasks "$TASKS" --tune-budget "$TUNE_BUDGET" --tune-strategy "$STRATEGY" \
  --tuned "$RES/tuning_db" --static-only --ort-budget 0.5 --out "$RES/bench" ${DRY_BUILD:+--build "$DRY_BUILD"} \
  > "$RES/tune_models.log" 2>&1
rc=$?
cut=""; [ $rc = 124 ] && cut=": the wall limit cut it; the rows printed so far are in the log"
echo "bench model (architectures) rc=$rc in $(( $(date +%s) - start )) s$cut"
for m in ${MODELS:-}; do
  left=$(( T - ($(date +%s) - start) ))
  stem=$(basename "${m%.xz}" .onnx)
  if [ $left -lt 60 ]; then echo "== $stem skipped: $left s left of $T"; continue; fi
  file=$m
  if [ "${m%.xz}" != "$m" ]; then
    mkdir -p /tmp/tune_models_onnx; file=/tmp/tune_models_onnx/$stem.onnx; xz -dc "$m" > "$file" || continue
  fi
  mstart=$(date +%s)
  timeout "$left" $PY -m tvmseq.cli bench model "$file" --batch 1 --frames "${FRAMES%%,*}" --tune "$TRIALS" \
    --tune-tasks "$TASKS" --tune-strategy "$STRATEGY" --tuned "$RES/tuning_db" --static-only --ort-budget 0.5 \
    --out "$RES/bench_$stem" ${DRY_BUILD:+--build "$DRY_BUILD/$stem"} >> "$RES/tune_models.log" 2>&1
  echo "== $stem rc=$? in $(( $(date +%s) - mstart )) s"
done
# progress and the table: tuning lines, what each database schedules, then the bench's own table
grep -E "^  .*(tune: [0-9]+ task|tune: done|not tuned|schedules [0-9]+ function)|: (built|FAILED)|^ *model |wrote|Error|error:" \
  "$RES/tune_models.log" | cut -c1-240 | tail -80
# a compact summary even when the run was cut short (from the JSON rows printed as each was measured)
$PY - "$RES/tune_models.log" <<'EOF'
import json, sys
rows = []
for line in open(sys.argv[1], errors="replace"):
    line = line.strip()
    if line.startswith("{") and '"model"' in line:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
cols = ["model", "batch", "frames", "tvmseq_static_ms", "tvmseq_tuned_ms", "tuned_speedup", "tvmseq_static_graph_ms",
        "tvmseq_tuned_graph_ms", "tuned_graph_speedup", "tuned_functions", "tune_seconds", "torch_graph_ms", "ort_cpu_ms",
        "max_err", "failed"]
def fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)
print("summary (default schedules vs MetaSchedule-tuned, static shapes, same process):")
print(" | ".join(cols))
for r in rows:
    print(" | ".join(fmt(r.get(c)) for c in cols))
if not rows:
    print("(no rows measured)")
EOF
exit $rc
