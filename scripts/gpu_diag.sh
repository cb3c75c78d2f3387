#!/usr/bin/env bash
# Persistent GRU hand-off diagnosis + compute-sanitizer on the persistent kernels (carry .gpu, out/diag; built by
# `python3 scripts/pgru_diag.py build out/diag`). Results come back as $OUT/results.tgz.
set +e
source .gpu/env.sh || exit 1
RES=/tmp/res; rm -rf $RES; mkdir -p $RES
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $RES/env.txt
timeout 330 python3 scripts/pgru_diag.py run out/diag 2>&1 | tee $RES/diag.log | cut -c1-400
cp out/diag/results.json $RES/ 2>/dev/null
for tool in memcheck racecheck; do
  timeout 90 compute-sanitizer --tool $tool --print-limit 20 python3 scripts/pgru_diag.py sanitize out/diag > $RES/$tool.log 2>&1
  echo "== $tool rc=$?"; grep -v "^$" $RES/$tool.log | tail -8
done
tar czf $OUT/results.tgz -C $RES .
