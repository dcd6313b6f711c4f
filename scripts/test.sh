#!/usr/bin/env bash
# The test suite: set up .venv (first time only), then run pytest. Extra arguments go to pytest.
#   --fast  only the tests not marked slow: no vLLM engine, Monarch proc or training run, and
#           the linter (about a minute on 2 cores; docs/testing.md). CI runs the whole suite.
# Two test processes share the box's two cores (pytest-xdist; TEST_WORKERS=0 runs in one process,
# e.g. for pdb). Every run prints its 15 slowest tests and compares its wall time with the budget
# (docs/testing.md). `--random-order` shuffles the tests (with a seed it prints, which every
# worker shares; `--random-order-seed=N` repeats an order).
# pytest exits 5 when it collected no test: that is a failure here, never a silent pass.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh --browser || exit 1
export VLLM_ENABLE_V1_MULTIPROCESSING=0
# Bytecode is written once and read by every later process (controller, trainer, generators):
# with PYTHONDONTWRITEBYTECODE set (some boxes set it), each would compile torch's, vLLM's and
# this repo's modules from source. The installer writes none; the first import does. This repo's
# own modules are compiled up front, in parallel.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -m compileall -q -j 0 torchtitan_rl tests bench > /dev/null
# --no-loadscope-reorder: xdist would hand out the groups largest first (by their number of
# tests), which put single-test slow modules at the run's end with the other worker idle; the
# collection's order (slow tests first, tests/conftest.py) is kept instead.
args=(--durations=15 -n "${TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder)
for arg in "$@"; do
    case "$arg" in
        --fast) args+=(-m "not slow" --timeout 120) ;;
        --random-order) args+=("--random-order-seed=$RANDOM") ;;
        *) args+=("$arg") ;;
    esac
done
.venv/bin/python -m pytest "${args[@]}"
status=$?
if [ "$status" -eq 5 ]; then
    echo "[test] pytest collected no tests: failing" >&2
    exit 1
fi
exit "$status"
