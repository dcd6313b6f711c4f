"""ReasoningGymTask (torchtitan_rl/envs/reasoning_gym.py): episodes fixed by (seed, split, index),
a validation split that shares no question with training, rewards that are reasoning-gym's own
``score_answer`` unchanged, solved conversations that score 1, the config's one-line errors, the
``type = "reasoning_gym"`` short name, and a tokenizer trained on the task's own text."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest

from torchtitan_rl.assets.model_source import ModelSource
from torchtitan_rl.assets.tokenizer import load_tokenizer
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import parse_args
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.envs import reasoning_gym as rg_task
from torchtitan_rl.envs.reasoning_gym import DatasetSpec, ReasoningGymTask, is_validation_question
from torchtitan_rl.task import SupervisedTask

SPELL = DatasetSpec(name="spell_backward", config={"min_word_len": 3, "max_word_len": 5})
MIX = [SPELL, DatasetSpec(name="chain_sum", weight=2.0), DatasetSpec(name="gcd", weight=0.5)]


def play(env: Any, replies: list[str]) -> list[dict[str, float]]:
    """Drive ``env`` as TokenEnv would; the reward parts of each reply."""
    async def go() -> list[dict[str, float]]:
        await env.init()
        parts = []
        for reply in replies:
            step = await env.step({"role": "assistant", "content": reply})
            parts.append(step.reward_parts)
            if step.done:
                break
        return parts
    return asyncio.run(go())


def test_episodes_are_fixed_by_seed_split_and_index_and_pickle() -> None:
    config = ReasoningGymTask.Config(datasets=MIX, turns=2, num_train_episodes=50,
                                     num_validation_episodes=20)
    a, b = config.build(), config.build()
    other = ReasoningGymTask.Config(datasets=MIX, turns=2, seed=1, num_train_episodes=50,
                                    num_validation_episodes=20).build()
    assert isinstance(a, SupervisedTask)
    assert len(a.dataset("train")) == 50 and len(a.dataset("validation")) == 20
    for split in ("train", "validation"):
        assert a.dataset(split)[:] == b.dataset(split)[:]
        assert a.dataset(split)[:] != other.dataset(split)[:]
    episode = a.dataset("train")[7]
    assert episode.episode_id == "train/7" and len(episode.entries) == 2
    assert pickle.loads(pickle.dumps(episode)) == episode
    sources = {e["metadata"]["source_dataset"] for ep in a.dataset("train") for e in ep.entries}
    assert sources == {"spell_backward", "chain_sum", "gcd"}
    with pytest.raises(IndexError, match=r"\[0, 50\)"):
        a.dataset("train")[50]


def test_validation_shares_no_question_with_training() -> None:
    task = ReasoningGymTask.Config(datasets=[SPELL], num_train_episodes=5000,
                                   num_validation_episodes=400).build()
    train = {e["question"] for ep in task.dataset("train") for e in ep.entries}
    validation = {e["question"] for ep in task.dataset("validation") for e in ep.entries}
    assert len(train) > 2000 and len(validation) > 300
    assert not train & validation
    # by construction: each split keeps only the questions that hash into it
    assert all(is_validation_question(q, 0.2) for q in validation)
    assert not any(is_validation_question(q, 0.2) for q in train)


def test_rewards_are_score_answer_unchanged_and_solutions_score_one() -> None:
    from reasoning_gym.composite import CompositeConfig, CompositeDataset
    from reasoning_gym.composite import DatasetSpec as GymSpec

    task = ReasoningGymTask.Config(datasets=MIX, turns=3, num_train_episodes=20,
                                   num_validation_episodes=10).build()
    reference = CompositeDataset(CompositeConfig(
        datasets=[GymSpec(name=s.name, weight=s.weight, config=dict(s.config)) for s in MIX],
        seed=0, size=10))
    for split in ("train", "validation"):
        for episode in task.dataset(split):
            solved = task.solved_conversation(episode)
            replies = [m["content"] for m in solved if m["role"] == "assistant"]
            assert [m["content"] for m in solved if m["role"] == "user"] == [
                e["question"] for e in episode.entries]
            env = task.make_env(episode)
            parts = play(env, replies)
            assert [p["score"] for p in parts] == [1.0, 1.0, 1.0]
            assert env.score(replies, parts) == 1.0
            wrong = ["x" + r[1:] if r else "x" for r in replies]
            parts = play(task.make_env(episode), wrong)
            expected = [reference.score_answer(w, e) for w, e in zip(wrong, episode.entries)]
            assert [p["score"] for p in parts] == expected
            assert task.make_env(episode).turn_rewards(wrong, parts) == expected
    # a turn never reached scores 0
    episode = task.dataset("train")[0]
    env = task.make_env(episode)
    parts = play(env, [task.solved_conversation(episode)[1]["content"]])
    assert env.score(["?"], parts) == pytest.approx(1 / 3)


def test_answer_tag_takes_the_last_tagged_answer() -> None:
    task = ReasoningGymTask.Config(datasets=[SPELL], answer_tag="answer", system_prompt="Be brief.",
                                   num_train_episodes=4, num_validation_episodes=4).build()
    episode = task.dataset("train")[0]
    answer = episode.entries[0]["answer"]
    solved = task.solved_conversation(episode)
    assert solved[0] == {"role": "system", "content": "Be brief."}
    assert solved[-1]["content"] == f"<answer>{answer}</answer>"
    assert play(task.make_env(episode), [f"<answer>no</answer> then <answer>{answer}</answer>"]) \
        == [{"score": 1.0}]
    assert play(task.make_env(episode), [answer]) == [{"score": 0.0}]  # untagged: no answer


@pytest.mark.parametrize(("change", "message"), [
    ({"datasets": [DatasetSpec(name="spell_backwards")]},
     r"datasets\[0\].name: no reasoning-gym dataset 'spell_backwards'; did you mean "
     r"'spell_backward'\?"),
    ({"datasets": [DatasetSpec(name="gcd", weight=0.0)]}, r"datasets\[0\].weight must be > 0"),
    ({"datasets": [DatasetSpec(name="gcd", config={"seed": 3})]},
     r"datasets\[0\].config: \['seed'\] are the task's"),
    ({"datasets": []}, "name at least one reasoning-gym dataset"),
    ({"turns": 0}, "turns must be >= 1"),
    ({"validation_fraction": 1.0}, r"validation_fraction must be in \(0, 1\)"),
])
def test_config_errors_name_the_key(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReasoningGymTask.Config(**change)


@pytest.mark.parametrize(("config", "message"), [
    ({"min_word": 3}, "datasets[0].config: word_sequence_reversal has no config field 'min_word'; "
                      "did you mean 'min_words'? its fields: min_words, max_words (python -m "
                      "torchtitan_rl.envs.reasoning_gym --fields word_sequence_reversal)"),
    ({"min_words": "3"}, "datasets[0].config.min_words: expected int, got '3' (str)"),
    ({"min_words": 0}, "datasets[0].config: reasoning-gym's word_sequence_reversal refused it: "
                       "min_words must be positive"),
])
def test_a_dataset_config_reasoning_gym_would_refuse_is_caught_by_the_config(
        config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as e:
        ReasoningGymTask.Config(datasets=[DatasetSpec(name="word_sequence_reversal",
                                                      config=config)])
    assert str(e.value) == message


def test_every_datasets_own_defaults_pass_the_check() -> None:
    """No false refusals: each field of each dataset set to its own default, as a TOML table
    would write it (tuples as lists), passes (rearc's diff_ub is annotated int, defaults 0.2)."""
    import dataclasses

    for name in rg_task.import_reasoning_gym().factory.DATASETS:
        if name == "composite":  # a mix of datasets, not one: the task's datasets list is that
            continue
        for field, (_, default) in rg_task.dataset_fields(name).items():
            if default is dataclasses.MISSING or default is None:
                continue  # TOML has no None
            value = list(default) if isinstance(default, tuple) else default
            rg_task.check_dataset_config(name, {field: value}, "config")
    with pytest.raises(ValueError, match=r"config.min_words: expected int, got 2.5 \(float\)"):
        rg_task.check_dataset_config("word_sequence_reversal", {"min_words": 2.5}, "config")


def test_a_misspelt_dataset_field_stops_the_command_in_one_line_before_a_run_folder(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from torchtitan_rl.train import cli

    toml = tmp_path / "job.toml"
    toml.write_text('[task]\ntype = "reasoning_gym"\n[[task.datasets]]\n'
                    'name = "word_sequence_reversal"\nconfig = { min_word = 3 }\n')
    with pytest.raises(SystemExit) as e:
        cli(["--config", str(toml), "--output_dir", str(tmp_path / "runs")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: task: datasets[0].config: word_sequence_reversal has no config field "
                   "'min_word'; did you mean 'min_words'? its fields: min_words, max_words "
                   "(python -m torchtitan_rl.envs.reasoning_gym --fields word_sequence_reversal)"]
    assert not (tmp_path / "runs").exists()


def test_the_module_lists_datasets_and_one_datasets_fields(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert rg_task.main(["--list"]) == 0
    names = capsys.readouterr().out.split()
    assert "word_sequence_reversal" in names and names == sorted(names) and len(names) > 100
    assert rg_task.main(["--fields", "letter_counting"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["  min_words = 5  (int)",
                                                        "  max_words = 15  (int)"]
    with pytest.raises(SystemExit) as e:
        rg_task.main(["--fields", "leter_counting"])
    assert e.value.code == 2
    assert "did you mean 'letter_counting'?" in capsys.readouterr().err


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = rg_task.importlib.util.find_spec
    monkeypatch.setattr(rg_task.importlib.util, "find_spec",
                        lambda name, *a: None if name == "reasoning_gym" else real(name, *a))
    with pytest.raises(ValueError, match=r"reasoning-gym is not installed: pip install -e "
                                         r"'\.\[envs\]'"):
        ReasoningGymTask.Config()


def test_short_type_name_and_toml_tables(tmp_path) -> None:
    toml = tmp_path / "job.toml"
    toml.write_text('[task]\ntype = "reasoning_gym"\nturns = 2\n'
                    '[[task.datasets]]\nname = "gcd"\nweight = 2.0\n'
                    '[[task.datasets]]\nname = "spell_backward"\n'
                    'config = { min_word_len = 3, max_word_len = 4 }\n')
    job = parse_args(RLJob.Config, ["--config", str(toml), "--task.seed", "5"]).config
    assert job.task == ReasoningGymTask.Config(
        turns=2, seed=5, datasets=[DatasetSpec(name="gcd", weight=2.0),
                                   DatasetSpec(name="spell_backward",
                                               config={"min_word_len": 3, "max_word_len": 4})])
    cli = parse_args(RLJob.Config, ["--task.type", "reasoning_gym"]).config
    assert type(cli.task) is ReasoningGymTask.Config


def test_task_tokenizer_fits_the_task_text(tmp_path) -> None:
    task_config = ReasoningGymTask.Config(datasets=[SPELL], num_train_episodes=500)
    default = ModelSource.Config(size="tiny", assets_dir=str(tmp_path)).build().resolve(task_config)
    own = ModelSource.Config(size="tiny", assets_dir=str(tmp_path), tokenizer_corpus="task"
                             ).build().resolve(task_config)
    assert own != default and own.name.startswith("tiny-corpus")
    # cached: the same corpus resolves to the same directory without remaking it
    mtime = (own / "model.safetensors").stat().st_mtime_ns
    assert ModelSource.Config(size="tiny", assets_dir=str(tmp_path), tokenizer_corpus="task"
                              ).build().resolve(task_config) == own
    assert (own / "model.safetensors").stat().st_mtime_ns == mtime
    task = task_config.build()
    questions = [ep.entries[0]["question"] for ep in task.dataset("validation")[:50]]
    lengths = {d.name: sum(len(load_tokenizer(d)(q)["input_ids"]) for q in questions)
               for d in (default, own)}
    assert lengths[own.name] < 0.8 * lengths[default.name], lengths


def test_task_tokenizer_needs_solved_conversations(tmp_path) -> None:
    with pytest.raises(ConfigError, match="tokenizer_corpus = 'task' needs a task with solved"):
        ModelSource.Config(size="tiny", assets_dir=str(tmp_path), tokenizer_corpus="task"
                           ).build().resolve(None)


def test_importing_reasoning_gym_prints_nothing() -> None:
    """Some of reasoning-gym's dependencies raise SyntaxWarnings when Python compiles them: the
    console stays clean (a fresh interpreter that writes no bytecode compiles them every time)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, "-c", "from torchtitan_rl.envs.reasoning_gym import ReasoningGymTask; "
                               "ReasoningGymTask.Config().build()"],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == proc.stderr == ""
