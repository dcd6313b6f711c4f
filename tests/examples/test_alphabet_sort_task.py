"""AlphabetSort episodes and env: deterministic by seed, disjoint name pools, scripted user side."""

from __future__ import annotations

import pickle

import pytest

from examples.alphabet_sort import AlphabetSortTask
from examples.alphabet_sort.episode import sort_key
from examples.alphabet_sort.reward import NEW_NAME_MARK
from tests.rollout.rollout_testlib import run
from torchtitan_rl.assets.names import NameBank


def test_alphabet_episodes_are_deterministic_by_seed_and_index() -> None:
    a = AlphabetSortTask.Config(seed=5).build()
    b = AlphabetSortTask.Config(seed=5).build()
    c = AlphabetSortTask.Config(seed=6).build()
    # index 40 built directly equals index 40 built after others (resume by position)
    late = b.dataset("train")[40]
    assert [a.dataset("train")[i] for i in range(50)] == b.dataset("train")[0:50]
    assert late == a.dataset("train")[40]
    assert a.dataset("train")[0:20] != c.dataset("train")[0:20]
    assert a.dataset("validation")[3] == b.dataset("validation")[3]
    episode = a.dataset("train")[7]
    assert pickle.loads(pickle.dumps(episode)) == episode
    assert episode.episode_id == "train/7"


def test_alphabet_train_and_validation_use_disjoint_names() -> None:
    task = AlphabetSortTask.Config(num_validation_episodes=200).build()
    def names(split: str, n: int) -> set[str]:
        return {name for i in range(n) for turn in task.dataset(split)[i].turn_names
                for name in turn}
    train, validation = names("train", 400), names("validation", 200)
    assert train and validation and not (train & validation)


def test_alphabet_shared_validation_names_come_from_the_train_pool_in_new_episodes() -> None:
    disjoint = AlphabetSortTask.Config(num_validation_episodes=200, min_names_per_turn=2).build()
    shared = AlphabetSortTask.Config(num_validation_episodes=200, min_names_per_turn=2,
                                     validation_names="shared").build()
    def names(task: AlphabetSortTask, split: str, n: int) -> set[str]:
        return {name for i in range(n) for turn in task.dataset(split)[i].turn_names
                for name in turn}
    train_pool, _ = NameBank(seed=0, num_names=2000).split(0.2)
    assert names(shared, "validation", 200) <= set(train_pool)  # seen names ...
    assert names(shared, "train", 400) == names(disjoint, "train", 400)  # training unchanged
    train_episodes = {shared.dataset("train")[i].turn_names for i in range(2000)}
    held_out = [shared.dataset("validation")[i].turn_names for i in range(200)]
    assert sum(e in train_episodes for e in held_out) == 0  # ... in episodes never trained on


def test_alphabet_episode_shape_and_ground_truth() -> None:
    cfg = AlphabetSortTask.Config(seed=1, max_turns=3, min_names_per_turn=2,
                                  max_names_per_turn=4)
    task = cfg.build()
    turn_counts = set()
    for i in range(100):
        ep = task.dataset("train")[i]
        turn_counts.add(ep.num_turns)
        assert 1 <= ep.num_turns <= 3 and ep.sort_by in ("FIRST", "LAST")
        seen: list[str] = []
        for t, (new, truth) in enumerate(zip(ep.turn_names, ep.ground_truths)):
            assert 2 <= len(new) <= 4
            assert not set(new) & set(seen)  # drawn without replacement
            seen += new
            plain = [line.removesuffix(NEW_NAME_MARK) for line in truth]
            assert plain == sorted(seen, key=lambda n: sort_key(n, ep.sort_by))
            marked = {line.removesuffix(NEW_NAME_MARK) for line in truth
                      if line.endswith(NEW_NAME_MARK)}
            assert marked == (set(new) if t > 0 else set())
            for name in new:
                assert name in ep.prompts[t]
            assert f"by {ep.sort_by} name" in ep.prompts[t]
        assert "<alphabetical_sorted>" in ep.prompts[0]
        if ep.num_turns > 1:
            assert "<combined_alphabetical_sorted>" in ep.prompts[1]
            assert "// new name!" in ep.prompts[1]
        if ep.num_turns > 2:
            assert ep.prompts[2].endswith("Follow the same format as before.")
    assert turn_counts == {1, 2, 3}


def test_alphabet_env_scripts_the_user_and_scores_turns() -> None:
    task = AlphabetSortTask.Config(seed=2, min_turns=3, max_turns=3,
                                   system_prompt="You sort names.").build()
    ep = task.dataset("train")[0]
    env = task.make_env(ep)

    async def play() -> tuple[list, list]:
        opening = await env.init()
        steps = []
        for t in range(3):
            tag = "alphabetical_sorted" if t == 0 else "combined_alphabetical_sorted"
            reply = f"<{tag}>\n" + "\n".join(ep.ground_truths[t]) + f"\n</{tag}>"
            if t == 1:
                reply = "no idea"
            steps.append(await env.step({"role": "assistant", "content": reply}))
        return opening, steps

    opening, steps = run(play())
    assert opening == [{"role": "system", "content": "You sort names."},
                       {"role": "user", "content": ep.prompts[0]}]
    assert [s.done for s in steps] == [False, False, True]
    assert steps[0].messages == [{"role": "user", "content": ep.prompts[1]}]
    assert [s.reward_parts["turn_score"] for s in steps] == [1.0, 0.0, 1.0]
    replies = ["<alphabetical_sorted>\n" + "\n".join(ep.ground_truths[0]) +
               "\n</alphabetical_sorted>"]
    # a rollout cut after turn 0: the two turns never reached score 0
    assert env.score(replies, [{}]) == pytest.approx(1 / 3)


def test_alphabet_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_turns must be >= min_turns \\(2\\), got 1"):
        AlphabetSortTask.Config(min_turns=2, max_turns=1)
    with pytest.raises(ValueError, match="validation_name_fraction must be in \\(0, 1\\)"):
        AlphabetSortTask.Config(validation_name_fraction=1.0)
    with pytest.raises(ValueError, match="num_names"):
        AlphabetSortTask.Config(num_names=20)
    task = AlphabetSortTask.Config(num_validation_episodes=4).build()
    with pytest.raises(IndexError, match="validation episode index must be in \\[0, 4\\), got 4"):
        task.dataset("validation")[4]
    with pytest.raises(ValueError, match="split must be one of"):
        task.dataset("test")  # type: ignore[arg-type]
