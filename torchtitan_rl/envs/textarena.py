"""TextArenaTask: a single-player textarena game as a multi-turn `MessageEnv`.

    [task]
    type = "textarena"
    env_id = "GuessTheNumber-v0"                 # any textarena.make id of a 1-player game
    solver = "examples.textarena_solvers:guess_the_number"   # optional: enables the warm start

    controller: task = TextArenaTask.Config(...).build()
    controller: episode = task.dataset(split)[i]      a game seed (splits never share one)
    Rollouter:  env = task.make_env(episode)          textarena.make(env_id), reset(seed)
                env.init() -> [user: the game's prompt]
                env.step(reply) -> textarena step(reply); the game's new messages as one user turn
                env.score() -> the game's own reward for player 0 (0 for a game left unfinished)
    WarmStart:  task.solved_conversation(episode)     the solver plays the game; its moves as replies

The game runs without textarena's LLM wrappers: the chat already holds the history they would
rebuild, so each turn adds only the game's new messages. Reward parts per turn: ``valid_move``
(1, or 0 when the game's own check refused the move) and, on the last turn, ``game_reward`` (the
game's own, or ``invalid_end_reward`` for a game lost to invalid moves when that is set).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.config.convert import import_function
from torchtitan_rl.rollout.message_env import EnvStep, Message, MessageEnv
from torchtitan_rl.task import EpisodeSplit, Split, TaskConfig

EXTRA_HINT = "pip install -e '.[envs]' (scripts/setup_env.sh installs it)"
_SPLIT_OFFSET = {"train": 0, "validation": 1}

Solver = Callable[[list[Message]], str]
"""A scripted player: the conversation so far (the game's turns as user messages, its own moves as
assistant messages) -> the next move."""


@dataclasses.dataclass(frozen=True, slots=True)
class TextArenaEpisode:
    episode_id: str
    game_seed: int


def make_game(env_id: str, env_kwargs: dict[str, Any]) -> Any:
    """The registered game without textarena's default wrappers (the chat keeps the history)."""
    from textarena.envs.registration import ENV_REGISTRY  # the package registers every game

    spec = ENV_REGISTRY[env_id]
    module_name, _, name = spec.entry_point.partition(":")
    game_class = getattr(importlib.import_module(module_name), name)
    return game_class(**{**spec.kwargs, **env_kwargs})


def _game_text(observations: list[tuple[int, str, Any]]) -> str:
    """The game's new messages to player 0, one a line (the player's own moves left out)."""
    return "\n".join(message for sender, message, _ in observations if sender != 0)


class TextArenaEnv(MessageEnv):
    """One game for player 0."""

    def __init__(self, game: Any, episode: TextArenaEpisode, *,
                 invalid_end_reward: float | None = None) -> None:
        self._game = game
        self.episode = episode
        self._invalid_end_reward = invalid_end_reward
        self._reward: float | None = None

    async def init(self) -> list[Message]:
        self._game.reset(num_players=1, seed=self.episode.game_seed)
        self._reward = None
        _, observations = self._game.get_observation()
        return [{"role": "user", "content": _game_text(observations)}]

    async def step(self, assistant_message: Message) -> EnvStep:
        import textarena

        done, _ = self._game.step(assistant_message.get("content") or "")
        _, observations = self._game.get_observation()
        refused = any(kind == textarena.ObservationType.GAME_ADMIN and "invalid move" in
                      message.lower() for _, message, kind in observations)
        state = self._game.state
        lost_to_invalid_move = bool(done and state.game_info[0].get("invalid_move"))
        parts = {"valid_move": 0.0 if refused or lost_to_invalid_move else 1.0}
        if done:
            self._reward = float((state.rewards or {}).get(0, 0.0))
            if lost_to_invalid_move and self._invalid_end_reward is not None:
                self._reward = self._invalid_end_reward
            parts["game_reward"] = self._reward
            return EnvStep(done=True, reward_parts=parts)
        return EnvStep(messages=[{"role": "user", "content": _game_text(observations)}],
                       reward_parts=parts)

    def score(self, replies: list[str], reward_parts: list[dict[str, float]]) -> float:
        """The game's reward for player 0 when it ended; 0 for a game cut off unfinished."""
        return next((p["game_reward"] for p in reward_parts if "game_reward" in p), 0.0)

    def turn_rewards(self, replies: list[str], reward_parts: list[dict[str, float]]) -> list[float]:
        raise ValueError("textarena games reward the whole game, not each move: use "
                         "rollouter.credit = 'rollout'")


class TextArenaSplit(EpisodeSplit[TextArenaEpisode]):
    def __init__(self, *, seed: int, split: Split, num_episodes: int) -> None:
        super().__init__(split, num_episodes)
        self._seed = seed

    def episode(self, index: int) -> TextArenaEpisode:
        # even seeds train, odd seeds validate: the splits never play the same seed
        game_seed = self._seed * 10_000_019 + 2 * index + _SPLIT_OFFSET[self.split]
        return TextArenaEpisode(episode_id=f"{self.split}/{index}", game_seed=game_seed)


class TextArenaTask(Configurable):
    """A textarena game by its registered id; a solver, when given, plays it for the warm start."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TaskConfig):
        warm_start_independent_fields = ("num_validation_episodes",)

        env_id: str = "GuessTheNumber-v0"
        """A registered textarena game for one player (`textarena.make`'s id)."""
        env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
        """Overrides of the game's registered arguments (e.g. {max_turns = 8})."""
        solver: str | None = None
        """'module:function' of a scripted player (the conversation so far -> the next move): the
        warm start's solved conversations. None: no warm start for this task."""
        invalid_end_reward: float | None = None
        """The reward of a game that ended because the player's invalid moves ran out the game's
        error allowance; None: the game's own (GuessTheNumber gives how close the last valid
        guess was, which a policy can learn to collect by ending the game early)."""
        seed: int = 0
        """Fixes every game's seed."""
        num_train_episodes: int = 100_000
        """Games of the training split (>= 1)."""
        num_validation_episodes: int = 256
        """Games of the held-out split (>= 1): seeds no training game uses."""

        def __post_init__(self) -> None:
            if importlib.util.find_spec("textarena") is None:
                raise ValueError(f"textarena is not installed: {EXTRA_HINT}")
            for name in ("num_train_episodes", "num_validation_episodes"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            import difflib

            from textarena.envs.registration import ENV_REGISTRY

            if self.env_id not in ENV_REGISTRY:
                near = difflib.get_close_matches(self.env_id, list(ENV_REGISTRY), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ValueError(f"env_id: no textarena game {self.env_id!r}{hint}")

    def __init__(self, config: Config) -> None:
        self.config = config
        try:
            game = make_game(config.env_id, config.env_kwargs)
            game.reset(num_players=1, seed=0)
        except Exception as e:
            raise ValueError(f"task.env_id {config.env_id!r}: textarena could not start it for one "
                             f"player: {type(e).__name__}: {e}") from e
        self._solver: Solver | None = None
        if config.solver is not None:
            self._solver = import_function(config.solver, "task.solver")
        self._splits = {split: TextArenaSplit(seed=config.seed, split=split, num_episodes=n)
                        for split, n in (("train", config.num_train_episodes),
                                         ("validation", config.num_validation_episodes))}

    def dataset(self, split: Split) -> TextArenaSplit:
        if split not in self._splits:
            raise ValueError(f"split must be one of {sorted(self._splits)}, got {split!r}")
        return self._splits[split]

    def make_env(self, episode: TextArenaEpisode) -> TextArenaEnv:
        return TextArenaEnv(make_game(self.config.env_id, self.config.env_kwargs), episode,
                            invalid_end_reward=self.config.invalid_end_reward)

    def solved_conversation(self, episode: TextArenaEpisode) -> list[Message]:
        """The solver's game, played through the same env a rollout plays."""
        if self._solver is None:
            raise ValueError("task.solver is not set: a textarena task has solved conversations "
                             "(the warm start) only with a solver")
        env = self.make_env(episode)

        async def play() -> list[Message]:
            messages = await env.init()
            for _ in range(1000):
                move = self._solver(messages)
                step = await env.step({"role": "assistant", "content": move})
                messages = [*messages, {"role": "assistant", "content": move}, *step.messages]
                if step.done:
                    return messages
            raise ValueError(f"task.solver {self.config.solver!r} did not finish "
                             f"{episode.episode_id} in 1000 moves")

        return _finish(play())


def _finish(coroutine: Any) -> Any:
    """The value of a coroutine that never waits (the env's methods do no I/O), run in place: the
    warm start calls this from a worker thread, the tokenizer's corpus from inside a running
    event loop's caller, where asyncio.run cannot nest."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise RuntimeError("a textarena env awaited something: it must not wait")
