"""TextArenaTask (torchtitan_rl/envs/textarena.py): a textarena game's turns as chat messages, the
game's own validity check and reward as the reward parts and score, disjoint game seeds per split,
a solver's games as solved conversations, and one-line config errors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from examples.guess_the_number import binary_search
from torchtitan_rl.envs.textarena import TextArenaTask
from torchtitan_rl.task import SupervisedTask

SOLVER = "examples.guess_the_number:binary_search"


def play(env: Any, replies: list[str]) -> tuple[list[dict[str, str]], list[dict[str, float]]]:
    async def go() -> tuple[list[dict[str, str]], list[dict[str, float]]]:
        messages = list(await env.init())
        parts = []
        for reply in replies:
            step = await env.step({"role": "assistant", "content": reply})
            messages += [{"role": "assistant", "content": reply}, *step.messages]
            parts.append(step.reward_parts)
            if step.done:
                break
        return messages, parts
    return asyncio.run(go())


def test_a_game_is_a_chat_with_the_games_own_check_and_reward() -> None:
    task = TextArenaTask.Config(env_kwargs={"max_turns": 3}).build()
    episode = task.dataset("validation")[0]
    env = task.make_env(episode)
    messages, parts = play(env, ["[1]", "hello", "[1]", "[2]", "[3]", "[4]"])
    assert "Guess The Number" in messages[0]["content"] and messages[0]["role"] == "user"
    assert "between 1 and 20" in messages[0]["content"]
    # the game's own check: "hello" has no [number], a repeated guess is refused too
    assert [p["valid_move"] for p in parts][:3] == [1.0, 0.0, 0.0]
    assert "invalid move" in messages[4]["content"].lower()
    assert "[Player]" not in "".join(m["content"] for m in messages if m["role"] == "user")
    assert "game_reward" in parts[-1] and all("game_reward" not in p for p in parts[:-1])
    assert env.score([], parts) == parts[-1]["game_reward"]
    assert env.score([], parts[:-1]) == 0.0  # cut off before the game ended
    with pytest.raises(ValueError, match="credit = 'rollout'"):
        env.turn_rewards([], parts)


def test_splits_use_disjoint_seeds_and_solver_games_win() -> None:
    task = TextArenaTask.Config(solver=SOLVER, num_train_episodes=300,
                                num_validation_episodes=100).build()
    assert isinstance(task, SupervisedTask)
    train = {e.game_seed for e in task.dataset("train")}
    validation = {e.game_seed for e in task.dataset("validation")}
    assert len(train) == 300 and len(validation) == 100 and not train & validation
    assert task.dataset("train")[5] == TextArenaTask.Config().build().dataset("train")[5]
    for episode in task.dataset("train")[:20]:
        solved = task.solved_conversation(episode)
        replies = [m["content"] for m in solved if m["role"] == "assistant"]
        messages, parts = play(task.make_env(episode), replies)
        assert messages == solved  # the solver's game is the env's game
        assert all(p["valid_move"] == 1.0 for p in parts)
        assert parts[-1]["game_reward"] == 1.0
        assert len(replies) <= 5  # halving 1..20


def test_binary_search_follows_the_hints() -> None:
    opening = [{"role": "user", "content": "guess the number between 1 and 20 within 10 turns"}]
    assert binary_search(opening) == "[10]"
    history = opening + [{"role": "assistant", "content": "[10]"},
                         {"role": "user", "content": "The target number is higher."},
                         {"role": "assistant", "content": "[15]"},
                         {"role": "user", "content": "The target number is lower."}]
    assert binary_search(history) == "[12]"


@pytest.mark.parametrize(("change", "message"), [
    ({"env_id": "GuessTheNumbr-v0"},
     r"env_id: no textarena game 'GuessTheNumbr-v0'; did you mean 'GuessTheNumber-v0'\?"),
    ({"num_train_episodes": 0}, "num_train_episodes must be >= 1"),
])
def test_config_errors_name_the_key(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TextArenaTask.Config(**change)


def test_build_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match=r"task.solver = 'examples.nowhere:f': No module named"):
        TextArenaTask.Config(solver="examples.nowhere:f").build()
    with pytest.raises(ValueError, match=r"task.env_id 'GuessTheNumber-v0': textarena could not "
                                         r"start it for one player: TypeError"):
        TextArenaTask.Config(env_kwargs={"no_such_argument": 1}).build()
    with pytest.raises(ValueError, match="solved conversations .* only with a solver"):
        TextArenaTask.Config().build().solved_conversation(
            TextArenaTask.Config().build().dataset("train")[0])


def test_invalid_end_reward_replaces_the_games_reward_for_a_game_lost_to_invalid_moves() -> None:
    moves = ["[10]", "x", "x", "x", "x", "x"]  # one guess, then more invalid moves than allowed
    own = TextArenaTask.Config().build()
    episode = own.dataset("train")[3]
    _, parts = play(own.make_env(episode), moves)
    assert parts[-1]["valid_move"] == 0.0 and parts[-1]["game_reward"] > 0.4  # the game's own
    zero = TextArenaTask.Config(invalid_end_reward=0.0).build()
    _, parts = play(zero.make_env(episode), moves)
    assert parts[-1]["game_reward"] == 0.0
    # a game won or run out of turns keeps the game's reward
    solved = TextArenaTask.Config(solver=SOLVER, invalid_end_reward=0.0).build()
    replies = [m["content"] for m in solved.solved_conversation(episode) if m["role"] == "assistant"]
    assert play(solved.make_env(episode), replies)[1][-1]["game_reward"] == 1.0
