#!/usr/bin/env bash
# One H100 call for the persistent GRU, top-k and sparse GPU tests (runtime-only TVM in .gpu; carry .gpu,
# out/pgru, out/topk_gpu, out/spmm_gpu). Everything lands in /tmp/res/* and comes back as one tarball.
set +e
FINAL=$OUT
RES=/tmp/res; rm -rf $RES; mkdir -p $RES/pgru $RES/topk $RES/sparse
OUT=$RES/pgru timeout 280 bash scripts/gpu_pgru.sh
OUT=$RES/topk timeout 170 bash scripts/gpu_topk.sh > $RES/topk/all.log 2>&1; tail -25 $RES/topk/bench_topk.log; tail -3 $RES/topk/pytest_gpu_topk.log
source .gpu/env.sh > /dev/null 2>&1
TVMSEQ_SPMM_PREBUILT=out/spmm_gpu timeout 80 python3 -m pytest -q -m gpu -rf tests/test_sparse.py tests/test_onnx_sparse.py \
  -p no:cacheprovider > $RES/sparse/pytest.log 2>&1; tail -3 $RES/sparse/pytest.log
tar czf $FINAL/results.tgz -C $RES .
