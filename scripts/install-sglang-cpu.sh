#!/usr/bin/env bash
# Install what the real SGLang argument parser needs on a CPU-only machine, into the ACTIVE virtual environment.
#
# That is enough for miles_sglang_plugin/rendering/sglang_server_args.py: importing sglang.srt.server_args, listing the
# ServerArgs fields and parsing a `sglang.launch_server` command line with prepare_server_args. It is NOT enough
# to run an engine, and not for `python -m sglang.launch_server --help` (that also needs huggingface_hub).
#
# - sglang is installed with --no-deps: its declared dependencies pull CUDA torch 2.14.1 and many GB of GPU
#   kernels. pip then prints a list of "sglang 0.5.23 requires ..., which is not installed" conflicts and still
#   exits 0; that expected report is filtered out here, anything else pip says is shown.
# - torch is pinned to 2.13.0, which resolves to the CPU build on this project's machines. A bare `torch` (or a
#   range) would pull a multi-GB CUDA build. An already importable torch (any build) is left as it is.
# - triton is not installed: sglang_server_args.py stands SGLang's own triton stub in for it.
# - The other packages are the modules that `import sglang.srt.server_args` and prepare_server_args import, each
#   checked by removing it in a fresh venv; pyyaml is only for `--config FILE` (and is a project dependency).
#
# Idempotent (a second run changes nothing) and quiet: prints nothing on success.
set -euo pipefail

SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"
PARSER_DEPS=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp pyyaml)

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python}"

if ! "$python" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' 2>/dev/null; then
    echo "install-sglang-cpu.sh: activate a virtual environment first (refusing to install into $("$python" -c 'import sys; print(sys.prefix)' 2>/dev/null || echo "'$python'"))" >&2
    exit 1
fi
if ! "$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "install-sglang-cpu.sh: sglang ${SGLANG_VERSION} needs Python >= 3.11" >&2
    exit 1
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT

# pip install, quietly; on failure show everything, on success only what is not the expected noise.
quiet_pip_install() {
    if ! "$python" -m pip install --quiet --disable-pip-version-check "$@" >"$log" 2>&1; then
        cat "$log" >&2
        echo "install-sglang-cpu.sh: pip install $* failed" >&2
        return 1
    fi
    grep -v \
        -e "^sglang [^ ]* requires " \
        -e "pip's dependency resolver does not currently take into account" \
        -e "^WARNING: Location '.*' is ignored" \
        "$log" >&2 || true
}

quiet_pip_install --no-deps "sglang==${SGLANG_VERSION}"

if ! "$python" -c 'import torch' >/dev/null 2>&1; then
    quiet_pip_install "torch==${TORCH_VERSION}"
fi

quiet_pip_install "${PARSER_DEPS[@]}"

# Check: the parser imports and parses (the module is loaded by path, so the package's own imports don't matter).
"$python" - "$repo_root/miles_sglang_plugin/rendering/sglang_server_args.py" <<'PY'
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("_install_check_sglang_server_args", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
args = module.parse_launch_argv(["--model-path", "/nonexistent/model", "--tp-size", "2"])
assert args["tp_size"] == 2, args["tp_size"]
PY
