# Sourced by the session scripts on the GPU machine: TVM's runtime (carried in .gpu), unbuffered Python, results
# under $OUT (what comes back from a `run` call) as $RES, and the GPU's name and driver in $RES/gpu.txt.
source .gpu/env.sh || exit 1
export PYTHONUNBUFFERED=1
RES=$OUT; mkdir -p $RES
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $RES/gpu.txt
