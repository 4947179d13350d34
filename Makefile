# Two entry points on a fresh machine (Python >= 3.11 on PATH as python3):
#   make demo   the main job end to end: stand-in engines, real sglang-router, one rollout step, teardown
#   make test   the test suite (installs SGLang's argument parser for CPU and Ray first; ~1.7 GB); the Ray
#               tests run in a loopback-only network namespace (scripts/in-loopback-netns.sh)
# and, run by .ci/run after them:
#   make test-real-engine   SGLang's own server on the CPU (engine kind cpu_sglang) in its own venv (.venv-real,
#               ~6.3 GB): the real-engine lane and the contract test against both engines
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
REAL_VENV ?= .venv-real

.PHONY: demo test test-ray test-real-engine lint bench mutation clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The package and its test tools. "compat" editable mode keeps hydra_plugins/ a plain directory on sys.path,
# which Hydra's plugin discovery needs.
$(VENV)/.base-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]' --config-settings editable_mode=compat
	touch $@

# SGLang's real argument parser on CPU (sglang --no-deps + CPU torch + a few pure-Python packages).
$(VENV)/.sglang-installed: scripts/install-sglang-cpu.sh | $(VENV)/.base-installed
	PYTHON=$(BIN)/python bash scripts/install-sglang-cpu.sh
	touch $@

# The ray backend's extra (Ray itself), for the tests.
$(VENV)/.ray-installed: pyproject.toml | $(VENV)/.base-installed
	$(BIN)/python -m pip install --quiet -e '.[test,ray]' --config-settings editable_mode=compat
	touch $@

# The real-engine lane's venv: torch 2.14.1 (the build SGLang pins; a CUDA build, run on the CPU), sglang --no-deps
# and what its server imports on a CPU, and this package with its test tools.
$(REAL_VENV)/.installed: scripts/install-sglang-real-cpu.sh pyproject.toml
	PYTHON=$(PYTHON) VENV=$(REAL_VENV) bash scripts/install-sglang-real-cpu.sh
	touch $@

demo: $(VENV)/.base-installed
	cd examples && ../$(BIN)/python train.py sglang=agentic_32gpu sglang_deploy=simulated colocate=true actor_num_nodes=4 kill_engine_at_step=1

test: $(VENV)/.sglang-installed $(VENV)/.ray-installed
	$(BIN)/python -m pytest -m "not ray and not real_engine"
	bash scripts/in-loopback-netns.sh $(BIN)/python -m pytest -m ray -p no:cacheprovider

test-ray: $(VENV)/.ray-installed
	bash scripts/in-loopback-netns.sh $(BIN)/python -m pytest -m ray -p no:cacheprovider

# At most two real engines at a time (~3 GB each). MSP_REQUIRE_REAL_ENGINE_TESTS=1 (.ci/run) turns a skip into a
# failure.
test-real-engine: $(REAL_VENV)/.installed
	$(REAL_VENV)/bin/python -m pytest -m "real_engine or engine_contract" -p no:cacheprovider \
		tests/test_real_engine.py tests/test_engine_contract.py

lint: $(VENV)/.base-installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports

bench: $(VENV)/.sglang-installed $(VENV)/.ray-installed
	$(BIN)/python benchmarks/bench_resolve.py --subprocess-runs 3
	$(BIN)/python benchmarks/bench_launch.py
	$(BIN)/python benchmarks/bench_sweep.py
	bash scripts/in-loopback-netns.sh $(BIN)/python benchmarks/bench_ray.py

# Mutation testing, by hand (not in `make test` or CI; about 90 minutes on two cores): mutmut over resolution,
# masking, ports, process handling and launch specs, each with its fast tests (scripts/mutation.sh says how).
# MUTATION_SETS picks sets, e.g. `make mutation MUTATION_SETS="masking ports"`.
mutation: $(VENV)/.sglang-installed
	$(BIN)/python -m pip install --quiet 'mutmut==3.8.1'
	bash scripts/mutation.sh $(MUTATION_SETS)

clean:
	rm -rf $(VENV) $(REAL_VENV) build dist *.egg-info
