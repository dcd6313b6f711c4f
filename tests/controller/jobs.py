"""Tiny end-to-end job configs for the controller tests (real vLLM, torchtitan and Monarch)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

from tests.controller.letter_task import LetterTask
from torchtitan_rl.assets.model_source import ModelSource
from torchtitan_rl.controller.checkpoint.checkpointer import Checkpointer
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.controller.loop.loop import TrainingLoop
from torchtitan_rl.controller.loop.staleness import StalenessGate
from torchtitan_rl.controller.loop.validation import Validator
from torchtitan_rl.faults import ENV_VAR
from torchtitan_rl.generator.generator import Generator
from torchtitan_rl.rollout.recorder import RolloutRecorder
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.core import OptimizerConfig
from torchtitan_rl.trainer.loss import PolicyLoss
from torchtitan_rl.trainer.trainer import PolicyTrainer
from torchtitan_rl.types import Sampling

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

TINY_MODEL_BYTES = 558_848
"""One push of the tiny model's weights (float32; its tied embedding and output head once)."""


def tiny_job(output_dir: pathlib.Path, name: str, *, num_steps: int = 3,
             max_staleness: int = 0, **loop_kwargs) -> RLJob.Config:
    """Three short single-turn GRPO steps on the tiny model; bit-reproducible on CPU (the PPO
    ratio is taken against the trainer's own logprobs, see PolicyLoss.ratio_reference).
    ``max_staleness`` 0 is synchronous training."""
    return RLJob.Config(
        name=name,
        output_dir=str(output_dir),
        seed=0,
        model=ModelSource.Config(size="tiny", assets_dir=str(REPO_ROOT / "assets" / "models")),
        task=LetterTask.Config(),
        rollouter=Rollouter.Config(group_size=4, max_rollout_tokens=96),
        sampling=Sampling(max_tokens=12),
        generator=Generator.Config(max_model_len=128, kv_cache_bytes=32 << 20),
        batcher=Batcher.Config(seq_len=96),
        trainer=PolicyTrainer.Config(
            optimizer=OptimizerConfig(lr=1e-2),
            loss=PolicyLoss.Config(ratio_reference="trainer"),
            num_threads=1,
        ),
        loop=TrainingLoop.Config(
            num_steps=num_steps, groups_per_step=2,
            staleness=StalenessGate.Config(max_staleness=max_staleness), **loop_kwargs),
        validation=Validator.Config(num_prompts=2),
        checkpoint=Checkpointer.Config(every_steps=1),
        recorder=RolloutRecorder.Config(every_k_steps=1),
    )


STAND_IN_TOKENS_PER_S = 20_000.0
"""The stand-in engine's pace: a tiny vLLM engine's order of magnitude on this CPU."""


def on_stand_in_engines(config: RLJob.Config) -> RLJob.Config:
    """``config`` with the stand-in engine (generator/stand_in_engine.py): the same actors,
    procs, pushes and tokens labelled by version, without vLLM's start-up in each generator. For
    tests about the controller and the processes, not the tokens; every behaviour keeps a test
    on real vLLM too."""
    return dataclasses.replace(config, generator=dataclasses.replace(
        config.generator, engine="stand_in", stand_in_tokens_per_s=STAND_IN_TOKENS_PER_S))


LETTERS_TOML = "tests/controller/tiny_letter_job.toml"
"""A 2-step job of a task defined only in tests (tests/controller/letter_task.py), from TOML."""
# Sampled validation (temperature 1, 4 samples of 16 episodes): a reward with spread, so an eval
# that agrees with it means the same tokens, not just a constant greedy reply.
LETTERS_VALIDATION = ["--validation.num_prompts", "16", "--validation.samples_per_prompt", "4",
                      "--validation.temperature", "1.0",
                      # prompts 1, 4, 7, ... raise in score(): the failing-task checks (a run
                      # that goes on) and dynamic sampling's (their groups are replaced)
                      "--task.broken_score_every", "3"]


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m module ARGS`` from the repository root, as a user runs it (the log level
    theirs, not a test's)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("TORCHTITAN_RL_LOG_LEVEL", None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)



def env_without_faults(fault: str | None = None) -> dict[str, str]:
    """This process's environment for a job subprocess: no injected fault but ``fault``."""
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    if fault is not None:
        env[ENV_VAR] = fault
    return env


def read_metrics(run_dir: pathlib.Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl as {step: merged metrics} (later lines of a step win, as after a resume)."""
    by_step: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record.pop("step"), {}).update(record)
    return by_step


def assert_every_group_trained_once(run_dir: pathlib.Path, num_steps: int,
                                    num_prompts: int) -> None:
    """trained_samples.jsonl: every step once, every group once (none lost, none twice), no
    sample twice."""
    steps = [json.loads(line) for line in
             (run_dir / "trained_samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(num_steps))  # every step once
    group_ids = [g for s in steps for g in s["group_ids"]]
    assert sorted(group_ids) == list(range(num_prompts))  # every group once, none twice
    sample_ids = [i for s in steps for i in s["sample_ids"]]
    assert len(sample_ids) == len(set(sample_ids))


def read_hf_weights(directory: pathlib.Path) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


class LogWatch:
    """Reads a process's stderr on a thread; ``wait_for`` blocks until a line matches."""

    def __init__(self, stream) -> None:
        import threading

        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._closed = False
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout_s: float = 600.0):
        import re

        regex = re.compile(pattern)
        with self._changed:
            seen = 0
            while True:
                for line in self._lines[seen:]:
                    if match := regex.search(line):
                        return match
                seen = len(self._lines)
                assert not self._closed, f"process ended before {pattern!r}: {self.text()[-3000:]}"
                assert self._changed.wait(timeout_s), f"no {pattern!r} in {timeout_s} s"

    def text(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def wait_closed(self, timeout_s: float = 60.0) -> None:
        """Until the stream ended (every line read)."""
        with self._changed:
            assert self._changed.wait_for(lambda: self._closed, timeout_s), "stream still open"


def run_killing_generator_0(out: pathlib.Path, name: str, num_steps: int, *args: str,
                            then: tuple[int, ...] = ()) -> tuple[int, str, str]:
    """``tests.controller.run_tiny_job`` in a process of its own; generator_0 (its pid from
    the controller's log) is SIGKILLed from outside once step 1 has trained, then each generator
    of ``then`` in turn, the k-th once step k + 1 has trained. Returns the exit code, stdout and
    stderr."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.controller.run_tiny_job", str(out), name, str(num_steps),
         *args],
        cwd=REPO_ROOT, env=env_without_faults(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    log = LogWatch(proc.stderr)
    try:
        victims = (0, *then)
        for step, victim in enumerate(victims, start=1):
            started = log.wait_for(rf"generator generator_{victim} started \(tp=1, pids (\d+) ")
            log.wait_for(rf"step={step} ")
            os.kill(int(started.group(1)), signal.SIGKILL)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout = proc.stdout.read()
    proc.wait()
    log.wait_closed()
    return proc.returncode, stdout, log.text()
