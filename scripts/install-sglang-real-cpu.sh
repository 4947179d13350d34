#!/usr/bin/env bash
# Create the real-engine lane's virtual environment (default .venv-real): SGLang 0.5.23's own server, runnable on a
# CPU-only machine with the cpu_sglang engine kind, plus this package and its test tools. The main test venv
# (.venv, scripts/install-sglang-cpu.sh) is not touched.
#
# - torch==2.14.1 and torchvision==0.29.1: the builds SGLang 0.5.23 pins (torch==2.14.1). They are CUDA builds and
#   run on the CPU. On this project's machines pip takes both from a file on disk (about 5.5 GB installed with the
#   CUDA libraries they depend on). The CPU-only torch 2.13.0 of the main venv does not serve: SGLang's start-up
#   imports torchvision, and PyPI's torchvision fails beside that build ("operator torchvision::nms does not
#   exist").
# - sglang is installed with --no-deps: its declared dependencies pull GPU kernels (sglang-kernel, flashinfer,
#   flash-attn, deep-gemm, cutlass, ...) that cannot load on a CPU. RUNTIME_DEPS below are what a CPU engine of a
#   small Llama model imports on the way to serving, found by starting one; pip then reports the GPU packages as
#   "required but not installed", which is expected and filtered out here.
# - The kernel functions SGLang imports on a CPU come from the project's shim (miles_sglang_plugin/cpu_engine_shim),
#   which the cpu_sglang kind puts on the engines' PYTHONPATH; nothing of it is installed here.
#
# Prints one line on success: the time it took and the venv's size. Idempotent.
set -euo pipefail

SGLANG_VERSION="0.5.23"
TORCH=(torch==2.14.1 torchvision==0.29.1)
RUNTIME_DEPS=(
    "transformers==5.19.0" "tokenizers==0.23.2" "compressed-tensors==0.18.0" "xgrammar==0.2.7" "openai==2.8.0"
    fastapi "uvicorn>=0.51" uvloop orjson pydantic "pyzmq>=25.1.2" msgspec psutil pybase64 requests packaging
    setproctitle "prometheus-client>=0.20.0" python-multipart partial_json_parser einops interegular
    huggingface_hub safetensors scipy regex tqdm ipython aiohttp sentencepiece tiktoken pyyaml dill gguf
    jsonschema soundfile
)

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base_python="${PYTHON:-python3}"
venv="${VENV:-$repo_root/.venv-real}"

if ! "$base_python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "install-sglang-real-cpu.sh: sglang ${SGLANG_VERSION} needs Python >= 3.11 ($base_python is older)" >&2
    exit 1
fi

started=$(date +%s)
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

# pip install, quietly; on failure show everything, on success only what is not the expected noise.
quiet_pip_install() {
    if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" >"$log" 2>&1; then
        cat "$log" >&2
        echo "install-sglang-real-cpu.sh: pip install $* failed" >&2
        return 1
    fi
    grep -v \
        -e "^sglang [^ ]* requires " \
        -e "pip's dependency resolver does not currently take into account" \
        -e "^WARNING: Location '.*' is ignored" \
        -e "^ *!!\$" -e "BuildBackendWarning" -e "editable_mode\|_EditableMode\|editable installs" \
        -e "^ *\*\{10,\}\$" -e "^ *\$" \
        -e "The 'compat' editable mode\|in future versions of .setuptools.\|Please adapt your code\|See https://setuptools" \
        "$log" >&2 || true
}

# torch's CUDA build with its libraries is most of the venv's ~6.5 GB: with less than 7 GB free, say so now
# rather than as pip's "No space left on device" halfway through. A venv whose torch and torchvision import
# needs no more; one that a full disk left half-installed is checked like a new one.
NEED_FREE_KB=$((7 * 1024 * 1024))
has_torch() {
    [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import torch, torchvision' >/dev/null 2>&1
}
if ! has_torch; then
    mkdir -p "$(dirname "$venv")"
    free_kb=$(df -Pk "$(dirname "$venv")" 2>/dev/null | awk 'NR == 2 { print $4 }') || free_kb=""
    if [ -z "$free_kb" ]; then
        echo "install-sglang-real-cpu.sh: cannot tell the free disk space of $(dirname "$venv") (df failed);" \
            "going on (the venv needs about 7 GB)" >&2
    elif [ "$free_kb" -lt "$NEED_FREE_KB" ]; then
        echo "install-sglang-real-cpu.sh: $venv needs about 7 GB of free disk (torch ${TORCH[0]#torch==}, a CUDA" \
            "build, and its libraries); $((free_kb / 1024)) MB free on $(df -P "$(dirname "$venv")" | awk 'NR == 2 { print $6 }')" >&2
        exit 1
    fi
fi

[ -x "$venv/bin/python" ] || "$base_python" -m venv "$venv"
quiet_pip_install "${TORCH[@]}"
quiet_pip_install --no-deps "sglang==${SGLANG_VERSION}"
quiet_pip_install "${RUNTIME_DEPS[@]}"
quiet_pip_install -e "$repo_root[test]" --config-settings editable_mode=compat

# Check: torch and torchvision are the pinned builds (a later package may not have swapped them) and SGLang's
# arguments import. The lane's tests start real engines.
"$venv/bin/python" -W ignore - <<'PY'
import torch
import torchvision
from sglang.srt.server_args import ServerArgs  # noqa: F401

assert torch.__version__.split("+")[0] == "2.14.1", torch.__version__
assert torchvision.__version__.split("+")[0] == "0.29.1", torchvision.__version__
PY

echo "install-sglang-real-cpu.sh: $venv ready in $(($(date +%s) - started)) s, $(du -sh "$venv" | cut -f1)"
