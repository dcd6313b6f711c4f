"""Rollouter + TokenEnv with scripted generate functions and the tiny model's real tokenizer."""

from __future__ import annotations

import json

import pytest

from examples.alphabet_sort import AlphabetSortTask
from tests.rollout.rollout_testlib import CountingEnv, ScriptedGenerate, run, tiny_tokenizer
from torchtitan_rl.rollout import (
    Rollouter,
    RolloutRecorder,
    RolloutStatus,
    request_seed,
    rollout_group_to_training_samples,
    rollout_metrics,
)
from torchtitan_rl.types import Completion, GenerateRequest, Sampling


def _rollouter(make_env, **overrides) -> Rollouter:  # type: ignore[no-untyped-def]
    cfg = Rollouter.Config(**{"group_size": 4, "step_timeout_s": 5.0, **overrides})
    return cfg.build(tokenizer=tiny_tokenizer(), make_env=make_env)


def _rollout_index(request_id: str) -> int:
    return int(request_id.split("/")[1].split("=")[1])


def test_rollouter_group_ids_seeds_rewards_and_advantages() -> None:
    # rollouts 0 and 1 say "yes" every turn, 2 and 3 never do
    gen = ScriptedGenerate(lambda rid, _: "yes" if _rollout_index(rid) < 2 else "no")
    rollouter = _rollouter(lambda episode: CountingEnv(episode["turns"]))
    group = run(rollouter.run_group_rollouts(gen, {"episode_id": "e1", "turns": 3}, 11,
                                             sampling=Sampling(max_tokens=8, seed=100)))
    assert group.group_id == 11 and group.episode["episode_id"] == "e1"
    assert [r.status for r in group.rollouts] == [RolloutStatus.COMPLETED] * 4
    assert group.rewards == [3.0, 3.0, 0.0, 0.0]  # default score: sum of the reward parts
    # default advantage_std "sample": mean 1.5, stdev([3, 3, 0, 0]) = sqrt(9 / 3) = sqrt(3)
    a = 1.5 / (3 ** 0.5 + 1e-6)
    assert group.advantages == pytest.approx([a, a, -a, -a], rel=1e-12)
    assert not group.dropped
    assert sorted(c.request_id for c in gen.calls) == sorted(
        f"group=11/rollout={r}/turn={t}" for r in range(4) for t in range(3))
    for c in gen.calls:
        assert c.session_id == c.request_id.rsplit("/", 1)[0]
        r, t = _rollout_index(c.request_id), int(c.request_id.rsplit("=", 1)[1])
        assert c.sampling.seed == request_seed(100, 11, r, t)
    assert len({c.sampling.seed for c in gen.calls}) == 12

    # token-in/token-out: each prompt extends the previous prompt + completion exactly
    for rollout in group.rollouts:
        for prev, turn in zip(rollout.turns, rollout.turns[1:]):
            head = prev.prompt_token_ids + prev.completion_token_ids
            assert turn.prompt_token_ids[: len(head)] == head
        assert rollout.num_drift_events == 0
    samples = rollout_group_to_training_samples(group)
    assert [s.sample_id for s in samples] == [f"group=11/rollout={r}/branch=0" for r in range(4)]
    for s, rollout in zip(samples, group.rollouts):
        last = rollout.turns[-1]
        assert s.token_ids == last.prompt_token_ids + last.completion_token_ids
        trained = [tok for tok, m in zip(s.token_ids, s.loss_mask) if m]
        assert trained == [tok for t in rollout.turns for tok in t.completion_token_ids]
        assert set(s.policy_versions) == {-1, 7}

    metrics = rollout_metrics([group])
    assert metrics["rollout/num_turns"] == 3.0
    assert metrics["rollout/branches_per_rollout"] == 1.0
    assert metrics["rollout_reward/mean"] == 1.5
    assert metrics["rollout_reward/std"] == 1.5
    assert metrics["rollout_reward/max"] == 3.0
    assert metrics["rollout/status/completed"] == 1.0
    yes_tokens = len(tiny_tokenizer().encode("yes", add_special_tokens=False)) + 1  # + end token
    assert metrics["rollout/output_tokens_max"] == 3 * yes_tokens


def test_rollouter_is_reproducible_and_seeds_differ_by_group() -> None:
    def seeds(group_id: int) -> list[tuple[str, int | None]]:
        gen = ScriptedGenerate(lambda rid, _: "yes")
        rollouter = _rollouter(lambda s: CountingEnv(2), seed=3)
        run(rollouter.run_group_rollouts(gen, {}, group_id, sampling=Sampling(max_tokens=4)))
        return sorted((c.request_id, c.sampling.seed) for c in gen.calls)

    assert seeds(0) == seeds(0)
    assert {s for _, s in seeds(0)}.isdisjoint({s for _, s in seeds(1)})


def test_rollouter_env_errors_and_timeouts_end_only_their_rollout() -> None:
    envs = iter([CountingEnv(3, fail_on_turn=1), CountingEnv(3, hang_on_turn=0),
                 CountingEnv(3, fail_init=True), CountingEnv(3), CountingEnv(3)])
    gen = ScriptedGenerate(lambda rid, _: "yes" if _rollout_index(rid) == 3 else "no")
    rollouter = _rollouter(lambda s: next(envs), group_size=5, step_timeout_s=0.5)
    group = run(rollouter.run_group_rollouts(gen, {}, 0, sampling=Sampling(max_tokens=4)))
    assert [r.status for r in group.rollouts] == [
        RolloutStatus.ERROR_ENV, RolloutStatus.ERROR_TIMEOUT, RolloutStatus.ERROR_ENV,
        RolloutStatus.COMPLETED, RolloutStatus.COMPLETED]
    assert "env broke on turn 1" in group.rollouts[0].error
    assert len(group.rollouts[0].turns) == 2 and len(group.rollouts[2].turns) == 0
    # errored rollouts are out of the baseline and of training; the rest carry on
    # counted rewards [3, 0]: mean 1.5, stdev = sqrt(2 * 1.5**2 / 1) = 1.5 * sqrt(2)
    a = 1.5 / (1.5 * 2 ** 0.5 + 1e-6)
    assert group.advantages[:3] == [None, None, None]
    assert group.advantages[3:] == pytest.approx([a, -a], rel=1e-12)
    assert not group.dropped
    samples = rollout_group_to_training_samples(group)
    assert [s.sample_id for s in samples] == ["group=0/rollout=3/branch=0",
                                              "group=0/rollout=4/branch=0"]
    metrics = rollout_metrics([group])
    assert metrics["rollout/status/error_env"] == pytest.approx(2 / 5)
    assert metrics["rollout/status/error_timeout"] == pytest.approx(1 / 5)


def test_rollouter_error_reward_keeps_errored_rollouts_in_the_baseline() -> None:
    envs = iter([CountingEnv(1, fail_on_turn=0), CountingEnv(1)])
    gen = ScriptedGenerate(lambda rid, _: "yes")
    rollouter = _rollouter(lambda s: next(envs), group_size=2, error_reward=-1.0)
    group = run(rollouter.run_group_rollouts(gen, {}, 0))
    # rewards [-1, 1]: mean 0, stdev sqrt(2)
    a = 1.0 / (2 ** 0.5 + 1e-6)
    assert group.rewards == [-1.0, 1.0] and group.advantages == pytest.approx([-a, a], rel=1e-12)
    assert len(rollout_group_to_training_samples(group)) == 2


def test_rollouter_dropped_request_is_error_abort() -> None:
    gen = ScriptedGenerate(lambda rid, _: None if rid.endswith("turn=1") else "yes")
    rollouter = _rollouter(lambda s: CountingEnv(3), group_size=2)
    group = run(rollouter.run_group_rollouts(gen, {}, 0))
    assert [r.status for r in group.rollouts] == [RolloutStatus.ERROR_ABORT] * 2
    assert [len(r.turns) for r in group.rollouts] == [1, 1]
    assert group.dropped and group.drop_reason == "all_errored"
    assert rollout_metrics([group])["rollout/num_groups_dropped_all_errored"] == 1.0


def test_rollouter_token_budget_clips_max_tokens_and_truncates() -> None:
    tok = tiny_tokenizer()
    first = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "turn 0: say yes"}], tokenize=False,
        add_generation_prompt=True), add_special_tokens=False)
    budget = len(first) + 3
    gen = ScriptedGenerate(lambda rid, _: ("yes yes yes yes", "length"))
    rollouter = _rollouter(lambda s: CountingEnv(3), group_size=2, max_rollout_tokens=budget)
    group = run(rollouter.run_group_rollouts(gen, {}, 0, sampling=Sampling(max_tokens=50)))
    assert {c.sampling.max_tokens for c in gen.calls} == {3}
    assert [r.status for r in group.rollouts] == [RolloutStatus.TRUNCATED_LENGTH] * 2
    assert all(len(r.turns[0].completion_token_ids) == 3 for r in group.rollouts)

    # a first prompt already over budget: no generate call at all
    gen2 = ScriptedGenerate(lambda rid, _: "yes")
    small = _rollouter(lambda s: CountingEnv(3), group_size=2, max_rollout_tokens=len(first))
    group2 = run(small.run_group_rollouts(gen2, {}, 0))
    assert gen2.calls == []
    assert [r.status for r in group2.rollouts] == [RolloutStatus.TRUNCATED_LENGTH] * 2
    assert rollout_group_to_training_samples(group2) == []


def test_rollouter_turn_cap_and_zero_std_drop() -> None:
    gen = ScriptedGenerate(lambda rid, _: "yes")
    rollouter = _rollouter(lambda s: CountingEnv(5), group_size=3, max_turns=2)
    group = run(rollouter.run_group_rollouts(gen, {}, 4))
    assert [r.status for r in group.rollouts] == [RolloutStatus.TRUNCATED_MAX_TURNS] * 3
    assert [len(r.turns) for r in group.rollouts] == [2, 2, 2]
    assert group.dropped and group.drop_reason == "zero_std"
    assert rollout_group_to_training_samples(group) == []
    assert rollout_metrics([group])["rollout/num_groups_dropped_zero_std"] == 1.0

    keep = _rollouter(lambda s: CountingEnv(5), group_size=3, max_turns=2,
                      drop_zero_std_groups=False)
    kept = run(keep.run_group_rollouts(gen, {}, 4))
    assert not kept.dropped and kept.advantages == [0.0, 0.0, 0.0]
    assert len(rollout_group_to_training_samples(kept)) == 3


def test_rollouter_std_normalisation() -> None:
    gen = ScriptedGenerate(lambda rid, _: "yes" if _rollout_index(rid) == 0 else "no")
    rollouter = _rollouter(lambda s: CountingEnv(1), advantage_std="population")
    group = run(rollouter.run_group_rollouts(gen, {}, 0))
    # rewards [1, 0, 0, 0]: mean 0.25, population std sqrt(3)/4
    std = 3 ** 0.5 / 4
    assert group.advantages == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std],
                                             rel=1e-5)
    # by hand, sample std: squared deviations 0.5625 + 3 x 0.0625 = 0.75, / (4 - 1) = 0.25 -> 0.5
    sample = run(_rollouter(lambda s: CountingEnv(1)).run_group_rollouts(gen, {}, 0))
    assert sample.advantages == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
    mean_only = run(_rollouter(lambda s: CountingEnv(1), advantage_std="none")
                    .run_group_rollouts(gen, {}, 0))
    assert mean_only.advantages == [0.75, -0.25, -0.25, -0.25]


def test_rollouter_counts_drift_but_keeps_the_generated_tokens() -> None:
    tok = tiny_tokenizer()
    # "yes" spelled one byte-token at a time: a valid but non-canonical tokenisation
    byte_ids = [tok.convert_tokens_to_ids(ch) for ch in "yes"]
    assert tok.encode("yes", add_special_tokens=False) != byte_ids

    class ByteGenerate(ScriptedGenerate):
        async def __call__(self, request):  # type: ignore[no-untyped-def, override]
            c = await super().__call__(request)
            c.token_ids = byte_ids + [tok.eos_token_id]
            c.token_logprobs = [-0.1] * len(c.token_ids)
            c.token_policy_versions = [1] * len(c.token_ids)
            return c

    rollouter = _rollouter(lambda s: CountingEnv(3), group_size=2)
    group = run(rollouter.run_group_rollouts(ByteGenerate(lambda rid, _: "x"), {}, 0))
    for rollout in group.rollouts:
        assert rollout.replies == ["yes", "yes", "yes"]
        assert rollout.num_drift_events == 2  # after turns 0 and 1 (turn 2 ends the rollout)
        assert rollout.reward == 3.0
    group.rollouts[0].advantage = 0.0  # zero spread: force samples to inspect packing
    group.dropped = False
    [s0, _] = rollout_group_to_training_samples(group)
    assert [t for t, m in zip(s0.token_ids, s0.loss_mask) if m] == (
        byte_ids + [tok.eos_token_id]) * 3
    assert rollout_metrics([group])["rollout/num_drift_events"] == 4.0


def test_rollouter_runs_alphabet_sort_with_an_oracle(tmp_path) -> None:  # type: ignore[no-untyped-def]
    task = AlphabetSortTask.Config(seed=3, min_turns=3, max_turns=3).build()
    episode = task.dataset("train")[0]

    def oracle(rid: str, _: list[int]) -> str:
        r, t = _rollout_index(rid), int(rid.rsplit("=", 1)[1])
        tag = "alphabetical_sorted" if t == 0 else "combined_alphabetical_sorted"
        lines = list(episode.ground_truths[t]) if r % 2 == 0 else ["Nobody"]
        return f"<{tag}>\n" + "\n".join(lines) + f"\n</{tag}>"

    rollouter = _rollouter(task.make_env, max_rollout_tokens=512)
    group = run(rollouter.run_group_rollouts(ScriptedGenerate(oracle), episode, 2,
                                             sampling=Sampling(max_tokens=200)))
    assert [r.status for r in group.rollouts] == [RolloutStatus.COMPLETED] * 4
    assert group.rewards[0] == group.rewards[2] == 1.0
    assert group.rewards[1] < 0.2
    assert [t.reward_parts["turn_score"] for t in group.rollouts[0].turns] == [1.0, 1.0, 1.0]

    recorder = RolloutRecorder.Config(every_k_steps=2, path="rec/r.jsonl").build(run_dir=tmp_path)
    assert not recorder.maybe_record(1, [group], tiny_tokenizer())
    assert recorder.maybe_record(2, [group], tiny_tokenizer())
    lines = [json.loads(x) for x in (tmp_path / "rec" / "r.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    assert lines[0]["episode_id"] == "train/0" and lines[0]["reward"] == 1.0
    assert lines[0]["status"] == "completed" and lines[0]["num_turns"] == 3
    assert episode.prompts[0] in lines[0]["prompt_text"]
    assert "</combined_alphabetical_sorted>" in lines[0]["completion_text"]
    assert episode.prompts[1] in lines[0]["turns"][1]["prompt_added_text"]


def test_rollouter_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_rollout_tokens must be >= 2, got 1"):
        Rollouter.Config(max_rollout_tokens=1)
    for group_size in (0, 1):
        with pytest.raises(ValueError, match=rf"^group_size must be >= 2 \(GRPO compares "
                                             rf"siblings\), got {group_size}$"):
            Rollouter.Config(group_size=group_size)
    with pytest.raises(ValueError, match="every_k_steps must be >= 0, got -1"):
        RolloutRecorder.Config(every_k_steps=-1)


def test_rollouter_generate_failure_fails_the_group_and_closes_every_env() -> None:
    envs: list[CountingEnv] = []

    def make_env(episode: object) -> CountingEnv:
        envs.append(CountingEnv(3))
        return envs[-1]

    def reply(rid: str, _: list[int]) -> str:
        if rid == "group=0/rollout=2/turn=1":
            raise ConnectionError("generator actor died")
        return "yes"

    rollouter = _rollouter(make_env, group_size=4)
    with pytest.raises(ConnectionError, match="generator actor died"):
        run(rollouter.run_group_rollouts(ScriptedGenerate(reply), {}, 0))
    assert len(envs) == 4 and all(env.closed == 1 for env in envs)


def test_rollouter_keeps_each_turns_prefix_cache_hits_and_metrics_give_their_share() -> None:
    scripted = ScriptedGenerate(lambda rid, _: "yes")

    async def generate(request: GenerateRequest) -> Completion | None:
        completion = await scripted(request)
        assert completion is not None
        # As if the engine had cached every prompt token but the last 4 of the later turns.
        turn = int(request.request_id.rsplit("=", 1)[1])
        completion.metrics.num_cached_prompt_tokens = (
            len(request.prompt_token_ids) - 4 if turn else 0)
        return completion

    rollouter = _rollouter(lambda episode: CountingEnv(episode["turns"]))
    group = run(rollouter.run_group_rollouts(generate, {"episode_id": "e1", "turns": 3}, 0,
                                             sampling=Sampling(max_tokens=8, seed=1)))
    turns = [t for r in group.rollouts for t in r.turns]
    assert [t.num_cached_prompt_tokens for t in turns[:3]] == [
        0, len(turns[1].prompt_token_ids) - 4, len(turns[2].prompt_token_ids) - 4]
    cached = sum(t.num_cached_prompt_tokens for t in turns)
    assert cached > 0
    assert rollout_metrics([group])["rollout/prefix_cache_hit_ratio"] == pytest.approx(
        cached / sum(len(t.prompt_token_ids) for t in turns))


class _BrokenEnv(CountingEnv):
    """CountingEnv with one of a task author's mistakes (``mistake``)."""

    def __init__(self, turns: int, mistake: str) -> None:
        super().__init__(turns)
        self.mistake = mistake

    async def init(self):  # type: ignore[no-untyped-def]
        if self.mistake == "init returns a string":
            return "turn 0: say yes"
        if self.mistake == "init returns a message without content":
            return [{"role": "user"}]
        return await super().init()

    async def step(self, assistant_message):  # type: ignore[no-untyped-def]
        if self.mistake == "step raises in turn 2" and self.turn == 1:
            raise KeyError("turn two")
        result = await super().step(assistant_message)
        if self.mistake == "reward part is a string":
            result.reward_parts["yes"] = "1"
        if self.mistake == "reward part is NaN":
            result.reward_parts["yes"] = float("nan")
        if self.mistake == "step returns a gym tuple":
            return [], 1.0, True
        if self.mistake == "step returns a dict":
            return {"messages": [], "done": True}
        if self.mistake == "EnvStep.messages a dict":
            result.messages = {"role": "user", "content": "x"}
        if self.mistake == "EnvStep.reward_parts a list":
            result.reward_parts = [1.0]
        return result

    def score(self, replies, reward_parts):  # type: ignore[no-untyped-def]
        if self.mistake == "score returns None":
            return None
        if self.mistake == "score returns '0.5'":
            return "0.5"
        if self.mistake == "score raises":
            raise ZeroDivisionError("division by zero")
        if self.mistake == "score returns NaN":
            return float("nan")
        return super().score(replies, reward_parts)


@pytest.mark.parametrize(("mistake", "credit", "error"), [
    ("score returns None", "rollout",
     "score() returned None (NoneType); a finite int or float is required at "
     "tests/rollout/test_rollout_rollouter.py:"),
    ("score returns '0.5'", "rollout",
     "score() returned '0.5' (str); a finite int or float is required at "
     "tests/rollout/test_rollout_rollouter.py:"),
    ("score raises", "turn",  # per-turn credit still calls score(): its failure is not swallowed
     "score() raised ZeroDivisionError('division by zero') at "
     "tests/rollout/test_rollout_rollouter.py:"),
    ("step raises in turn 2", "rollout",
     "step() raised KeyError('turn two') at tests/rollout/test_rollout_rollouter.py:"),
    ("reward part is a string", "rollout",
     "step() reward part 'yes' returned '1' (str); a finite int or float is required at "
     "tests/rollout/test_rollout_rollouter.py:"),
    ("reward part is NaN", "rollout",
     "step() reward part 'yes' returned nan (float); a finite int or float is required at "
     "tests/rollout/test_rollout_rollouter.py:"),
    ("score returns NaN", "rollout",
     "score() returned nan (float); a finite int or float is required at "
     "tests/rollout/test_rollout_rollouter.py:"),
    ("init returns a string", "rollout",
     "init() returned 'turn 0: say yes' (str); a list of messages ({'role': str, 'content': "
     "str}) is required at tests/rollout/test_rollout_rollouter.py:"),
    ("init returns a message without content", "rollout",
     "init()[0]['content'] returned None (NoneType); a string is required at "
     "tests/rollout/test_rollout_rollouter.py:"),
    ("step returns a gym tuple", "rollout",
     "step() returned ([], 1.0, True) (tuple); an EnvStep(messages=..., done=..., "
     "reward_parts=...) is required at tests/rollout/test_rollout_rollouter.py:"),
    ("step returns a dict", "rollout",
     "step() returned {'messages': [], 'done': True} (dict); an EnvStep("),
    ("EnvStep.messages a dict", "rollout",
     "step() EnvStep.messages returned {'role': 'user', 'content': 'x'} (dict); a list of "
     "messages ({'role': str, 'content': str}) is required at "
     "tests/rollout/test_rollout_rollouter.py:"),
    ("EnvStep.reward_parts a list", "rollout",
     "step() EnvStep.reward_parts returned [1.0] (list); a dict of part name -> number is "
     "required at tests/rollout/test_rollout_rollouter.py:"),
])
def test_a_task_authors_mistake_fails_the_rollout_naming_the_call_and_its_line(
        mistake: str, credit: str, error: str) -> None:
    gen = ScriptedGenerate(lambda rid, _: "yes")
    rollouter = _rollouter(lambda episode: _BrokenEnv(3, mistake), credit=credit)
    group = run(rollouter.run_group_rollouts(gen, {"episode_id": "e"}, 0,
                                             sampling=Sampling(max_tokens=8)))
    assert [r.status for r in group.rollouts] == [RolloutStatus.ERROR_ENV] * 4
    assert all(r.error is not None and r.error.startswith(error) for r in group.rollouts), (
        group.rollouts[0].error)
    assert group.dropped and group.drop_reason == "all_errored"
