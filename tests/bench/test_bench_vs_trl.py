"""bench/vs_trl.py's pure logic: our settings -> TRL's GRPOConfig arguments, the refusals, the
prompt order and the pin the bench installs. No TRL, no process."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import tomllib

import pytest

from torchtitan_rl.controller.loop.data_cursor import DataCursor
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.trainer.core import PolicyTrainerCore
from torchtitan_rl.trainer.trainer import PolicyTrainer
from torchtitan_rl.types import Sampling

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", REPO_ROOT / "bench" / "vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vs_trl = _bench()


def _parts(**trainer_changes):
    sampling = Sampling(max_tokens=12, temperature=0.7, top_p=0.9, top_k=-1)
    rollouter = Rollouter.Config(group_size=8, max_turns=1, advantage_std="none",
                                 drop_zero_std_groups=False)
    trainer = PolicyTrainer.Config()
    trainer = dataclasses.replace(
        trainer, optimizer=dataclasses.replace(trainer.optimizer, lr=1e-3, beta2=0.98, eps=1e-7,
                                               weight_decay=0.01),
        **trainer_changes)
    return sampling, rollouter, trainer


def _arguments(sampling, rollouter, trainer, **kw):
    return vs_trl.trl_arguments(sampling=sampling, rollouter=rollouter, trainer=trainer,
                                groups_per_step=kw.get("groups_per_step", 16),
                                max_staleness=kw.get("max_staleness", 0), steps=20, seed=3)


def test_trl_arguments_carry_every_shared_setting() -> None:
    sampling, rollouter, trainer = _parts()
    args = _arguments(sampling, rollouter, trainer)
    assert args["num_generations"] == 8
    assert args["per_device_train_batch_size"] == 128 and args["gradient_accumulation_steps"] == 1
    assert args["max_completion_length"] == 12
    assert (args["temperature"], args["top_p"], args["top_k"]) == (0.7, 0.9, 0)
    assert (args["learning_rate"], args["adam_beta1"], args["adam_beta2"], args["adam_epsilon"],
            args["weight_decay"]) == (1e-3, 0.9, 0.98, 1e-7, 0.01)
    assert args["lr_scheduler_type"] == "constant"
    assert args["max_grad_norm"] == 1.0
    assert (args["loss_type"], args["epsilon"], args["epsilon_high"], args["beta"]) == (
        "dapo", 0.2, 0.2, 0.0)
    assert args["scale_rewards"] == "none"
    assert (args["max_steps"], args["seed"], args["shuffle_dataset"]) == (20, 3, False)
    assert args["bf16"] is False and args["gradient_checkpointing"] is False


def test_aggregations_map_to_the_loss_type_of_the_same_formula() -> None:
    sampling, rollouter, trainer = _parts()
    for aggregation, loss_type in (("token-mean", "dapo"), ("seq-mean-token-mean", "grpo")):
        changed = dataclasses.replace(trainer, loss=dataclasses.replace(
            trainer.loss, aggregation=aggregation))
        assert _arguments(sampling, rollouter, changed)["loss_type"] == loss_type
    dr_grpo = dataclasses.replace(trainer, loss=dataclasses.replace(
        trainer.loss, aggregation="seq-mean-token-sum-norm", norm_length=12))
    assert _arguments(sampling, rollouter, dr_grpo)["loss_type"] == "dr_grpo"
    # Dr. GRPO's constant is TRL's max_completion_length: another constant is refused
    other_norm = dataclasses.replace(trainer, loss=dataclasses.replace(
        trainer.loss, aggregation="seq-mean-token-sum-norm", norm_length=256))
    with pytest.raises(ValueError, match=r"^trainer\.loss\.aggregation:"):
        _arguments(sampling, rollouter, other_norm)


def test_warmup_factor_is_the_trainers_schedule() -> None:
    for warmup in (0, 1, 2, 5):
        trainer = PolicyTrainer.Config(lr_warmup_steps=warmup)
        core = PolicyTrainerCore.__new__(PolicyTrainerCore)  # _lr_at reads config and lora only
        core.config, core.lora = trainer, None
        for step in range(7):
            assert vs_trl.warmup_factor(step, warmup) * trainer.optimizer.lr == core._lr_at(step)
    assert vs_trl.warmup_factor(0, 2) == 0.5  # HF's constant_with_warmup would give 0 here


def test_clip_higher_and_sample_std_map() -> None:
    sampling, rollouter, trainer = _parts()
    trainer = dataclasses.replace(trainer, loss=dataclasses.replace(trainer.loss, clip_high=0.28))
    args = _arguments(sampling, dataclasses.replace(rollouter, advantage_std="sample"), trainer)
    assert (args["epsilon"], args["epsilon_high"]) == (0.2, 0.28)
    assert args["scale_rewards"] == "group"


@pytest.mark.parametrize("key, change", [
    ("rollouter.drop_zero_std_groups", {"rollouter": {"drop_zero_std_groups": True}}),
    ("rollouter.max_turns", {"rollouter": {"max_turns": 3}}),
    ("rollouter.advantage", {"rollouter": {"advantage": "rloo"}}),
    ("rollouter.advantage_std", {"rollouter": {"advantage_std": "population"}}),
    ("trainer.loss.policy_loss", {"loss": {"policy_loss": "cispo"}}),
    ("trainer.loss.clip_ratio_c", {"loss": {"clip_ratio_c": 3.0}}),
    ("trainer.loss.off_policy", {"loss": {"tis_cap": 2.0}}),
    ("loop.staleness.max_staleness", {"max_staleness": 1}),
])
def test_settings_trl_cannot_express_are_refused_by_key(key, change) -> None:
    sampling, rollouter, trainer = _parts()
    if "rollouter" in change:
        rollouter = dataclasses.replace(rollouter, **change["rollouter"])
    if "loss" in change:
        trainer = dataclasses.replace(trainer, loss=dataclasses.replace(trainer.loss,
                                                                         **change["loss"]))
    with pytest.raises(ValueError, match=rf"^{key.replace('.', r'[.]')}: no TRL equivalent"):
        _arguments(sampling, rollouter, trainer, max_staleness=change.get("max_staleness", 0))


def test_prompt_order_is_the_data_cursors_groups_in_order() -> None:
    order = vs_trl.prompt_order(num_prompts=50, seed=4, steps=3, groups_per_step=16)
    cursor = DataCursor(num_prompts=50, seed=4)
    assert order == [cursor.prompt_index(g) for g in range(48)]
    assert sorted(order[:48]) != order[:48]  # shuffled, as the job draws them


def test_job_options_turn_off_what_trl_lacks() -> None:
    options = vs_trl.job_options(model_dir="m", steps=5, seed=2)
    pairs = dict(zip(options[::2], options[1::2]))
    assert pairs["--rollouter.drop_zero_std_groups"] == "false"
    assert pairs["--warm_start.enabled"] == "false" and pairs["--model.path"] == "m"
    assert (pairs["--seed"], pairs["--loop.num_steps"]) == ("2", "5")


def test_median_after_first_leaves_out_the_start_up_step() -> None:
    assert vs_trl.median_after_first([9.0, 1.0, 2.0, 3.0]) == 2.0
    assert vs_trl.median_after_first([4.0]) == 4.0


def test_bench_installs_the_pin_of_the_bench_extra() -> None:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["bench"] == [vs_trl.TRL_REQUIREMENT]


def test_eval_gets_the_job_options_eval_takes() -> None:
    job_args = ["--task.max_turns", "1", "--rollouter.max_turns=1", "--trainer.optimizer.lr",
                "1e-4", "--validation.num_prompts", "64", "--loop.groups_per_step=8"]
    assert vs_trl.eval_options(job_args) == ["--task.max_turns", "1", "--rollouter.max_turns=1",
                                             "--validation.num_prompts", "64"]
