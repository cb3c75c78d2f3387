#!/usr/bin/env bash
# H100: persistent GRU schedule sweep (carry .gpu out/sweep; built by scripts/pgru_sweep.py build out/sweep)
set +e
source .gpu/env.sh > /tmp/env.log 2>&1 || { cat /tmp/env.log; exit 1; }
timeout 200 python3 scripts/pgru_sweep.py run out/sweep 2>&1 | grep -v "LL timeout" | cut -c1-260 | tee $OUT/sweep.log
cp out/sweep/results.json $OUT/ 2>/dev/null
