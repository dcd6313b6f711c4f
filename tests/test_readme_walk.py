"""The README's walk ("One prompt, from the data set to new weights") stays true: every file it
names exists with the length it gives, and every project module those files import at run time
is either on the walk or named below with the reason a reader following one prompt of the main
job does not open it. A module that joins the prompt's path fails this test until the walk (or
this list) says where it stands."""

from __future__ import annotations

import pathlib
import re

from tests.test_import_layers import PACKAGE, imports, modules

README = PACKAGE.parent / "README.md"
STEP = re.compile(r"^\d+\. `([\w/]+\.py)` \((\d+) lines\)", re.M)

NOT_OPENED: dict[str, str] = {
    # the task: the user's
    "torchtitan_rl.task": "the user's task",
    # configs and process plumbing
    "torchtitan_rl.config": "config classes and errors",
    "torchtitan_rl.console": "console and log set-up",
    "torchtitan_rl.faults": "fault injection for tests",
    "torchtitan_rl.metrics": "metric files",
    "torchtitan_rl.rollout.recorder": "the rollouts' log file",
    "torchtitan_rl.generator": "the package's re-exports (generator/__init__.py)",
    "torchtitan_rl.rollout": "the package's re-exports (rollout/__init__.py)",
    # start-up and other launches, around the prompt's path
    "torchtitan_rl.assets.model_source": "the model, made or found once (start-up)",
    "torchtitan_rl.assets.warm_start": "the warm start, trained once or cached (start-up)",
    "torchtitan_rl.assets.tokenizer": "the tokenizer, loaded once (start-up)",
    "torchtitan_rl.threads": "each process's threads, set once (start-up)",
    "torchtitan_rl.controller.resume": "a rerun's resume from a checkpoint",
    "torchtitan_rl.controller.trainer_restart": "a lost trainer's restart",
    "torchtitan_rl.controller.torchrun": "the torchrun launch (placement.kind = 'torchrun')",
    # around the step, not on the prompt's path
    "torchtitan_rl.controller.checkpoint": "checkpoints, every K steps",
    "torchtitan_rl.controller.loop.validation": "held-out validation, before and after",
    "torchtitan_rl.controller.loop.idle_ratios": "step metrics",
    "torchtitan_rl.controller.loop.run_health": "step metrics, the run's health warnings",
    "torchtitan_rl.controller.loop.constant_answer": "validation's constant-answer baseline",
    "torchtitan_rl.controller.supervision": "lost meshes and their replacement",
    "torchtitan_rl.controller.hosts": "where the meshes were spawned (start-up)",
    "torchtitan_rl.generator.engine_setup": "building a generator's engine loop (start-up)",
    "torchtitan_rl.trainer.parallel": "the model's parallelism, set up once",
    "torchtitan_rl.trainer.checkpoint": "checkpoints",
    "torchtitan_rl.trainer.flops": "MFU metrics",
    "torchtitan_rl.trainer.batch_log": "a debug log (trainer.debug_batch_log)",
    "torchtitan_rl.trainer.timeline": "each rank's spans for the run's trace (trace.json)",
    "torchtitan_rl.trainer.kl": "the KL term (trainer.loss.kl_coef > 0)",
    "torchtitan_rl.trainer.off_policy": "the off-policy correction's weights, masks and mismatch "
                                        "metrics (trainer.loss.off_policy)",
    "torchtitan_rl.trainer.critic": "PPO's critic (trainer.critic.enabled)",
    "torchtitan_rl.trainer.reference": "the KL term's reference model (trainer.loss.kl_coef > 0)",
    "torchtitan_rl.trainer.minibatches": "several updates a step (trainer.num_minibatches, "
                                         "trainer.ppo_epochs)",
    "torchtitan_rl.trainer.lora": "LoRA adapters (trainer.lora.enabled)",
    "torchtitan_rl.assets.make_model": "the base model's digest (a LoRA checkpoint)",
    "torchtitan_rl.weight_sync.lora_pull": "an adapter push (trainer.lora.push)",
    "torchtitan_rl.monarch_failures": "whether an error means a dead actor (error paths)",
    "torchtitan_rl.models": "the model, built once; its HF names for the push",
    # other settings than the main job's
    "torchtitan_rl.controller.rollout_workers": "rollouter.num_workers > 0",
    "torchtitan_rl.controller.fleet.requests": "generators added or removed on request",
    "torchtitan_rl.generator.partial_rollout": "loop.partial_rollout = 'abort'",
    "torchtitan_rl.generator.stand_in_engine": "generator.engine = 'stand_in'",
    "torchtitan_rl.weight_sync.relay": "generators off the trainer's machine",
    "torchtitan_rl.rollout.agent_task": "agent programs as tasks",
    "torchtitan_rl.rollout.agent_capture": "agent programs as tasks",
}


def walk() -> list[tuple[str, int]]:
    text = README.read_text()
    section = text[text.index("## One prompt, from the data set to new weights"):]
    section = section[:section.index("\n## ", 1)]
    return [(path, int(lines)) for path, lines in STEP.findall(section)]


def _not_opened(module: str) -> bool:
    return any(module == name or module.startswith(f"{name}.") for name in NOT_OPENED)


def test_the_walk_names_files_that_exist_with_their_lengths() -> None:
    steps = walk()
    assert len(steps) >= 10, "the README's walk was not found"
    wrong = {}
    for path, lines in steps:
        file = PACKAGE / path
        assert file.is_file(), f"README walk: {path} does not exist"
        actual = len(file.read_text().splitlines())
        if actual != lines:
            wrong[path] = (lines, actual)
    assert not wrong, f"README walk: (lines given, lines now) {wrong}"
    assert len({path for path, _ in steps}) == len(steps), "a file appears twice on the walk"


def test_every_module_the_walk_imports_is_on_it_or_named_as_not_opened() -> None:
    known = modules()
    on_walk = {".".join(pathlib.Path("torchtitan_rl", path).with_suffix("").parts)
               for path, _ in walk()}
    missing: dict[str, list[str]] = {}
    for module in sorted(on_walk):
        for _, target in imports(known[module], known, runtime_only=True):
            if target in known and target not in on_walk and not _not_opened(target):
                missing.setdefault(target, []).append(module)
    assert not missing, ("imported by the walk's files, but neither on the README's walk nor in "
                         f"NOT_OPENED: {missing}")


def test_every_reason_names_a_module_that_exists() -> None:
    known = modules()
    stale = [name for name in NOT_OPENED
             if not any(m == name or m.startswith(f"{name}.") for m in known)]
    assert not stale, f"NOT_OPENED names modules that do not exist: {stale}"
