#!/usr/bin/env bash
# The main job: set up .venv (first time only), then run GRPO on AlphabetSort on this CPU.
# Extra arguments are passed to `python -m torchtitan_rl.train` (e.g. --loop.num_steps 3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh
export VLLM_ENABLE_V1_MULTIPROCESSING=0
exec .venv/bin/python -m torchtitan_rl.train --config run_configs/alphabet_sort_cpu.toml "$@"
