#!/usr/bin/env bash
# The test suite: set up .venv (first time only), then run pytest. Extra arguments go to pytest.
# pytest exits 5 when it collected no test: that is a failure here, never a silent pass.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh || exit 1
export VLLM_ENABLE_V1_MULTIPROCESSING=0
.venv/bin/python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "[test] pytest collected no tests: failing" >&2
    exit 1
fi
exit "$status"
