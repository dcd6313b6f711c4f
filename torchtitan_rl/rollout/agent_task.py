"""AgentTask: a task whose episodes are played by an agent program over the run's
OpenAI-compatible endpoint, not by a MessageEnv.

    [task]
    type = "torchtitan_rl.rollout.agent_task:AgentTask"
    agent = "examples.alphabet_sort.agent:run"   # async def run(episode, client)
    [task.episodes]                                          # the task whose episode specs it plays
    type = "examples.alphabet_sort:AlphabetSortTask"

    Rollouter.run_single_rollout: env = task.make_env(spec) -> an AgentEnv -> env.play(...):
        EpisodeCapture(generate_fn, seeds, limits) --open--> EpisodeServer -> base_url
        client = the run's AsyncOpenAI .with_options(base_url)  (in process to the app)
        reward = await agent(spec, client)                  (any number of calls; client.base_url
                                                             and client.api_key for other clients)
        EpisodeServer.close(id) -> Rollout(turns = the captured calls, status, reward)

The endpoint starts with the first rollout, in the event loop the rollouts run in, and stops with
``aclose()`` (RunParts.close). The agent gets an ``openai.AsyncOpenAI`` already pointed at its
episode: a copy of one client per run, so an episode costs no client construction (~30 ms of
CPU: httpx builds an SSL context), and its calls reach the endpoint's app in process (no socket);
other clients use ``client.base_url`` over TCP. Closing it (``async with client``) leaves the
run's client open. The agent returns the reward, or
(reward, [one reward per call]) for per-turn credit (rollouter.credit = "turn"). An agent that
raises ends its rollout ERROR_ENV, one that runs past ``timeout_s`` ERROR_TIMEOUT, as MessageEnv
errors do; a GenerateFn that raises under a call fails the whole group, as in MessageEnv
rollouts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.config.convert import import_function
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.rollout.agent_capture import EpisodeCapture, EpisodeLimits
from torchtitan_rl.rollout.agent_server import EpisodeServer
from torchtitan_rl.rollout.agent_tools import ToolCalls, load_tool_parser
from torchtitan_rl.rollout.task_errors import (
    RewardTypeError,
    describe_exception,
    function_site,
    reward_value,
)
from torchtitan_rl.rollout.types import Rollout, RolloutStatus
from torchtitan_rl.task import Split, TaskConfig
from torchtitan_rl.types import GenerateFn, Sampling

logger = logging.getLogger(__name__)

Agent = Callable[[Any, Any], Awaitable[Any]]


def load_demonstration(path: str) -> Callable[[Any], Any]:
    """The function ``demonstration(episode)`` that ``path`` names (ConfigError naming
    task.demonstration)."""
    function = import_function(path, "task.demonstration")
    try:
        inspect.signature(function).bind("episode")
    except TypeError as e:
        raise ConfigError(f"task.demonstration = {path!r}: it must take (episode): {e}") from e
    if inspect.iscoroutinefunction(function):
        raise ConfigError(f"task.demonstration = {path!r}: a plain function expected, not async")
    return function


def load_agent(path: str) -> Agent:
    """The async function ``package.module:function`` names (ConfigError naming task.agent)."""
    function = import_function(path, "task.agent")
    if not inspect.iscoroutinefunction(function):
        raise ConfigError(f"task.agent = {path!r}: an `async def` function expected")
    try:
        inspect.signature(function).bind("episode", "client")
    except TypeError as e:
        raise ConfigError(f"task.agent = {path!r}: it must take (episode, client), the client an "
                          f"openai.AsyncOpenAI for the episode: {e}") from e
    return function


class AgentTask(Configurable):
    """Episodes of another task, played by an agent function through the run's endpoint."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TaskConfig):
        # with a demonstration the warm start is keyed by this config: its serving settings
        # do not change the demonstrations
        warm_start_independent_fields = ("agent", "timeout_s", "host", "port", "tool_parser",
                                         "model_name", "max_body_bytes",
                                         "max_concurrent_requests", "body_timeout_s")

        agent: str = ""
        """The agent, ``package.module:function``: ``async def run(episode, client)`` returning
        the reward (or (reward, [reward per model call]) for per-turn credit). ``client`` is an
        ``openai.AsyncOpenAI`` for this episode; another client can use ``str(client.base_url)``
        and ``client.api_key``."""
        episodes: TaskConfig = dataclasses.field(default_factory=TaskConfig)
        """The task whose train and validation episode specs the agent plays (its `type` and
        settings); its environment is not used. Its solved conversations feed the warm start."""
        timeout_s: float | None = 600.0
        """Wall-clock limit for one agent run (all its model calls included); past it the
        rollout ends ERROR_TIMEOUT. None: no limit."""
        host: str = "127.0.0.1"
        """Address the endpoint binds; 127.0.0.1 keeps it on this machine."""
        port: int = 0
        """Port the endpoint binds; 0 picks a free one."""
        model_name: str = "policy"
        """The model the endpoint serves (``GET /v1/models``); a request naming another model
        is a 404."""
        max_body_bytes: int = 8 << 20
        """Largest request body taken, in bytes; a larger one is a 413, unread."""
        max_concurrent_requests: int = 256
        """TCP requests the endpoint serves at once; past it a request is answered 503 with
        Retry-After at once (the ``openai`` client retries it). The agents' own calls through
        the client they are given run in process and do not count."""
        body_timeout_s: float = 30.0
        """A request body not received in full within this many seconds is a 408."""
        tool_parser: str = ""
        """vLLM's tool parser for the model's template (``hermes`` for Qwen3): a chat reply to a
        request with ``tools`` comes back with its tool calls parsed (``message.tool_calls``,
        finish_reason "tool_calls"). "": none, the reply's text as generated."""

        demonstration: str = ""
        """The warm start's data, ``package.module:function``: ``demonstration(episode)`` returns
        the conversation the agent would have with every call answered well, as messages or as
        ``{"messages": [...], "tools": [...]}`` with its tool calls (an agent that uses tools
        learns their format there). "": the episode task's solved conversations."""

        def warm_start_config(self) -> TaskConfig:
            # the warm start trains on the episode task's solved conversations, or on this
            # agent's demonstrations of them
            return self if self.demonstration else self.episodes

        def __post_init__(self) -> None:
            if self.timeout_s is not None and self.timeout_s <= 0:
                raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")
            if not 0 <= self.port < 65536:
                raise ValueError(f"port must be in [0, 65536), got {self.port}")
            for name in ("max_body_bytes", "max_concurrent_requests"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if self.body_timeout_s <= 0:
                raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
            if not self.model_name:
                raise ValueError("model_name must not be empty")

    def __init__(self, config: Config) -> None:
        if config.episodes.__class__ is TaskConfig:
            raise ConfigError("task.episodes.type: name the task whose episodes the agent plays, "
                              "e.g. [task.episodes] type = "
                              "\"examples.alphabet_sort:AlphabetSortTask\"")
        self.config = config
        self.agent = load_agent(config.agent)
        self._demonstration = (load_demonstration(config.demonstration)
                               if config.demonstration else None)
        self._tool_parser = load_tool_parser(config.tool_parser) if config.tool_parser else None
        self.episodes = config.episodes.build()
        self._server: EpisodeServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def dataset(self, split: Split) -> Sequence[Any]:
        return self.episodes.dataset(split)

    def make_env(self, episode: Any) -> AgentEnv:
        return AgentEnv(self, episode)

    def solved_conversation(self, episode: Any) -> list[dict[str, Any]] | dict[str, Any]:
        if self._demonstration is not None:
            return self._demonstration(episode)
        solve = getattr(self.episodes, "solved_conversation", None)
        if solve is None:
            raise ConfigError(f"warm_start.enabled needs task.episodes to solve its episodes; "
                              f"{type(self.episodes).__qualname__} has no solved_conversation")
        return solve(episode)

    def server(self) -> EpisodeServer:
        """The endpoint of the running event loop, started on first use (no await in between:
        concurrent first rollouts get the same one)."""
        loop = asyncio.get_running_loop()
        if self._server is None or self._loop is not loop:
            c = self.config
            self._server = EpisodeServer(
                host=c.host, port=c.port, model_name=c.model_name,
                max_body_bytes=c.max_body_bytes, max_concurrent_requests=c.max_concurrent_requests,
                body_timeout_s=c.body_timeout_s)
            self._server.start()
            self._loop = loop
        return self._server

    async def aclose(self) -> None:
        """Stop the endpoint (its open episodes end)."""
        if self._server is not None and self._loop is asyncio.get_running_loop():
            await self._server.aclose()
        self._server = self._loop = None


class AgentEnv:
    """One rollout of an AgentTask; the Rollouter calls ``play`` instead of driving a TokenEnv."""

    def __init__(self, task: AgentTask, episode: Any) -> None:
        self.task = task
        self.episode = episode

    async def play(self, generate_fn: GenerateFn, rollout: Rollout, *, sampling: Sampling,
                   base_seed: int, attempt: int, limits: EpisodeLimits, credit: str,
                   tokenizer: Any, count_special: Callable[[list[int], str], int]) -> None:
        """Run the agent on this rollout's episode URL; fills ``rollout`` (turns, status,
        reward; the reward of an errored rollout is the Rollouter's to set). Raises what the
        GenerateFn raised under one of the agent's calls."""
        server = self.task.server()
        capture = EpisodeCapture(
            generate_fn=generate_fn, tokenizer=tokenizer, sampling=sampling,
            base_seed=base_seed, group_id=rollout.group_id,
            rollout_index=rollout.rollout_index, attempt=attempt, limits=limits,
            count_special=count_special,
            tool_calls=(ToolCalls(self.task._tool_parser, tokenizer)
                        if self.task._tool_parser is not None else None))
        episode_id = server.open(capture)
        result: Any = None
        failure: tuple[RolloutStatus, str] | None = None
        timeout_s = self.task.config.timeout_s
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                result = await self.task.agent(self.episode, server.client(episode_id))
        except TimeoutError as e:
            if deadline.expired():
                failure = (RolloutStatus.ERROR_TIMEOUT, f"agent ran past {timeout_s}s")
            else:
                failure = (RolloutStatus.ERROR_ENV, describe_exception("the agent", e))
        except Exception as e:  # the agent is user code: its failure ends this rollout only
            failure = (RolloutStatus.ERROR_ENV, describe_exception("the agent", e))
        finally:
            server.close(episode_id, "the agent returned")
        if capture.infra_error is not None:
            raise capture.infra_error
        rollout.turns = capture.turns
        rollout.num_drift_events = sum(t.drift for t in capture.turns)
        if capture.status is RolloutStatus.ERROR_ABORT:
            failure = (capture.status, capture.error or "aborted")
        if failure is not None:
            if capture.status is not None and failure[0] is RolloutStatus.ERROR_ENV:
                failure = (failure[0], f"{failure[1]} after {capture.error}")
            rollout.status, rollout.error = failure
            # The loop summarises the task's failures per step; each goes to the log file.
            level = logging.INFO if failure[0] is RolloutStatus.ERROR_ENV else logging.WARNING
            logger.log(level, "%s: %s", rollout.session_id, rollout.error)
            return
        try:
            rollout.reward = self._reward(result, rollout, credit, self.task.agent)
        except ValueError as e:
            rollout.status, rollout.error = RolloutStatus.ERROR_ENV, str(e)
            logger.info("%s: %s", rollout.session_id, e)
            return
        rollout.status = capture.status or RolloutStatus.COMPLETED
        rollout.error = capture.error
        if rollout.status is RolloutStatus.COMPLETED and capture.turns and (
                capture.turns[-1].finish_reason == "length"):
            rollout.status = RolloutStatus.TRUNCATED_LENGTH

    @staticmethod
    def _reward(result: Any, rollout: Rollout, credit: str, agent: Agent) -> float:
        """The agent's reward (and per-call rewards onto the turns); ValueError naming what it
        returned, and where the agent is, when that is not a finite reward."""
        turn_rewards = None
        if isinstance(result, tuple) and len(result) == 2:
            result, turn_rewards = result
        reward = reward_value(result, "the agent", agent)
        if turn_rewards is not None:
            if not isinstance(turn_rewards, list | tuple):
                raise RewardTypeError(f"the agent returned per-call rewards {turn_rewards!r:.80}; "
                                      f"a list of numbers is required at {function_site(agent)}")
            values = [reward_value(r, "the agent's per-call rewards", agent)
                      for r in turn_rewards]
            if len(values) != len(rollout.turns):
                raise RewardTypeError(f"agent returned per-call rewards {values} for "
                                      f"{len(rollout.turns)} model calls (one finite value per "
                                      f"call expected)")
            for turn, value in zip(rollout.turns, values):
                turn.reward = value
                turn.reward_parts["reward"] = value  # per-turn metrics, validation, eval
        elif credit == "turn":
            raise ValueError("rollouter.credit = 'turn' needs the agent to return (reward, "
                             "[reward per model call])")
        return reward
