#!/usr/bin/env bash
# Runs each test tier (a make target) in turn, whatever became of the ones before, and prints a summary:
#
#   bash scripts/run-tiers.sh test-quick test-slow test-ray ...
#
# Each tier's exit status and seconds are recorded, and the disk space left when it ended (a tier whose install
# fills the disk fails, and so may the ones after it); the summary (tier / result / seconds / GB free) comes at
# the end, and the script fails when any tier failed. A tier is a make target; its name in the summary drops the "test-"
# prefix (test-quick: quick). Ctrl-C stops it after the tier that was running (no further tier starts).
set -uo pipefail

if [ "$#" -eq 0 ]; then
    echo "usage: $0 TARGET..." >&2
    exit 2
fi

make_cmd=${MAKE:-make}
interrupted=0
trap 'interrupted=1' INT TERM
names=()
results=()
seconds=()
free=()
failed=0

# GB free on the file system of the working directory (where the venvs are), one decimal.
free_gb() {
    df -Pk . 2>/dev/null | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }'
}

echo "=== tiers: $(free_gb) GB free on disk at the start"

for target in "$@"; do
    name=${target#test-}
    echo "=== tier ${name}: ${make_cmd} ${target}"
    started=$(date +%s)
    ${make_cmd} --no-print-directory "${target}"
    status=$?
    names+=("${name}")
    seconds+=("$(($(date +%s) - started))")
    free+=("$(free_gb)")
    if [ "${status}" -eq 0 ]; then
        results+=("passed")
    else
        results+=("FAILED (exit ${status})")
        failed=$((failed + 1))
    fi
    if [ "${interrupted}" -eq 1 ]; then
        break
    fi
done

echo
echo "=== tiers: summary"
printf '%-14s %-18s %8s %8s\n' tier result seconds 'GB free'
for i in "${!names[@]}"; do
    printf '%-14s %-18s %8s %8s\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}" "${free[$i]}"
done
if [ "${interrupted}" -eq 1 ] && [ "${#names[@]}" -lt "$#" ]; then
    echo "interrupted: $(($# - ${#names[@]})) tier(s) not run"
    exit 130
fi
if [ "${failed}" -gt 0 ]; then
    echo "${failed} of $# tier(s) failed"
    exit 1
fi
echo "all $# tier(s) passed"
