#!/usr/bin/env bash
# Session 12 on the H100, runtime-only TVM (carry .gpu and the out/ payload the part reads). Built here first:
#   python3 scripts/overlap_probe.py build out/overlap               (part O)
#   python3 scripts/fused_projection_probe.py build out/fproj        (part F)
#   python tests/test_gpu_models.py out/gm1 NAMES... / out/gm2 NAMES...   (part M, GM=gm1|gm2: the 11 models are
#     93 MB together, over what a call carries, so they go in two halves)
# Usage: bash scripts/gpu_session12.sh O|F|M ...   Results come back under $OUT.
set +e
source scripts/gpu_start.sh
for PART in "$@"; do
case "$PART" in
  O) python3 scripts/overlap_probe.py run out/overlap $RES 2>&1 | tail -8 ;;
  F) python3 scripts/fused_projection_probe.py run out/fproj $RES 2>&1 | tail -14 ;;
  M) # whole models through the importer against onnxruntime, then both sanitizers on the persistent ones
     TVMSEQ_GPU_MODELS=out/$GM timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_models.py -p no:cacheprovider \
       > $RES/models_$GM.log 2>&1; echo "models $GM: $(tail -1 $RES/models_$GM.log)"
     grep -E "FAILED|Error" $RES/models_$GM.log | head -10 | cut -c1-300
     for tool in memcheck racecheck; do
       timeout 240 compute-sanitizer --tool $tool --print-limit 20 env TVMSEQ_GPU_MODELS=out/$GM python3 -m pytest -q \
         -m gpu tests/test_gpu_models.py -k "${SAN:-model}" -p no:cacheprovider > $RES/${tool}_$GM.log 2>&1
       echo "== $tool $GM rc=$?: $(grep -E "SUMMARY" $RES/${tool}_$GM.log | tail -1) | $(tail -1 $RES/${tool}_$GM.log)"
     done ;;
esac
done
