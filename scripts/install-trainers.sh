#!/usr/bin/env bash
# Install the trainers' own config code (verl 0.9.1, skyrl-train 0.3.1) into the ACTIVE virtual environment,
# for tests/test_trainers.py: their Hydra YAML trees read from the installed packages, verl's
# omega_conf_to_dataclass and RolloutConfig, SkyRL's validate_cfg.
#
# It goes into a venv of its own (make .venv-trainers/.installed), not the main test venv: the trainers' pins
# clash with the rest of the test set-up (verl 0.9.1 wants transformers < 5.11, SGLang 0.5.23 pins 5.19.0;
# skyrl-train 0.3.1 imports ray.util.placement_group.PlacementGroupSchedulingStrategy, which Ray 2.51.1 has
# and 2.53.0 and later do not, so this venv has SkyRL's pinned Ray 2.51.1: for SkyRL's import and the test
# that resolves a composed config in a Ray task, not for the ray backend, whose [ray] extra starts later).
#
# - verl and skyrl-train are installed with --no-deps: their declared dependencies are the GPU training
#   stacks (flash-attn, vllm, megatron, ...). pip then reports their unmet requirements and still exits 0;
#   that expected report is filtered out here, anything else pip says is shown.
# - skyrl-train 0.3.1 declares Requires-Python ==3.12.*; its config code runs on 3.11 (every module compiles,
#   and validate_cfg runs), so it is installed with --ignore-requires-python where the Python is not 3.12.
# - The other packages are the modules that `import verl.utils.config`, `verl.workers.config` and
#   `skyrl_train.utils.utils` import, each found by importing them in a fresh venv: torch (the CPU build
#   2.13.0, as in install-sglang-cpu.sh), tensordict (verl: <=0.10.0), transformers (verl: >=5.5.3,<5.11),
#   codetiming (verl), loguru and jaxtyping (SkyRL).
#
# Idempotent and quiet: prints nothing on success.
set -euo pipefail

VERL_VERSION="0.9.1"
SKYRL_VERSION="0.3.1"
TORCH_VERSION="2.13.0"
RAY_VERSION="2.51.1"
CONFIG_DEPS=("tensordict>=0.8.0,<=0.10.0,!=0.9.0" "transformers>=5.5.3,<5.11,!=5.6.0" codetiming loguru jaxtyping)

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python}"

if ! "$python" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' 2>/dev/null; then
    echo "install-trainers.sh: activate a virtual environment first" >&2
    exit 1
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT

# pip install, quietly; setuptools' notice that the compat editable mode is transitional is left out (as in the
# Makefile).
quiet_pip_install() {
    if ! PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Compat editable installs" \
        "$python" -m pip install --quiet --disable-pip-version-check "$@" >"$log" 2>&1; then
        cat "$log" >&2
        echo "install-trainers.sh: pip install $* failed" >&2
        return 1
    fi
    grep -v \
        -e "^verl [^ ]* requires " \
        -e "^skyrl-train [^ ]* requires " \
        -e "pip's dependency resolver does not currently take into account" \
        -e "^WARNING: Location '.*' is ignored" \
        "$log" >&2 || true
}

if ! "$python" -c 'import torch' >/dev/null 2>&1; then
    quiet_pip_install "torch==${TORCH_VERSION}"
fi
quiet_pip_install -e "${repo_root}[test]" --config-settings editable_mode=compat "ray==${RAY_VERSION}"
quiet_pip_install "${CONFIG_DEPS[@]}"
quiet_pip_install --no-deps "verl==${VERL_VERSION}"
skyrl_flags=(--no-deps)
if ! "$python" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)'; then
    skyrl_flags+=(--ignore-requires-python)
fi
quiet_pip_install "${skyrl_flags[@]}" "skyrl-train==${SKYRL_VERSION}"

# Check: the trainers' config code imports.
"$python" -c '
from verl.utils.config import omega_conf_to_dataclass  # noqa: F401
from verl.workers.config import RolloutConfig  # noqa: F401
from skyrl_train.utils.utils import validate_cfg  # noqa: F401
'
