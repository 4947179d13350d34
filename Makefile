# Two entry points on a fresh machine (Python >= 3.11 on PATH as python3):
#   make demo   the main job end to end: stand-in engines, real sglang-router, one rollout step, teardown
#   make test   every test tier but the real engine's (installs SGLang's argument parser for CPU and Ray first;
#               ~1.7 GB; the trainers' venv ~1.6 GB), each tier run whatever became of the ones before, then a
#               summary (tier / result / seconds); it fails when any tier failed (scripts/run-tiers.sh)
# The tiers, each a target of its own:
#   make test-quick         unit tests and small integration tests (stand-in engines, the real router): the
#                           default selection, everything not marked slow, ray, trainers or real_engine
#   make test-slow          benchmark smoke runs, fuzzers, long fault trials, bounded-work trials at the caps
#   make test-smg           the router-facing tests again with SMG as the gateway
#   make test-ray           the Ray tests, in a loopback-only network namespace (scripts/in-loopback-netns.sh)
#   make test-ray-floor     the Ray tests again on the [ray] extra's oldest Ray (.venv-ray-floor)
#   make test-trainers      verl's and SkyRL's own config code, in a venv of its own (.venv-trainers)
# and, run by .ci/run after them:
#   make lint   ruff, import-linter and mypy
#   make docs   the docs site (mkdocs.yml, docs/): its generated pages checked against the code, a strict build
#   make test-real-engine   SGLang's own server on the CPU (engine kind cpu_sglang) in its own venv (.venv-real,
#               ~6.5 GB): the real-engine lane and the contract test against both engines
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TRAINERS_VENV ?= .venv-trainers
TRAINERS_BIN := $(TRAINERS_VENV)/bin
RAY_FLOOR_VENV ?= .venv-ray-floor
RAY_FLOOR_BIN := $(RAY_FLOOR_VENV)/bin
REAL_VENV ?= .venv-real
# DISPOSABLE_VENVS=1 (.ci/run, whose checkout is thrown away after; any other value means no): a lane's own venv
# is removed when its tier has run, passed or failed, and the real-engine lane's install first removes the main
# venv, so that the disk holds at most ~6.5 GB of venvs at a time instead of ~11 GB (a CI machine's free disk
# varies). The tiers' order in .ci/run puts the main venv's last users (lint, docs) before the real-engine lane;
# any other order still works, reinstalling what it needs.
DISPOSABLE_VENVS ?=
disposable := $(filter 1,$(DISPOSABLE_VENVS))
# Runs $(1); with DISPOSABLE_VENVS=1, then removes the venv $(2) and exits with $(1)'s status. $(1) may hold
# no comma (make's argument separator).
run_then_dispose = $(if $(disposable),$(1); status=$$?; rm -rf $(2); exit $$status,$(1))

.PHONY: demo test test-quick test-slow test-smg test-ray test-ray-floor test-trainers test-real-engine lint typecheck docs bench mutation clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# pip shows what the build warns, even with --quiet; the one warning left (pyproject.toml declares every
# directory it ships) is setuptools' notice that the compat editable mode is transitional, 14 lines at every
# install of this package: filtered out here (PYTHONWARNINGS, after any filters of the caller's own).
QUIET_COMPAT := PYTHONWARNINGS="$${PYTHONWARNINGS:+$$PYTHONWARNINGS,}ignore:Compat editable installs"

# The package and its test tools, editable in setuptools' "compat" mode: the checkout's root on sys.path. Every
# editable mode gives Hydra apps the plugin (docs/install.md, tests/test_wheel_install.py); the repository's
# own venvs keep this one, which they have always had.
$(VENV)/.base-installed: pyproject.toml | $(BIN)/python
	$(QUIET_COMPAT) $(BIN)/python -m pip install --quiet -e '.[test]' --config-settings editable_mode=compat
	touch $@

# SGLang's real argument parser on CPU (sglang --no-deps + CPU torch + a few pure-Python packages).
$(VENV)/.sglang-installed: scripts/install-sglang-cpu.sh | $(VENV)/.base-installed
	PYTHON=$(BIN)/python bash scripts/install-sglang-cpu.sh
	touch $@

# SMG, the second gateway the router-facing tests run against (the [smg] extra).
$(VENV)/.smg-installed: pyproject.toml | $(VENV)/.base-installed
	$(QUIET_COMPAT) $(BIN)/python -m pip install --quiet -e '.[test,smg]' --config-settings editable_mode=compat
	touch $@

# The tests that start routers, run a second time with SMG as the gateway (the first run: sglang-router).
ROUTER_TESTS := tests/test_routers.py tests/test_launcher.py tests/test_launcher_faults.py \
	tests/test_supervision.py tests/test_control.py tests/test_control_lifecycle.py \
	tests/test_standin_control.py tests/test_external_engines_live.py tests/test_serving_faults.py \
	tests/test_change_safety.py tests/test_elastic.py tests/test_rollout_live.py

# The ray backend's extra (Ray itself), for the tests.
$(VENV)/.ray-installed: pyproject.toml | $(VENV)/.base-installed
	$(QUIET_COMPAT) $(BIN)/python -m pip install --quiet -e '.[test,ray]' --config-settings editable_mode=compat
	touch $@

# verl 0.9.1's and skyrl-train 0.3.1's own config code (tests/test_trainers.py), in a venv of its own: their
# pins clash with the main test venv's (scripts/install-trainers.sh says which).
$(TRAINERS_BIN)/python:
	$(PYTHON) -m venv $(TRAINERS_VENV)
	$(TRAINERS_BIN)/python -m pip install --quiet --upgrade pip

$(TRAINERS_VENV)/.installed: scripts/install-trainers.sh pyproject.toml | $(TRAINERS_BIN)/python
	PYTHON=$(TRAINERS_BIN)/python bash scripts/install-trainers.sh
	touch $@

# The oldest Ray of the [ray] extra (its floor in pyproject.toml; tests/test_extras.py checks they agree), for
# the Ray tests at the low end of the range; the main venv has the newest.
RAY_FLOOR := 2.54.0
$(RAY_FLOOR_BIN)/python:
	$(PYTHON) -m venv $(RAY_FLOOR_VENV)
	$(RAY_FLOOR_BIN)/python -m pip install --quiet --upgrade pip

$(RAY_FLOOR_VENV)/.installed: pyproject.toml Makefile | $(RAY_FLOOR_BIN)/python
	$(QUIET_COMPAT) $(RAY_FLOOR_BIN)/python -m pip install --quiet -e '.[test,ray]' 'ray==$(RAY_FLOOR)' --config-settings editable_mode=compat
	touch $@

# The real-engine lane's venv: torch 2.14.1 (the build SGLang pins; a CUDA build, run on the CPU), sglang --no-deps
# and what its server imports on a CPU, and this package with its test tools.
$(REAL_VENV)/.installed: scripts/install-sglang-real-cpu.sh pyproject.toml
	$(if $(disposable),rm -rf $(VENV) $(TRAINERS_VENV) $(RAY_FLOOR_VENV),@:)
	PYTHON=$(PYTHON) VENV=$(REAL_VENV) bash scripts/install-sglang-real-cpu.sh
	touch $@

demo: $(VENV)/.base-installed
	cd examples && ../$(BIN)/python train.py sglang=agentic_32gpu sglang_deploy=simulated colocate=true actor_num_nodes=4 kill_engine_at_step=1

# The tiers of `make test`, in the order they run; EXTRA_TIERS are run after them (.ci/run: lint, docs and
# test-real-engine). Each tier installs what it needs (a failed install fails that tier only).
TEST_TIERS := test-quick test-slow test-smg test-ray test-ray-floor test-trainers
EXTRA_TIERS ?=
# The lanes outside the quick and slow tiers (their own venvs, a network namespace, SGLang's server).
LANE_MARKERS := not ray and not trainers and not real_engine
# The main venv as the quick and slow tiers see it: SGLang's argument parser, Ray and SMG installed.
MAIN_TEST_VENV := $(VENV)/.sglang-installed $(VENV)/.ray-installed $(VENV)/.smg-installed

test:
	MAKE="$(MAKE)" bash scripts/run-tiers.sh $(TEST_TIERS) $(EXTRA_TIERS)

# Unit tests and small integration tests: what `pytest` selects by default once the slow tier is left out.
test-quick: $(MAIN_TEST_VENV)
	$(BIN)/python -m pytest -m "not slow and $(LANE_MARKERS)" -p no:cacheprovider

# Benchmark smoke runs (benchmarks/*.py --smoke), fuzzers, long fault trials, bounded-work trials at the caps.
test-slow: $(MAIN_TEST_VENV)
	$(BIN)/python -m pytest -m "slow and $(LANE_MARKERS)" -p no:cacheprovider

# The router-facing tests against SMG alone.
test-smg: $(MAIN_TEST_VENV)
	$(BIN)/python -m pytest --gateway smg -m "not ray" -p no:cacheprovider $(ROUTER_TESTS)

test-ray: $(MAIN_TEST_VENV)
	bash scripts/in-loopback-netns.sh $(BIN)/python -m pytest -m "ray and not trainers" -p no:cacheprovider

# The Ray tests on the oldest Ray of the [ray] extra.
test-ray-floor: $(RAY_FLOOR_VENV)/.installed
	$(call run_then_dispose,bash scripts/in-loopback-netns.sh $(RAY_FLOOR_BIN)/python -m pytest -m "ray and not trainers" -p no:cacheprovider,$(RAY_FLOOR_VENV))

# The trainers' lane alone: verl's and SkyRL's own config code (its Ray-task test in the loopback namespace).
test-trainers: $(TRAINERS_VENV)/.installed
	$(call run_then_dispose,bash scripts/in-loopback-netns.sh $(TRAINERS_BIN)/python -m pytest -m trainers -p no:cacheprovider,$(TRAINERS_VENV))

# At most two real engines at a time (~3 GB each). MSP_REQUIRE_REAL_ENGINE_TESTS=1 (.ci/run) turns a skip into a
# failure.
test-real-engine: $(REAL_VENV)/.installed
	$(call run_then_dispose,$(REAL_VENV)/bin/python -m pytest -m "real_engine or engine_contract" -p no:cacheprovider \
		tests/test_real_engine.py tests/test_engine_contract.py,$(REAL_VENV))

# Format and lint (ruff), the stages' import contracts (import-linter), then the types (make typecheck).
lint: $(VENV)/.base-installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports && $(BIN)/mypy

# mypy, strict on the whole package and the Hydra plugins (pyproject.toml's [tool.mypy]: what it checks, and
# the optional extras it does not follow).
typecheck: $(VENV)/.base-installed
	$(BIN)/mypy

# The docs' tools (the [docs] extra: mkdocs, mkdocs-material), in the main venv.
$(VENV)/.docs-installed: pyproject.toml | $(VENV)/.base-installed
	$(QUIET_COMPAT) $(BIN)/python -m pip install --quiet -e '.[test,docs]' --config-settings editable_mode=compat
	touch $@

# The generated pages (config reference, placement picture) must be what the code gives; then a strict build
# (a broken link or anchor, a page outside the nav: a failure) into build/site. Material's notice about its
# successor is left out of the log.
docs: $(VENV)/.docs-installed
	$(BIN)/python scripts/generate-docs.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

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
	rm -rf $(VENV) $(TRAINERS_VENV) $(RAY_FLOOR_VENV) $(REAL_VENV) build dist *.egg-info
