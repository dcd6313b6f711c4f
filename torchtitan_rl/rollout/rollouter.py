"""Rollouter: one episode spec -> a scored RolloutGroup of concurrent sibling rollouts.

    controller (or a rollout worker, rollouter.num_workers > 0: controller/rollout_workers/worker.py)
        --run_group_rollouts(generate_fn, episode, group_id, ...)--> Rollouter
    Rollouter: group_size x run_single_rollout, concurrently (one TaskGroup):
        make_env(episode) -> TokenEnv.reset()
        -> [generate_fn(GenerateRequest(prompt ids, request/session id, sampling))
            -> TokenEnv.step(completion)] x turns
        -> MessageEnv.score(replies, reward parts) -> close()
    Rollouter: group_advantages(rewards) -> RolloutGroup (dropped when it carries no signal)
               (credit "turn": also MessageEnv.turn_rewards -> one advantage per turn index)

Reproducibility: each request's seed is a hash of (base seed, group_id, rollout index, turn), never a
draw from a shared RNG, so a group's tokens do not depend on what else runs or in which order.
Failure: an env that raises or times out ends its own rollout (ERROR_ENV / ERROR_TIMEOUT) and its
siblings carry on; a generate_fn that raises fails the whole group (siblings are cancelled).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.rollout.advantage import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageStd,
    group_advantages,
    turn_returns,
)
from torchtitan_rl.rollout.agent_capture import EpisodeLimits
from torchtitan_rl.rollout.agent_task import AgentEnv
from torchtitan_rl.rollout.message_env import MessageEnv
from torchtitan_rl.rollout.task_errors import (
    RewardTypeError,
    describe_exception,
    function_site,
    reward_value,
)
from torchtitan_rl.rollout.token_env import TokenEnv, chat_template_kwargs
from torchtitan_rl.rollout.types import (
    Rollout,
    RolloutGroup,
    RolloutStatus,
    RolloutTurn,
    request_id,
    request_seed,
    session_id,
)
from torchtitan_rl.types import GenerateFn, GenerateRequest, Sampling

logger = logging.getLogger(__name__)


class Rollouter(Configurable):
    """Runs rollouts of any MessageEnv against any GenerateFn and scores them.

    Built with ``cfg.build(tokenizer=hf_tokenizer, make_env=task.make_env)``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        moved_keys = {"std_normalize": "renamed rollouter.advantage_std: 'none' is what "
                                       "std_normalize = false was (mean baseline only), 'sample' "
                                       "divides by the sample std (Bessel), 'population' by the "
                                       "std over n (what std_normalize = true was)"}

        group_size: int = 8
        """Sibling rollouts per episode (GRPO group, >= 2: their rewards are compared), used when
        run_group_rollouts gets none."""
        max_turns: int = 8
        """Cap on assistant turns per rollout; a rollout the env would continue past it ends
        TRUNCATED_MAX_TURNS."""
        max_rollout_tokens: int = 512
        """Budget for a rollout's whole sequence (prompts + completions), in tokens. Each turn's
        max_tokens is clipped to the room left; a prompt that leaves no room ends the rollout
        TRUNCATED_LENGTH without a generate call. Keep it <= the generator's max_model_len."""
        step_timeout_s: float | None = 60.0
        """Wall-clock limit for one env call (init, step, close), in seconds; None disables."""
        enable_thinking: bool | None = None
        """The chat template's `enable_thinking` variable, passed to every render of a run:
        rollouts, validation, eval, HTTP rollouts and the warm start's conversations. None: not
        passed, the template's own default (Qwen3's is thinking on: the model may open a
        `<think>` block). False: Qwen3's template ends the generation prompt with an empty
        think block, so replies start with the answer. Templates that do not read the
        variable (the project's own ChatML) render the same either way."""
        advantage: AdvantageEstimator = "grpo"
        """Advantage estimator (rollout/advantage.py): "grpo" (scaled by advantage_std), "rloo"
        (leave-one-out baseline), "reinforce_pp" and "reinforce_pp_baseline" (REINFORCE++: no
        baseline or the group mean, then whitened over each step's batch), "opo"
        (length-weighted baseline), "grpo_passk" (pass@k: only the best rollout, by its margin
        over the second), "gdpo" (each reward part normalised in the group on its own, summed,
        then whitened over the step: multi-reward tasks), "gae" (PPO: from the trainer's critic,
        needs trainer.critic.enabled)."""
        gdpo_reward_parts: list[str] = dataclasses.field(default_factory=list)
        """"gdpo": the reward parts (names in the env's ``reward_parts``, summed over a
        rollout's turns; a part a rollout never reported is 0) normalised one by one (verl's
        gdpo_reward_keys). Empty: every part any rollout of the group reported, in name order;
        none reported: the reward itself, as one part."""
        gdpo_reward_weights: list[float] = dataclasses.field(default_factory=list)
        """"gdpo": one weight per ``gdpo_reward_parts`` entry (verl's gdpo_reward_weights,
        TRL's reward_weights). Empty: 1 each."""
        advantage_std: AdvantageStd = "sample"
        """How "grpo" scales a group's advantages r_i - mean(r). "sample": divided by the group
        reward std with Bessel's correction (n - 1), + 1e-6: GRPO as verl and TRL compute it.
        "population": divided by the std over n. "none": not scaled, the mean baseline only
        (Dr. GRPO)."""
        credit: Literal["rollout", "turn"] = "rollout"
        """Which advantage a reply's tokens take. "rollout": the rollout's, one per episode (GRPO
        as verl and SkyRL apply it to multi-turn rollouts). "turn": their turn's own, the
        group-relative advantage (same advantage_std) of the turn's return G_t = r_t +
        turn_discount * G_{t+1} among the siblings that reached turn t, where r_t is the env's
        `MessageEnv.turn_rewards`: a turn is judged by what it and the turns after it earned, not
        by the turns before it."""
        turn_discount: float = 1.0
        """gamma in G_t (credit "turn"): 1 = reward to go, 0 = each turn's own reward only."""
        drop_zero_std_groups: bool = True
        """Drop (and count) groups whose counted rewards are all equal: zero advantage everywhere."""
        error_reward: float | None = None
        """Reward for rollouts that end ERROR_*. None excludes them from the baseline and from
        training (an infrastructure failure is not a learning signal)."""
        seed: int = 0
        """Base of the per-request seeds when the Sampling passed in has seed None."""
        num_workers: int = 0
        """Rollout worker processes that run the training groups (env steps, chat template,
        tokenizing), placed on the generators' hosts (controller/rollout_workers/worker.py). 0: the
        controller runs every turn itself. Default 0: on a 2-core machine one worker made the
        main job's steps ~25 % slower (its process competes with the generator and the trainer
        for the cores) although it cut the controller's CPU per turn from ~1.5 ms to a few
        messages a step (docs/scaling.md, "Rollout workers"); use workers when the generators
        run on other machines. With an agent task each worker serves its agents' endpoint on a free
        port (task.port must be 0)."""
        worker_outcome_interval_s: float = 0.1
        """A rollout worker sends its finished groups to the controller together: at once when
        it has no other group running, else at most this long after the first of them finished
        (one message, not one per group: each costs the controller ~1 ms of CPU). 0: at the end
        of the event-loop turn a group finished in."""

        def __post_init__(self) -> None:
            if self.group_size < 2:
                raise ValueError(f"group_size must be >= 2 (GRPO compares siblings), got "
                                 f"{self.group_size}")
            if self.num_workers < 0:
                raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
            if not self.worker_outcome_interval_s >= 0:
                raise ValueError(f"worker_outcome_interval_s must be >= 0, got "
                                 f"{self.worker_outcome_interval_s}")
            if self.max_turns < 1:
                raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
            if self.max_rollout_tokens < 2:
                raise ValueError(
                    f"max_rollout_tokens must be >= 2, got {self.max_rollout_tokens}"
                )
            if self.advantage not in ADVANTAGE_ESTIMATORS:
                raise ValueError(f"advantage must be one of {sorted(ADVANTAGE_ESTIMATORS)}, got "
                                 f"{self.advantage!r}")
            if self.gdpo_reward_weights and (len(self.gdpo_reward_weights)
                                             != len(self.gdpo_reward_parts)):
                raise ValueError(f"gdpo_reward_weights needs one weight per gdpo_reward_parts "
                                 f"entry ({len(self.gdpo_reward_parts)}), got "
                                 f"{len(self.gdpo_reward_weights)}")
            if self.advantage == "gdpo" and self.credit != "rollout":
                raise ValueError("advantage 'gdpo' needs credit 'rollout' (the reward parts "
                                 "are the rollout's)")
            if self.credit not in ("rollout", "turn"):
                raise ValueError(f"credit must be 'rollout' or 'turn', got {self.credit!r}")
            if not 0.0 <= self.turn_discount <= 1.0:
                raise ValueError(f"turn_discount must be in [0, 1], got {self.turn_discount}")
            if self.step_timeout_s is not None and self.step_timeout_s <= 0:
                raise ValueError(
                    f"step_timeout_s must be > 0 or None, got {self.step_timeout_s}"
                )

    def __init__(
        self, config: Config, *, tokenizer: Any,
        make_env: Callable[[Any], MessageEnv | AgentEnv]
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._make_env = make_env
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    async def run_group_rollouts(
        self,
        generate_fn: GenerateFn,
        episode: Any,
        group_id: int,
        group_size: int | None = None,
        sampling: Sampling | None = None,
        *,
        attempt: int = 0,
    ) -> RolloutGroup:
        """Roll out ``group_size`` siblings of ``episode`` concurrently, score them, and fill their
        advantages. ``sampling`` applies to every request (seed and max_tokens are set per request).
        Raises what generate_fn raised (the siblings are cancelled and their envs closed).
        ``attempt`` > 0: a restart of the group (its generator was lost); its request ids carry
        ``/attempt=N`` so they never meet a cancelled sibling's request still in an engine, and
        its seeds stay the same. ``group_size`` (default ``config.group_size``) is checked by the
        config that holds it (validation.samples_per_prompt for validation groups)."""
        size = self.config.group_size if group_size is None else group_size
        sampling = sampling if sampling is not None else Sampling()
        try:
            async with asyncio.TaskGroup() as tasks:
                futures = [
                    tasks.create_task(self.run_single_rollout(
                        generate_fn, episode, group_id=group_id, rollout_index=i,
                        sampling=sampling, attempt=attempt,
                    ))
                    for i in range(size)
                ]
        except ExceptionGroup as group_error:
            # The siblings were cancelled; the caller sees the generator's own error, not a
            # wrapper (several siblings failing alike, e.g. their generator died, are one error).
            errors = group_error.exceptions
            if len({type(e) for e in errors}) == 1:
                raise errors[0] from None
            raise
        group = RolloutGroup(group_id=group_id, episode=episode,
                             rollouts=[f.result() for f in futures])
        self._fill_advantages(group)
        return group

    async def run_single_rollout(
        self,
        generate_fn: GenerateFn,
        episode: Any,
        *,
        group_id: int,
        rollout_index: int,
        sampling: Sampling,
        attempt: int = 0,
    ) -> Rollout:
        """One rollout, scored; its advantage stays None (group-relative, see run_group_rollouts)."""
        rollout = Rollout(group_id=group_id, rollout_index=rollout_index,
                          status=RolloutStatus.ERROR_ENV)
        try:
            message_env = self._make_env(episode)
        except Exception as e:  # a bad episode spec fails its rollouts (loop: the run, if many)
            rollout.error = describe_exception("make_env()", e)
            logger.info("group %d: %s", group_id, rollout.error, exc_info=True)
            rollout.reward = self._error_reward()
            return rollout
        if isinstance(message_env, AgentEnv):  # an agent program plays it over the endpoint
            await self._play_agent(message_env, generate_fn, rollout, sampling, attempt)
            return rollout
        env = TokenEnv(message_env, self._tokenizer, max_turns=self.config.max_turns,
                       max_rollout_tokens=self.config.max_rollout_tokens,
                       step_timeout_s=self.config.step_timeout_s,
                       chat_template_kwargs=chat_template_kwargs(self.config.enable_thinking))
        try:
            await self._drive(env, generate_fn, rollout, sampling, attempt)
        finally:
            await env.close()
        self._score(message_env, rollout)
        return rollout

    # ---- helpers ----

    async def _play_agent(self, env: AgentEnv, generate_fn: GenerateFn, rollout: Rollout,
                          sampling: Sampling, attempt: int) -> None:
        c = self.config
        await env.play(
            generate_fn, rollout, sampling=sampling, attempt=attempt, credit=c.credit,
            base_seed=c.seed if sampling.seed is None else sampling.seed,
            limits=EpisodeLimits(max_turns=c.max_turns, max_rollout_tokens=c.max_rollout_tokens,
                                 chat_template_kwargs=chat_template_kwargs(c.enable_thinking)),
            tokenizer=self._tokenizer, count_special=self._count_special)
        if rollout.status.is_error:
            rollout.reward = self._error_reward()

    async def _drive(
        self, env: TokenEnv, generate_fn: GenerateFn, rollout: Rollout, sampling: Sampling,
        attempt: int = 0,
    ) -> None:
        """Alternate generate and env steps until a terminal status; fills rollout in place."""
        step = await env.reset()
        base_seed = self.config.seed if sampling.seed is None else sampling.seed
        while step.status is None:
            prompt_ids = step.prompt_token_ids
            assert prompt_ids is not None
            turn_index = len(rollout.turns)
            rid = request_id(rollout.group_id, rollout.rollout_index, turn_index)
            if attempt:
                rid += f"/attempt={attempt}"
            per_request = dataclasses.replace(
                sampling,
                max_tokens=env.max_new_tokens(sampling.max_tokens),
                seed=request_seed(base_seed, rollout.group_id, rollout.rollout_index,
                                  turn_index),
            )
            completion = await generate_fn(GenerateRequest(
                prompt_token_ids=list(prompt_ids), request_id=rid,
                session_id=session_id(rollout.group_id, rollout.rollout_index),
                sampling=per_request,
            ))
            next_step = await env.step(completion)
            if completion is not None:
                rollout.turns.append(RolloutTurn(
                    turn_index=turn_index, request_id=rid, prompt_token_ids=list(prompt_ids),
                    completion_token_ids=list(completion.token_ids),
                    completion_logprobs=list(completion.token_logprobs),
                    policy_versions=list(completion.token_policy_versions),
                    finish_reason=completion.finish_reason,
                    completion_text=next_step.completion_text,
                    env_messages=next_step.env_messages,
                    reward_parts=next_step.reward_parts,
                    drift=next_step.drift,
                    num_cached_prompt_tokens=completion.metrics.num_cached_prompt_tokens,
                    num_special_tokens=self._count_special(completion.token_ids,
                                                           completion.finish_reason),
                ))
            rollout.num_drift_events += int(next_step.drift)
            step = next_step
        rollout.status = step.status
        rollout.error = step.error

    def _count_special(self, token_ids: list[int], finish_reason: str) -> int:
        """Special tokens in a reply, not counting the end-of-turn token a stopped reply ends
        with (see RolloutTurn.num_special_tokens)."""
        if finish_reason == "stop" and token_ids and token_ids[-1] in self._special_ids:
            token_ids = token_ids[:-1]
        return sum(t in self._special_ids for t in token_ids)

    def _score(self, message_env: MessageEnv, rollout: Rollout) -> None:
        if rollout.status.is_error:
            rollout.reward = self._error_reward()
            return
        parts = [t.reward_parts for t in rollout.turns]
        what = "score()"
        try:
            rollout.reward = reward_value(message_env.score(rollout.replies, parts), what,
                                          type(message_env).score)
            if self.config.credit == "turn":
                what = "turn_rewards()"
                self._fill_turn_rewards(message_env, rollout, parts)
        except Exception as e:
            rollout.status = RolloutStatus.ERROR_ENV
            rollout.error = (str(e) if isinstance(e, RewardTypeError)
                             else describe_exception(what, e))
            logger.info("%s: %s", rollout.session_id, rollout.error, exc_info=True)
            rollout.reward = self._error_reward()

    @staticmethod
    def _fill_turn_rewards(message_env: MessageEnv, rollout: Rollout,
                           parts: list[dict[str, float]]) -> None:
        source = type(message_env).turn_rewards
        rewards = [reward_value(r, "turn_rewards()", source)
                   for r in message_env.turn_rewards(rollout.replies, parts)]
        if len(rewards) != len(rollout.turns):
            raise RewardTypeError(f"turn_rewards() returned {len(rewards)} rewards for "
                                  f"{len(rollout.turns)} turns (one per turn expected) at "
                                  f"{function_site(source)}")
        for turn, reward in zip(rollout.turns, rewards):
            turn.reward = reward

    def _error_reward(self) -> float:
        return 0.0 if self.config.error_reward is None else self.config.error_reward

    def _fill_turn_advantages(self, group: RolloutGroup) -> str | None:
        """Set each counted turn's advantage from the returns of its siblings' same turn; the
        group has no signal ("zero_std") only when no turn index has any spread. An errored
        rollout that still counts (``error_reward`` set) has no turn rewards: its tokens keep the
        rollout's advantage and it stays out of the turns' baselines."""
        gamma = self.config.turn_discount
        returns: dict[int, list[float]] = {}  # rollout index -> G_t per turn
        for i, rollout in enumerate(group.rollouts):
            if rollout.advantage is None or rollout.status.is_error:
                continue
            rewards = [t.reward for t in rollout.turns]
            assert None not in rewards, "scored rollouts have every turn's reward"
            returns[i] = turn_returns(rewards, gamma)
        spread = False
        for t in range(max((len(v) for v in returns.values()), default=0)):
            reached = [i for i, values in returns.items() if len(values) > t]
            advantages, no_signal = group_advantages(
                [returns[i][t] for i in reached], [True] * len(reached),
                advantage_std=self.config.advantage_std, estimator=self.config.advantage,
                lengths=[len(group.rollouts[i].turns[t].completion_token_ids) for i in reached])
            spread |= no_signal is None
            for i, advantage in zip(reached, advantages):
                group.rollouts[i].turns[t].advantage = advantage
        return None if spread else "zero_std"

    def _reward_components(self, group: RolloutGroup) -> list[list[float]] | None:
        """GDPO's reward parts: per part name, each rollout's sum over its turns (None: no part
        reported, the reward is the one part)."""
        names = self.config.gdpo_reward_parts or sorted(
            {name for r in group.rollouts for t in r.turns for name in t.reward_parts})
        if not names:
            return None
        return [[math.fsum(t.reward_parts.get(name, 0.0) for t in r.turns)
                 for r in group.rollouts] for name in names]

    def _fill_advantages(self, group: RolloutGroup) -> None:
        counted = [not r.status.is_error or self.config.error_reward is not None
                   for r in group.rollouts]
        components = self._reward_components(group) if self.config.advantage == "gdpo" else None
        advantages, no_signal = group_advantages(
            group.rewards, counted, advantage_std=self.config.advantage_std,
            estimator=self.config.advantage,
            lengths=[r.num_output_tokens for r in group.rollouts], components=components,
            component_weights=self.config.gdpo_reward_weights or None)
        for rollout, advantage in zip(group.rollouts, advantages, strict=True):
            rollout.advantage = advantage
        if self.config.credit == "turn" and no_signal != "all_errored":
            no_signal = self._fill_turn_advantages(group)
        if no_signal == "all_errored" or (no_signal and self.config.drop_zero_std_groups):
            group.dropped = True
            group.drop_reason = no_signal
            # DEBUG: counted per step (rollout/num_groups_dropped_*); every validation group of
            # one sample is "dropped" too, which says nothing.
            logger.debug("group %d dropped: %s (rewards %s)", group.group_id, no_signal,
                        [round(r, 4) for r in group.rewards])
