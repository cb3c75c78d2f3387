#!/usr/bin/env bash
# Session 4 on the H100, runtime-only TVM (carry .gpu and the out/ payloads built here):
#   bash scripts/gpu_session4.sh A   tensor-core persistent GRU/RNN: gpu tests (out/pmma), compute-sanitizer
#                                    fp16 whole models vs onnxruntime (out/gpu_models16), fp16 GRU grid vs cuDNN
#                                    (out/pgru16)
#   bash scripts/gpu_session4.sh F   final: gpu tests, fp16 models, both dtypes' GRU grid (out/pgru_final), RNN bench
#                                    (out/prnn4)
#   bash scripts/gpu_session4.sh S   compute-sanitizer memcheck/racecheck on the odd-size tensor-core kernels
# Results come back as $OUT/session4_<part>.tgz.
set +e
PART=${1:-A}
source .gpu/env.sh || exit 1
export PYTHONUNBUFFERED=1
RES=/tmp/res4_$PART; rm -rf $RES; mkdir -p $RES
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $RES/gpu.txt
if [ "$PART" = A ]; then
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 150 python3 -m pytest -q -m gpu -rs tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; tail -15 $RES/pytest_pmma.log | cut -c1-300
  TVMSEQ_GPU_MODELS=out/gpu_models16 timeout 120 python3 -m pytest -q -m gpu -rs tests/test_gpu_models.py -k fp16 \
    -p no:cacheprovider > $RES/pytest_models16.log 2>&1; tail -3 $RES/pytest_models16.log | cut -c1-300
  timeout 420 python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru16 --dtype float16 --out $RES \
    --budget 380 > $RES/pgru16.log 2>&1
  echo "pgru16 rc=$?"; grep -E "^ *(float|dtype)" $RES/pgru16.log | sort -u | tail -30
elif [ "$PART" = F ]; then
  TVMSEQ_PMMA_PREBUILT=out/pmma timeout 150 python3 -m pytest -q -m gpu tests/test_persistent_mma.py \
    -p no:cacheprovider > $RES/pytest_pmma.log 2>&1; tail -1 $RES/pytest_pmma.log
  TVMSEQ_GPU_MODELS=out/gpu_models16 timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_models.py -k fp16 \
    -p no:cacheprovider > $RES/pytest_models16.log 2>&1; tail -1 $RES/pytest_models16.log
  timeout 300 python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru_final --out $RES --budget 260 \
    > $RES/pgru.log 2>&1
  echo "pgru rc=$?"; grep -E "^ *(float|dtype)" $RES/pgru.log | sort -u | awk '!seen[$1 $2 $3 $4]++' | cut -c1-140
  timeout 200 python3 -m tvmseq.bench.persistent_rnn --prebuilt out/prnn4 --no-tests --out $RES > $RES/prnn.log 2>&1
  echo "prnn rc=$?"; tail -16 $RES/prnn.log | cut -c1-160
elif [ "$PART" = S ]; then
  for tool in memcheck racecheck; do
    TVMSEQ_PMMA_PREBUILT=out/pmma timeout 200 compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest \
      -q -m gpu tests/test_persistent_mma.py -k "h200 or h129 or h333 or h160 or h64_b99 or h300 or h136 or rnn_bidirectional_h512" -p no:cacheprovider > $RES/pmma_$tool.log 2>&1
    echo "== $tool rc=$?"; grep -E "SUMMARY|passed|failed" $RES/pmma_$tool.log | tail -3
  done
fi
tar czf $OUT/session4_$PART.tgz -C $RES .
