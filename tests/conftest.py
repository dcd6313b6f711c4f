"""Shared test set-up: the offline models live under the repo's assets/ (made once, reused); the
fast tier's guard (a test not marked ``slow`` that starts the real stack fails, naming the fix)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import pathlib
import shlex
import subprocess
import sys
import time
import types
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, NoReturn

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# ---- two test processes (pytest-xdist: scripts/test.sh runs `-n 2 --dist loadgroup`) ----
# A serial run leaves one of the box's two cores idle about half the time (its jobs wait on
# spawns, polls and shutdowns); two workers fill it. Each worker and every process it starts
# (jobs, Monarch procs, engines) then gets one torch/OpenMP thread: two tests share two cores,
# and threads beyond the cores spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "xdist_group(name): tests of one group run in one xdist worker (conftest.py)")
    # trackio's local store (metrics.backends) is a user-wide folder: the tests' runs, in
    # process and in the jobs they start, write to one of their own, removed at the end.
    if "TRACKIO_DIR" not in os.environ:
        import tempfile

        config.stash[_TRACKIO_DIR] = os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(
            prefix="torchtitan_rl_tests_trackio_")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_unconfigure(config: pytest.Config) -> None:
    trackio_dir = config.stash.get(_TRACKIO_DIR, None)
    if trackio_dir is not None:
        import shutil

        shutil.rmtree(trackio_dir, ignore_errors=True)


_TRACKIO_DIR = pytest.StashKey[str]()


def _shared_fixture_group(item: pytest.Item) -> str | None:
    """The group of a test that uses a module- or session-scoped fixture of a test module or
    package (a warmed engine, a finished job): its users share one worker, so the fixture is
    built once. ``tiny_model_dir`` is cheap (made once on disk) and built in each worker."""
    fixture_info = getattr(item, "_fixtureinfo", None)
    if fixture_info is None:
        return None
    for name in item.fixturenames:  # type: ignore[attr-defined]
        for fixture_def in fixture_info.name2fixturedefs.get(name, ()):
            # pytest's and plugins' own fixtures (tmp_path_factory...) have no base id
            if name == "tiny_model_dir" or not fixture_def.baseid:
                continue
            if fixture_def.scope == "module":
                return item.nodeid.split("::")[0]
            if fixture_def.scope == "session":
                return f"session:{name}"
    return None


def pytest_itemcollected(item: pytest.Item) -> None:
    # At collection, before any collection_modifyitems hook: xdist's reads the groups into the
    # node ids it schedules by.
    if item.get_closest_marker("xdist_group") is None and (
            group := _shared_fixture_group(item)) is not None:
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Slow tests first (a stable sort: a shuffled run stays shuffled within each tier): xdist
    # hands out tests in this order, so the many short fast tests fill the run's end on one
    # worker while the other finishes its last slow test, instead of that worker idling.
    items.sort(key=lambda item: "slow" not in item.keywords)
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="module")
def _collect_dropped_vllm_engines() -> Iterator[None]:
    """At the end of each test module: if this worker holds a torch process group, an in-process
    vLLM engine made it, and one that was dropped but not yet collected would tear down that
    group and vLLM's own (EngineCore.shutdown) whenever the garbage collector reaches it, in the
    middle of a later test's collective or engine step. Collect it here instead."""
    yield
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        import gc

        gc.collect()


# ---- the suite's time budget (docs/testing.md) ----
# Compared at the end of a run of the whole suite or of the fast tier: a warning, not a failure
# (boxes differ), so that growth is seen in the run that caused it.
WHOLE_SUITE_BUDGET_S = 720.0
FAST_TIER_BUDGET_S = 120.0
_SESSION_START = time.monotonic()


def pytest_sessionstart(session: pytest.Session) -> None:
    global _SESSION_START
    _SESSION_START = time.monotonic()


@pytest.hookimpl(trylast=True)  # after the durations report: the run's last lines
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    wall_s = time.monotonic() - _SESSION_START
    if config.getoption("collectonly"):
        return
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or config.getoption("keyword"):
        terminalreporter.write_line(f"wall time {wall_s:.0f} s (a selection: no budget)")
        return
    markexpr = config.getoption("markexpr")
    budget_s, tier = {"": (WHOLE_SUITE_BUDGET_S, "whole suite"),
                      "not slow": (FAST_TIER_BUDGET_S, "fast tier")}.get(markexpr, (None, None))
    if budget_s is None:
        terminalreporter.write_line(f"wall time {wall_s:.0f} s (-m {markexpr!r}: no budget)")
    elif wall_s > budget_s:
        terminalreporter.write_line(
            f"WARNING: wall time {wall_s:.0f} s is over the {tier}'s budget of {budget_s:.0f} s "
            "(docs/testing.md): find what grew in the slowest tests above", yellow=True, bold=True)
    else:
        terminalreporter.write_line(
            f"wall time {wall_s:.0f} s, within the {tier}'s budget of {budget_s:.0f} s", green=True)


@pytest.fixture(scope="session")
def tiny_model_dir() -> pathlib.Path:
    from torchtitan_rl.assets.make_model import ensure_model

    return ensure_model("tiny", REPO_ROOT / "assets" / "models")


@pytest.fixture(scope="session")
def letters_toml_run(
        tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
    """``python -m torchtitan_rl.train --config LETTERS_TOML`` run once for every test that reads
    its run folder or console (the eval command's tests, the test-defined task's): the run
    folder and the finished process."""
    from tests.controller.jobs import LETTERS_TOML, LETTERS_VALIDATION, run_module

    out = tmp_path_factory.mktemp("letters_toml")
    proc = run_module("torchtitan_rl.train", "--config", LETTERS_TOML, "--output_dir", str(out),
                      *LETTERS_VALIDATION,
                      "--validation.greedy_reference", "true",  # a job's option, not eval's
                      # every tracker (tests/metrics/test_metrics_sinks_job.py reads them back)
                      "--metrics.backends", "tensorboard,wandb,trackio,mlflow")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "letters", proc


# ---- the fast tier's guard ----
# `scripts/test.sh --fast` runs `-m "not slow"`. A test that starts the real stack without the mark
# would make that tier slow (or hang it) unnoticed, so for every item not marked slow, setup, call
# and teardown included (a module- or session-scoped fixture is built in the first item that uses
# it), these entry points fail instead. The failure is pytest.fail's, a BaseException: code under
# test that catches Exception (a run's error report) cannot turn it into a pass.

# (module, attribute path in it, what calling it starts). Patched only once the module is imported:
# importing vLLM's engine module alone takes ~10 s, which a fast test must not pay for the guard.
PROCESS_STARTS: list[tuple[str, str, str]] = [
    ("vllm.v1.engine.llm_engine", "LLMEngine.from_engine_args", "a vLLM engine"),
    ("vllm.v1.engine.llm_engine", "LLMEngine.__init__", "a vLLM engine"),
    ("torchtitan_rl.generator.vllm_engine", "build_engine", "a vLLM engine"),
    ("monarch.actor", "HostMesh.spawn_procs", "Monarch procs"),
    ("monarch.actor", "ProcMesh.spawn", "a Monarch actor"),
    ("torch.multiprocessing", "start_processes", "torch.multiprocessing ranks"),
    ("torch.multiprocessing", "spawn", "torch.multiprocessing ranks"),
]
# `python -m X` subprocesses that run a job, a worker, torchrun ranks or a vLLM server (even one
# that only prints its config: it pays the job's imports, seconds each).
STACK_MODULES = ("torchtitan_rl.train", "torchtitan_rl.eval", "torchtitan_rl.worker",
                 "tests.controller.run_tiny_job", "torch.distributed.run", "vllm")
STACK_COMMANDS = ("torchrun", "vllm")


def _refuse(what: str) -> NoReturn:
    pytest.fail(f"this test starts {what}, but it is not marked slow: mark this test slow "
                "(@pytest.mark.slow, or pytestmark = pytest.mark.slow for the whole module). "
                "`scripts/test.sh --fast` runs only tests that start no vLLM engine, Monarch "
                "proc or actor, and no training or job process (docs/testing.md).")


def _refusing(what: str) -> Callable[..., NoReturn]:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        _refuse(what)

    return refuse


def _patch_process_starts(module: types.ModuleType, mp: pytest.MonkeyPatch) -> None:
    for name, path, what in PROCESS_STARTS:
        if name == module.__name__:
            *owner_path, attribute = path.split(".")
            owner: Any = module
            for part in owner_path:
                owner = getattr(owner, part)
            mp.setattr(owner, attribute, _refusing(what))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a module of PROCESS_STARTS right after a fast test first imports it."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.mp = mp

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in {name for name, _, _ in PROCESS_STARTS}:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def exec_then_patch(module: types.ModuleType) -> None:
            exec_module(module)
            _patch_process_starts(module, self.mp)

        loader.exec_module = exec_then_patch  # a loader per module spec: no other module sees it
        return spec


def _stack_command(args: Any) -> str | None:
    """The module or command of a Popen ``args`` that would start the real stack, else None."""
    if isinstance(args, (str, bytes, os.PathLike)):
        argv = shlex.split(os.fsdecode(args))
    else:
        argv = [os.fsdecode(arg) for arg in args]
    for flag, module in zip(argv, argv[1:]):
        if flag == "-m" and any(module == m or module.startswith(f"{m}.") for m in STACK_MODULES):
            return f"python -m {module}"
    if argv and os.path.basename(argv[0]) in STACK_COMMANDS:
        return argv[0]
    return None


def _refuse_stack_subprocesses(mp: pytest.MonkeyPatch) -> None:
    # _execute_child: every Popen (subprocess.run, asyncio's subprocesses) goes through it, and
    # Popen cleans up its pipes when it raises.
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> Any:
        if (command := _stack_command(args)) is not None:
            _refuse(f"a `{command}` subprocess")
        return execute_child(self, args, *rest, **kwargs)

    mp.setattr(subprocess.Popen, "_execute_child", guarded)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item,
                            nextitem: pytest.Item | None) -> Generator[None, object, object]:
    if item.get_closest_marker("slow") is not None:
        return (yield)
    with pytest.MonkeyPatch.context() as mp:
        for name in {name for name, _, _ in PROCESS_STARTS}:
            if name in sys.modules:
                _patch_process_starts(sys.modules[name], mp)
        _refuse_stack_subprocesses(mp)
        finder = _PatchOnImport(mp)
        sys.meta_path.insert(0, finder)
        try:
            return (yield)
        finally:
            sys.meta_path.remove(finder)


# ---- Monarch failures reported outside a run ------------------------------------------------------
# A run's MeshFailureWatch handles its meshes' failures while it runs. Outside one, Monarch's default
# hook raises a KeyboardInterrupt in the main thread: in a pytest worker that ends the worker and
# every test still queued on it, whichever test happens to run (a proc mesh stopped by an earlier
# test can report its exit late, monarch's own tests note `stop()` exiting 1 now and then). Here
# such a report is a warning in the test's log; a test whose own actors die still sees its calls
# fail (SupervisionError).
def _log_unhandled_mesh_failure(failure: Any) -> None:
    import logging

    logging.getLogger("tests.monarch").warning(
        "Monarch mesh failure outside a run (not fatal in tests): %s",
        " ".join(str(failure.report()).split()))


def pytest_runtest_setup(item: pytest.Item) -> None:
    actor = sys.modules.get("monarch.actor")
    if actor is not None and actor.unhandled_fault_hook is not _log_unhandled_mesh_failure:
        actor.unhandled_fault_hook = _log_unhandled_mesh_failure
