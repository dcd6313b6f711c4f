#!/usr/bin/env bash
# The main job: set up .venv (first time only), then run GRPO on AlphabetSort on this CPU.
# Extra arguments are passed to `python -m torchtitan_rl.train` (e.g. --loop.num_steps 3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh
export VLLM_ENABLE_V1_MULTIPROCESSING=0
# The first import writes the bytecode of .venv's modules (the installer writes none), and every
# later process reads it, even where PYTHONDONTWRITEBYTECODE is set.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m torchtitan_rl.train --config run_configs/alphabet_sort_cpu.toml "$@"
