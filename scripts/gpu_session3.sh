#!/usr/bin/env bash
# Session 3 on the H100, runtime-only TVM (carry .gpu and the out/ payloads built here):
#   bash scripts/gpu_session3.sh A   persistent GRU grid (out/pgru3: tiled input projection) + its gpu tests,
#                                    input projection bench (out/proj)
#   bash scripts/gpu_session3.sh C   whole ONNX models (out/gpu_models, ~56 MB: alone) + compute-sanitizer
#   bash scripts/gpu_session3.sh D   GRU grid with the row-padded projection (out/pgru6), per-step tile sweep (out/gru3)
#   bash scripts/gpu_session3.sh B   persistent RNN gpu test + bench (out/prnn), GRU stack bench rerun
#                                    (out/stack2), persistent GRU schedule sweep (out/sweep)
# Results come back as $OUT/session3_<part>.tgz.
set +e
PART=${1:-A}
source .gpu/env.sh || exit 1
export PYTHONUNBUFFERED=1
RES=/tmp/res3_$PART; rm -rf $RES; mkdir -p $RES
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $RES/gpu.txt
if [ "$PART" = A ]; then
  TVMSEQ_PGRU_PREBUILT=out/pgru3 timeout 120 python3 -m pytest -q -m gpu tests/test_persistent_gru.py \
    -p no:cacheprovider > $RES/pytest_pgru.log 2>&1; tail -2 $RES/pytest_pgru.log
  timeout 90 python3 -m tvmseq.bench.input_projection --prebuilt out/proj --out $RES > $RES/proj.log 2>&1
  echo "proj rc=$?"; tail -12 $RES/proj.log
  timeout 400 python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru3 --out $RES --budget 330 \
    > $RES/pgru.log 2>&1
  echo "pgru rc=$?"; grep -E "^ *(float|dtype)" $RES/pgru.log | sort -u | tail -52
elif [ "$PART" = C ]; then
  TVMSEQ_GPU_MODELS=out/gpu_models timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_models.py \
    -p no:cacheprovider > $RES/pytest_models.log 2>&1; tail -4 $RES/pytest_models.log
  for tool in memcheck racecheck; do
    TVMSEQ_GPU_MODELS=out/gpu_models timeout 150 compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest \
      -q -m gpu tests/test_gpu_models.py -k "gru_b8_h1024 or stack" -p no:cacheprovider > $RES/models_$tool.log 2>&1
    echo "== $tool rc=$?"; grep -E "SUMMARY|passed|failed" $RES/models_$tool.log | tail -3
  done
elif [ "$PART" = D ]; then
  timeout 200 python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru6 --out $RES --budget 170 \
    > $RES/pgru.log 2>&1
  echo "pgru rc=$?"; grep -E "^ *(float|dtype)" $RES/pgru.log | sort -u | tail -52
  timeout 150 python3 -m tvmseq.bench.gru --prebuilt out/gru3 --out $RES --sweep-only > $RES/gru_sweep.log 2>&1
  echo "gru sweep rc=$?"; tail -34 $RES/gru_sweep.log
else
  TVMSEQ_PRNN_PREBUILT=out/prnn timeout 120 python3 -m pytest -q -m gpu -rs tests/test_persistent_rnn_gpu.py \
    -p no:cacheprovider > $RES/pytest_prnn.log 2>&1; tail -3 $RES/pytest_prnn.log
  timeout 200 python3 -m tvmseq.bench.persistent_rnn --prebuilt out/prnn --out $RES > $RES/prnn.log 2>&1
  echo "prnn rc=$?"; tail -16 $RES/prnn.log
  timeout 150 python3 -m tvmseq.bench.gru_stack --prebuilt out/stack2 --out $RES > $RES/stack.log 2>&1
  echo "stack rc=$?"; grep -E "^ +[0-9]" $RES/stack.log | sort -u | tail -30
  timeout 170 python3 scripts/pgru_sweep.py run out/sweep 2>&1 | grep -v "LL timeout" | cut -c1-260 > $RES/sweep.log
  cp out/sweep/results.json $RES/sweep_results.json 2>/dev/null; tail -25 $RES/sweep.log
fi
tar czf $OUT/session3_$PART.tgz -C $RES .
