#!/usr/bin/env bash
# Mutation testing with mutmut 3 (`make mutation`; by hand, not part of `make test` or CI).
#
#   scripts/mutation.sh [SET...]     sets: resolution resolution_more masking ports processes processes_child
#                                     launch_specs router_specs serving (the default)
#   MUTANTS="NAME..." scripts/mutation.sh SET      only these mutants (mutmut names or globs), e.g. to show that
#                                                  a new test kills them
#
# mutmut copies the package into mutants/, mutates functions there and runs, for each mutant, the tests of the
# set's selection that call the mutated function (the package is imported from mutants/, never from the
# checkout). Each set runs in its own scratch copy of the tracked files (build/mutation/SET), so that each has
# its own fast test selection: the tests that start whole deployments would otherwise run for every mutant
# of every function they touch. One worker (`--max-children 1`): the machines are shared.
#
# Afterwards: `cd build/mutation/SET && ../../../.venv/bin/mutmut results` lists the survivors and
# `mutmut show NAME` shows one; `MUTANT_UNDER_TEST=NAME` plus `pytest` from build/mutation/SET/mutants
# reruns one mutant's tests by hand.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MUTMUT="${MUTMUT:-$ROOT/.venv/bin/mutmut}"
[ "$#" -gt 0 ] || set -- resolution resolution_more masking ports processes processes_child launch_specs router_specs serving
#: Each set stops after this many minutes (mutmut keeps what it has checked; the rest stays "not checked").
MINUTES="${MUTATION_MINUTES_PER_SET:-30}"

# Per set: the modules mutated, the tests run, and a per-test timeout (seconds) that stops a mutant that hangs.
config_for() {
    survivors_of=""
    case "$1" in
    resolution)
        modules="miles_sglang_plugin/planning/resolution.py"
        # test_miles_parity.py: Miles' rules (ranks, eval fleet, critic, colocate), without its hypothesis
        # property through Hydra (20 s a run); test_bad_input.py: the GPU bounds and the model path check.
        tests="tests/test_resolution.py tests/test_resolution_boundaries.py tests/test_resolution_properties.py
               tests/test_miles_yaml.py tests/test_miles_parity.py
               --deselect=tests/test_miles_parity.py::test_the_namespace_and_the_hydra_path_give_the_same_plan
               tests/test_bad_input.py::test_a_model_path_that_is_not_a_string_is_refused_where_it_was_set
               tests/test_bad_input.py::test_gpu_counts_are_bounded_before_engines_are_enumerated
               tests/test_bad_input.py::test_gpu_counts_against_the_cluster_when_its_size_is_known
               tests/test_bad_input.py::test_the_gpu_limit_itself_still_plans"
        timeout=120 ;;
    resolution_more)
        # The survivors of `resolution` once more, against the tests that reach resolution through rendering
        # and the argparse bridge (too slow to run for every mutant; the hypothesis rendering property, 10
        # random deployments through the whole render, is left out).
        modules="miles_sglang_plugin/planning/resolution.py"
        tests="tests/test_rendering.py tests/test_argparse_bridge.py
               --deselect=tests/test_rendering.py::test_random_deployments_render_and_parse"
        survivors_of=resolution
        timeout=120 ;;
    masking)
        modules="miles_sglang_plugin/masking.py"
        tests="tests/test_masking.py tests/test_rendering.py tests/test_standin.py::test_mask_argv
               tests/test_standin.py::test_api_key_never_in_errors
               tests/test_bad_input.py::test_mask_argv_masks_by_position
               tests/test_bad_input.py::test_an_api_key_that_starts_with_dashes_is_passed_whole_and_never_shown
               tests/test_bad_input.py::test_env_values_from_config_are_masked_unless_known_safe"
        timeout=120 ;;
    ports)
        modules="miles_sglang_plugin/rendering/ports.py"
        # test_bad_input.py: the lock directory (0700, a shared one refused, symlinks, another user's, a launch it refuses).
        tests="tests/test_ports.py tests/test_rendering.py
               tests/test_bad_input.py::test_the_lock_directory_is_made_0700_and_a_shared_one_is_refused_not_changed
               tests/test_bad_input.py::test_a_symlinked_lock_directory_is_refused
               tests/test_bad_input.py::test_a_lock_file_that_is_a_symlink_is_not_followed
               tests/test_bad_input.py::test_a_lock_directory_of_another_user_is_refused
               tests/test_bad_input.py::test_a_refused_lock_directory_fails_the_launch_saying_why"
        timeout=120 ;;
    launch_specs)
        modules="miles_sglang_plugin/rendering/launch_specs.py"
        # test_miles_parity.py: Miles' server args (LoRA, colocate defaults, fields this SGLang lacks);
        # test_bad_input.py: a key starting with dashes, the deploy settings' checks, env masking.
        tests="tests/test_launch_specs.py tests/test_rendering.py tests/test_miles_parity.py
               --deselect=tests/test_miles_parity.py::test_the_namespace_and_the_hydra_path_give_the_same_plan
               tests/test_bad_input.py::test_an_api_key_that_starts_with_dashes_is_passed_whole_and_never_shown
               tests/test_bad_input.py::test_sglangs_parser_takes_such_a_key_as_rendered
               tests/test_bad_input.py::test_server_defaults_are_checked_as_well
               tests/test_bad_input.py::test_launch_settings_are_checked_on_every_path
               tests/test_bad_input.py::test_settings_given_in_code_are_checked_too
               tests/test_bad_input.py::test_env_values_from_config_are_masked_unless_known_safe"
        timeout=120 ;;
    processes)
        modules="miles_sglang_plugin/backends/processes.py"
        # Not the tests whose launcher runs in a child Python (test_teardown.py, the script_run tests of
        # test_launcher_faults.py): that child imports the mutated package outside mutmut's run and fails.
        # Nor the 10 s readiness timeout: a mutant of this module cannot change when it fires.
        # test_bad_input.py: the bounded log tail, a log that cannot be written.
        tests="tests/test_processes.py tests/test_launcher_faults.py
               tests/test_bad_input.py::test_log_tail_reads_a_bounded_amount
               tests/test_bad_input.py::test_a_process_whose_log_cannot_be_written_is_not_started
               --deselect=tests/test_launcher_faults.py::test_engine_never_healthy_times_out_naming_it
               --deselect=tests/test_launcher_faults.py::test_ctrl_c_during_startup_stops_everything
               --deselect=tests/test_launcher_faults.py::test_sigterm_to_running_launcher_stops_everything
               --deselect=tests/test_launcher_faults.py::test_sigkill_of_launcher_kills_everything"
        timeout=60 ;;
    router_specs)
        modules="miles_sglang_plugin/rendering/router_specs.py"
        # Not test_routers.py's tests against the real router: it runs router_main in a child Python, which
        # imports the mutated package outside mutmut's run and fails (the unit tests reach the same code).
        tests="tests/test_registry.py tests/test_routers.py tests/test_schema.py
               --deselect=tests/test_routers.py::test_regular_round_robin
               --deselect=tests/test_routers.py::test_pd_mode_passes_bootstrap_fields
               --deselect=tests/test_routers.py::test_consistent_hashing_pins_routing_key
               --deselect=tests/test_routers.py::test_api_key
               --deselect=tests/test_routers.py::test_deregister_workers
               --deselect=tests/test_routers.py::test_router_main_port_in_use"
        timeout=120 ;;
    serving)
        # The reconciler's pure decisions (policies: backoff, budget, thresholds, routers, externals), the
        # ledger and the operations table, against their unit tests with a fake clock (a few seconds a run).
        modules="miles_sglang_plugin/serving/policy.py miles_sglang_plugin/serving/ledger.py
                 miles_sglang_plugin/serving/operations.py"
        tests="tests/test_reconciler_policy.py tests/test_reconciler_policy_more.py tests/test_ledger.py
               tests/test_sglang_requests.py"
        timeout=120 ;;
    *)
        echo "unknown set '$1' (resolution, masking, ports, launch_specs, processes, router_specs, serving)" >&2
        exit 2 ;;
    esac
    # Only tests that exist (a set may name a test file that a branch has not got yet).
    tests="$(for t in $tests; do [[ "$t" == --* || -e "$ROOT/${t%%::*}" ]] && echo "$t"; done)"
}

lines() { for word in $1; do printf '    %s\n' "$word"; done; }

# Mutants mutmut cannot run itself: _arm_parent_death_signal runs in the child between fork and exec (mutmut
# never sees a test reach it: "no tests"), _load_prctl once at import (before a mutant is switched on). Each is
# switched on by hand (MUTANT_UNDER_TEST) in the processes set's mutants/ and run against tests/test_processes.py
# (or an import). Needs the processes set to have run.
processes_child() {
    local mutants_dir="$ROOT/build/mutation/processes/mutants" module=miles_sglang_plugin.backends.processes
    local source=miles_sglang_plugin/backends/processes.py name verdict
    [ -d "$mutants_dir" ] || { echo "   run the processes set first" >&2; exit 2; }
    echo "== mutation set processes_child: $module (run by hand, one by one)"
    (
        cd "$mutants_dir"
        for name in $(grep -o "x__arm_parent_death_signal__mutmut_[0-9]*\b" "$source" | sort -uV); do
            verdict=survived
            MUTANT_UNDER_TEST="$module.$name" timeout 120 "$ROOT/.venv/bin/python" -m pytest -q -x \
                -p no:cacheprovider tests/test_processes.py >/dev/null 2>&1 || verdict=killed
            echo "    $module.$name: $verdict"
        done
        for name in $(grep -o "x__load_prctl__mutmut_[0-9]*\b" "$source" | sort -uV); do
            verdict=survived
            MUTANT_UNDER_TEST="$module.$name" "$ROOT/.venv/bin/python" -c \
                "import $module as m; assert m._PRCTL is not None" >/dev/null 2>&1 || verdict=killed
            echo "    $module.$name: $verdict"
        done
    ) | tee "$ROOT/build/mutation/processes/results-child.txt"
}

for set_name in "$@"; do
    if [ "$set_name" = processes_child ]; then
        processes_child
        continue
    fi
    config_for "$set_name"
    work="$ROOT/build/mutation/$set_name"
    rm -rf "$work"
    mkdir -p "$work"
    (
        cd "$ROOT"
        mapfile -d '' files < <(git ls-files -z --cached --others --exclude-standard)
        present=()
        for file in "${files[@]}"; do [ -e "$file" ] && present+=("$file"); done  # not the deleted ones
        cp --parents -t "$work" "${present[@]}"
    )
    rm -f "$work/setup.cfg"
    # setup.cfg: mutmut reads it when pyproject.toml has no [tool.mutmut] table.
    {
        echo "[mutmut]"
        echo "source_paths ="
        echo "    miles_sglang_plugin/"
        echo "only_mutate ="
        lines "$modules"
        echo "also_copy ="
        echo "    conf/"
        echo "    hydra_plugins/"
        echo "pytest_add_cli_args ="
        echo "    -p"
        echo "    no:cacheprovider"
        echo "    --timeout=$timeout"
        echo "pytest_add_cli_args_test_selection ="
        lines "$tests"
        echo "timeout_multiplier = 5.0"
        # Message text is not mutated: problems' and errors' wording is prose, not behaviour (the conditions
        # that raise them are mutated).
        echo "do_not_mutate_patterns ="
        echo '    problems\.add\('
        echo '    raise \w+Error\('
    } >"$work/setup.cfg"
    echo "== mutation set $set_name: $modules"
    start=$(date +%s)
    mutants="${MUTANTS:-}"
    if [ -z "$mutants" ] && [ -n "$survivors_of" ]; then
        mutants="$(grep ': survived' "$ROOT/build/mutation/$survivors_of/results.txt" | cut -d: -f1 | tr -d ' ')" ||
            { echo "   no survivors of $survivors_of to rerun"; continue; }
    fi
    rc=0
    # shellcheck disable=SC2086  # one argument per mutant name
    (cd "$work" && timeout --signal=INT "${MINUTES}m" "$MUTMUT" run --max-children 1 $mutants >mutmut-run.log 2>&1) || rc=$?
    if [ "$rc" -eq 124 ]; then
        echo "   stopped after $MINUTES minutes"
    elif [ "$rc" -ne 0 ]; then
        tail -n 40 "$work/mutmut-run.log"
        exit 1
    fi
    (cd "$work" && "$MUTMUT" results --all true >results.txt 2>&1 || true)
    echo "   $(($(date +%s) - start)) s; $(grep -c ': killed' "$work/results.txt" || true) killed," \
        "$(grep -c ': survived' "$work/results.txt" || true) survived;" \
        "survivors: (cd $work && $MUTMUT results)"
done
