#!/usr/bin/env bash
# The project's GPU runs, in named parts. Kernels are built here (a CPU machine with TVM's compiler and nvcc:
# the .so files carry sm_90a SASS) and run on the GPU machine with TVM's runtime only; `demo` and
# `search_compare` need TVM's full compiler there.
#
#   bash schedules/gpu_run.sh build [PAYLOAD...]     here: the prebuilt kernels into out/<PAYLOAD> (default: all)
#   bash schedules/gpu_run.sh test [PAYLOAD...]      GPU: pytest -m gpu on those payloads (default: all in out/)
#   bash schedules/gpu_run.sh bench [PAYLOAD...]     GPU: `tvmseq bench` on them (JSON + png under $OUT/bench)
#   bash schedules/gpu_run.sh sanitize [PAYLOAD...]  GPU: compute-sanitizer memcheck + racecheck of their GPU tests
#   bash schedules/gpu_run.sh demo                   GPU, full TVM: `tvmseq demo` and every GPU test (compiles there)
#   bash schedules/gpu_run.sh search_compare [ARGS]  GPU, full TVM: schedules/compare_search.py ARGS
#
# Payloads (out/<name>; what builds it; the GPU tests that load it; the benchmark that times it):
#   gru       tvmseq bench gru --build               tests/test_gpu_gru.py                 bench gru
#   pgru      tvmseq bench persistent_gru --build    tests/test_persistent_gru.py          bench persistent_gru
#   prnn      tvmseq bench persistent_rnn --build    tests/test_persistent_rnn_gpu.py      bench persistent_rnn
#   stack     tvmseq bench gru_stack --build         tests/test_persistent_stack.py        bench gru_stack
#   rg        tvmseq bench recurrent_gemm --build    tests/test_recurrent_gemm.py          bench recurrent_gemm
#   proj      tvmseq bench input_projection --build  -                                     bench input_projection
#   spmm      tvmseq bench spmm --build-only         tests/test_sparse.py                  bench spmm
#   topk      tvmseq bench topk --build-only         tests/test_topk.py                    bench topk --fp16
#   pmma      python tests/test_persistent_mma.py    tests/test_persistent_mma.py          -
#   pwg       python tests/test_persistent_wgmma.py  tests/test_persistent_wgmma.py        -
#   models    python tests/test_gpu_models.py        tests/test_gpu_models.py              -
#   artifacts tvmseq build (tests/test_prebuild.py)  tests/test_prebuild.py                -
#
# On the GPU machine: stage TVM once (`../shared/gpu/stage --runtime`; without --runtime for demo and
# search_compare) and carry .gpu plus the out/<payload> directories the part reads; a call carries 64 MiB in all
# (the 11 whole models are ~93 MB: build them in two calls, MODELS="name ..." picking each half). Results and
# logs land in $OUT (what a run call brings back; default /tmp/gpu_run). Environment knobs: T (seconds a step,
# default 500), SAN (pytest -k for the sanitizers, default all of a payload's tests), MODELS (a subset of
# tests/test_gpu_models.py's CASES).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PART=${1:-}
[ $# -gt 0 ] && shift
RES=${OUT:-/tmp/gpu_run}
mkdir -p "$RES"
ALL="gru pgru prnn stack rg proj spmm topk pmma pwg models artifacts"
T=${T:-500}
PY=${PYTHON:-python3}

build_payload() {   # $1: payload name -> out/$1
  local dir=out/$1
  case $1 in
    gru) $PY -m tvmseq.cli bench gru --build $dir --no-sweep ;;
    pgru) $PY -m tvmseq.cli bench persistent_gru --build $dir ;;
    prnn) $PY -m tvmseq.cli bench persistent_rnn --build $dir ;;
    stack) $PY -m tvmseq.cli bench gru_stack --build $dir ;;
    rg) $PY -m tvmseq.cli bench recurrent_gemm --build $dir ;;
    proj) $PY -m tvmseq.cli bench input_projection --build $dir ;;
    spmm) $PY -m tvmseq.cli bench spmm --build-only $dir ;;
    topk) $PY -m tvmseq.cli bench topk --fp16 --build-only $dir ;;
    pmma) $PY tests/test_persistent_mma.py $dir ;;
    pwg) $PY tests/test_persistent_wgmma.py $dir ;;
    models) $PY tests/test_gpu_models.py $dir ${MODELS:-} ;;
    artifacts) $PY -m tvmseq.cli build $($PY tests/test_prebuild.py $dir/models) --out $dir ;;
    *) echo "unknown payload $1 (one of: $ALL)" >&2; return 2 ;;
  esac
}

tests_of() {   # $1: payload -> "ENV=out/<payload> test files"
  case $1 in
    gru) echo "TVMSEQ_GRU_PREBUILT=out/gru tests/test_gpu_gru.py" ;;
    pgru) echo "TVMSEQ_PGRU_PREBUILT=out/pgru tests/test_persistent_gru.py" ;;
    prnn) echo "TVMSEQ_PRNN_PREBUILT=out/prnn tests/test_persistent_rnn_gpu.py" ;;
    stack) echo "TVMSEQ_STACK_PREBUILT=out/stack tests/test_persistent_stack.py" ;;
    rg) echo "TVMSEQ_RG_PREBUILT=out/rg tests/test_recurrent_gemm.py" ;;
    spmm) echo "TVMSEQ_SPMM_PREBUILT=out/spmm tests/test_sparse.py" ;;
    topk) echo "TVMSEQ_TOPK_PREBUILT=out/topk tests/test_topk.py" ;;
    pmma) echo "TVMSEQ_PMMA_PREBUILT=out/pmma tests/test_persistent_mma.py" ;;
    pwg) echo "TVMSEQ_PWG_PREBUILT=out/pwg tests/test_persistent_wgmma.py" ;;
    models) echo "TVMSEQ_GPU_MODELS=out/models tests/test_gpu_models.py" ;;
    artifacts) echo "TVMSEQ_ARTIFACTS=out/artifacts tests/test_prebuild.py" ;;
  esac
}

bench_of() {   # $1: payload -> the tvmseq bench arguments that time it
  case $1 in
    gru) echo "gru --prebuilt out/gru" ;;
    pgru) echo "persistent_gru --prebuilt out/pgru" ;;
    prnn) echo "persistent_rnn --prebuilt out/prnn" ;;
    stack) echo "gru_stack --prebuilt out/stack" ;;
    rg) echo "recurrent_gemm --prebuilt out/rg --sweep" ;;
    proj) echo "input_projection --prebuilt out/proj" ;;
    spmm) echo "spmm --prebuilt out/spmm" ;;
    topk) echo "topk --fp16 --prebuilt out/topk" ;;
  esac
}

present() {   # the payloads named, or every one built under out/
  if [ $# -gt 0 ]; then echo "$@"; return; fi
  for p in $ALL; do [ -d out/$p ] && echo -n "$p "; done
}

gpu_env() {   # TVM from .gpu on the GPU machine; the GPU and driver into $RES/gpu.txt
  source .gpu/env.sh || exit 1
  export PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$RES/gpu.txt"
}

run_tests() {   # $1: log name, $2: "ENV=VALUE ...", then test files; prints the pytest summary and the failures
  local log=$RES/$1.log envs=$2; shift 2
  env $envs timeout "$T" $PY -m pytest -q -m gpu -rfs -p no:cacheprovider "$@" > "$log" 2>&1
  echo "$(basename "$log" .log): $(tail -1 "$log")"
  grep -E "^(FAILED|ERROR)" "$log" | head -10 | cut -c1-300
}

case $PART in
  build)
    for p in ${@:-$ALL}; do
      echo "== build $p"; build_payload $p > "$RES/build_$p.log" 2>&1 && echo "out/$p: $(du -sh out/$p | cut -f1)" \
        || { echo "build $p failed:"; tail -5 "$RES/build_$p.log"; }
    done ;;
  test)
    gpu_env
    for p in $(present "$@"); do
      spec=$(tests_of $p); [ -n "$spec" ] && run_tests "test_$p" "${spec% *}" ${spec##* }
    done ;;
  bench)
    gpu_env
    for p in $(present "$@"); do
      args=$(bench_of $p); [ -z "$args" ] && continue
      timeout "$T" $PY -m tvmseq.cli bench $args --out "$RES/bench" > "$RES/bench_$p.log" 2>&1
      echo "== bench $p rc=$?"; tail -30 "$RES/bench_$p.log" | cut -c1-200
    done ;;
  sanitize)
    gpu_env
    for p in $(present "$@"); do
      spec=$(tests_of $p); [ -z "$spec" ] && continue
      for tool in memcheck racecheck; do
        env ${spec% *} timeout "$T" compute-sanitizer --tool $tool --print-limit 20 $PY -m pytest -q -m gpu \
          -p no:cacheprovider ${spec##* } ${SAN:+-k "$SAN"} > "$RES/${tool}_$p.log" 2>&1
        echo "== $tool $p rc=$?: $(grep -E "SUMMARY" "$RES/${tool}_$p.log" | tail -1) | $(tail -1 "$RES/${tool}_$p.log")"
      done
    done ;;
  demo)
    gpu_env
    $PY -c 'import sys, tvm; sys.exit(1 if tvm.base._RUNTIME_ONLY else 0)' \
      || { echo "TVM runtime only in .gpu: demo compiles, stage without --runtime"; exit 1; }
    timeout "$T" $PY -m tvmseq.cli demo 2>&1 | tee "$RES/demo.log"
    envs=""
    for p in $(present); do spec=$(tests_of $p); [ -n "$spec" ] && envs="$envs ${spec% *}"; done
    run_tests pytest_gpu "$envs" tests/ ;;
  search_compare)
    # MetaSchedule's evolutionary search vs the genetic search (schedules/compare_search.py): needs TVM's compiler
    # on the GPU machine; one workload reaches 128 trials in a call of about 8 minutes (--problems gemm2048, then
    # --problems gru_input), and out/search_compare_work.tar.xz, carried, resumes the previous call's databases
    gpu_env
    work=/tmp/search_compare_work; rm -rf $work; mkdir -p $work
    [ -f out/search_compare_work.tar.xz ] && tar -xJf out/search_compare_work.tar.xz -C $work --strip-components=1
    timeout "$T" $PY schedules/compare_search.py --out-dir "$RES/search_compare" --work-dir $work \
      --deadline-s ${DEADLINE:-380} "$@" > "$RES/search_compare.log" 2>&1
    echo "compare_search.py rc=$?"; grep -E "^==|exit code|Error" "$RES/search_compare.log" | tail -40
    tar -cJf "$RES/search_compare_work.tar.xz" --exclude=logs -C /tmp search_compare_work ;;
  *)
    sed -n '2,30p' "$0"; exit 2 ;;
esac
