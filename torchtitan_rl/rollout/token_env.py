"""TokenEnv: drives a MessageEnv in tokens, token-in/token-out.

    Rollouter --reset()--> TokenEnv --init()--> MessageEnv; render [messages] -> prompt ids
    Rollouter --prompt ids--> generator --Completion--> Rollouter --step(completion)--> TokenEnv
    TokenEnv: decode completion -> assistant message --step()--> MessageEnv -> env messages
    TokenEnv: next prompt = previous prompt + completion's exact tokens + rendered (closer + new messages)

Invariant: every prompt after the first extends the previous prompt + completion token for token,
so the trainer sees exactly the tokens the generator produced (no re-tokenisation). Drift, i.e.
re-rendering the whole history would NOT extend those tokens, is detected and counted, never applied.
Limits: turn cap, rollout token budget (whole sequence: prompts + completions), per-call timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from torchtitan_rl.rollout.message_env import EnvStep, Message, MessageEnv
from torchtitan_rl.rollout.task_errors import (
    RewardTypeError,
    describe_exception,
    env_step_value,
    messages_value,
    reward_value,
)
from torchtitan_rl.rollout.types import RolloutStatus
from torchtitan_rl.types import Completion

logger = logging.getLogger(__name__)


def chat_template_kwargs(enable_thinking: bool | None) -> dict[str, Any]:
    """The extra variables every ``apply_chat_template`` call of a run passes (rollouts, validation,
    eval, HTTP rollouts and the warm start alike), from `Rollouter.Config.enable_thinking`: {} when
    None (the template's own default), else ``{"enable_thinking": ...}``. Templates that do not
    read the variable render the same either way."""
    return {} if enable_thinking is None else {"enable_thinking": enable_thinking}


@dataclasses.dataclass(kw_only=True, slots=True)
class TokenEnvStep:
    """What TokenEnv produced. ``status`` None means: generate ``prompt_token_ids`` next."""

    prompt_token_ids: list[int] | None
    status: RolloutStatus | None
    completion_text: str = ""
    env_messages: list[Message] = dataclasses.field(default_factory=list)
    reward_parts: dict[str, float] = dataclasses.field(default_factory=dict)
    drift: bool = False
    error: str | None = None


class TokenEnv:
    """Wraps one MessageEnv with an HF tokenizer's chat template (any template that renders message
    content verbatim bridges token-in/token-out; others fall back to a full re-render, which the
    packer then sees as a branch)."""

    def __init__(
        self,
        message_env: MessageEnv,
        tokenizer: Any,
        *,
        max_turns: int,
        max_rollout_tokens: int,
        step_timeout_s: float | None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """``max_turns`` and ``max_rollout_tokens``: `Rollouter.Config`'s, checked there."""
        self._env = message_env
        self._tokenizer = tokenizer
        self._chat_template_kwargs = dict(chat_template_kwargs or {})
        self._max_turns = max_turns
        self._max_rollout_tokens = max_rollout_tokens
        self._step_timeout_s = step_timeout_s
        self._messages: list[Message] = []
        self._prompt_ids: list[int] = []
        self._num_turns = 0
        self._closed = False

    @property
    def num_turns(self) -> int:
        return self._num_turns

    def max_new_tokens(self, requested: int) -> int:
        """``requested`` clipped to the room left in the rollout token budget (>= 1 while ongoing)."""
        return max(1, min(requested, self._max_rollout_tokens - len(self._prompt_ids)))

    async def reset(self) -> TokenEnvStep:
        """Render the env's opening messages into the first prompt."""
        try:
            messages = await self._call(self._env.init())
        except TimeoutError:
            return self._fail(RolloutStatus.ERROR_TIMEOUT, "init timed out", "")
        except Exception as e:  # the env is user code: any failure ends this rollout only
            return self._fail(RolloutStatus.ERROR_ENV, describe_exception("init()", e), "",
                              exc=e)
        try:
            messages = messages_value(messages, "init()", type(self._env).init)
        except RewardTypeError as e:
            return self._fail(RolloutStatus.ERROR_ENV, str(e), "")
        self._messages = list(messages)
        prompt_ids = self._encode(self._render(self._messages, add_generation_prompt=True))
        if len(prompt_ids) >= self._max_rollout_tokens:
            logger.info("first prompt has %d tokens, budget %d: TRUNCATED_LENGTH",
                        len(prompt_ids), self._max_rollout_tokens)
            return TokenEnvStep(prompt_token_ids=None, status=RolloutStatus.TRUNCATED_LENGTH)
        self._prompt_ids = prompt_ids
        return TokenEnvStep(prompt_token_ids=prompt_ids, status=None)

    async def step(self, completion: Completion | None) -> TokenEnvStep:
        """Feed one completion of the last prompt; returns the next prompt or a terminal status."""
        if completion is None:
            return self._fail(RolloutStatus.ERROR_ABORT, "generator returned no completion", "")
        self._num_turns += 1
        text = self._tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        if completion.finish_reason == "abort":
            return self._fail(RolloutStatus.ERROR_ABORT, "generator aborted the request", text)
        if completion.finish_reason == "length":
            # A cut-off reply is final: scored as is, the env is not stepped on half a message.
            return TokenEnvStep(prompt_token_ids=None, status=RolloutStatus.TRUNCATED_LENGTH,
                                completion_text=text)

        assistant: Message = {"role": "assistant", "content": text}
        try:
            env_step: EnvStep = await self._call(self._env.step(assistant))
        except TimeoutError:
            return self._fail(RolloutStatus.ERROR_TIMEOUT,
                              f"step timed out after {self._step_timeout_s}s", text)
        except Exception as e:
            return self._fail(RolloutStatus.ERROR_ENV, describe_exception("step()", e), text,
                              exc=e)
        try:
            env_step = env_step_value(env_step, type(self._env).step)
            reward_parts = {name: reward_value(value, f"step() reward part {name!r}",
                                               type(self._env).step)
                            for name, value in env_step.reward_parts.items()}
        except RewardTypeError as e:
            return self._fail(RolloutStatus.ERROR_ENV, str(e), text)

        done = TokenEnvStep(prompt_token_ids=None, status=RolloutStatus.COMPLETED,
                            completion_text=text, env_messages=list(env_step.messages),
                            reward_parts=reward_parts)
        if env_step.done:
            return done
        if self._num_turns >= self._max_turns:
            done.status = RolloutStatus.TRUNCATED_MAX_TURNS
            return done

        history = self._messages + [assistant]
        next_ids, drift = self._next_prompt(history, completion.token_ids, env_step.messages)
        self._messages = history + list(env_step.messages)
        done.drift = drift
        if len(next_ids) >= self._max_rollout_tokens:
            done.status = RolloutStatus.TRUNCATED_LENGTH
            return done
        self._prompt_ids = next_ids
        done.prompt_token_ids = next_ids
        done.status = None
        return done

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._call(self._env.close())
        except Exception:  # closing must not fail the rollout it ends
            logger.warning("env close failed", exc_info=True)

    # ---- helpers ----

    async def _call(self, awaitable: Any) -> Any:
        if self._step_timeout_s is None:
            return await awaitable
        # Not asyncio.wait_for: it wraps every env call in a task of its own, which the
        # controller pays for on every turn of every rollout.
        async with asyncio.timeout(self._step_timeout_s):
            return await awaitable

    def _fail(self, status: RolloutStatus, error: str, text: str,
              exc: BaseException | None = None) -> TokenEnvStep:
        # The task's failures are counted and summarised per step by the loop (one console
        # line); each one, with its traceback, goes to the log file only.
        level = logging.INFO if status is RolloutStatus.ERROR_ENV else logging.WARNING
        logger.log(level, "rollout env: %s -> %s", error, status.value,
                   exc_info=(type(exc), exc, exc.__traceback__) if exc else None)
        return TokenEnvStep(prompt_token_ids=None, status=status, completion_text=text,
                            error=error)

    def _render(self, messages: list[Message], *, add_generation_prompt: bool) -> str:
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            **self._chat_template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _next_prompt(
        self, history: list[Message], completion_ids: list[int], new_messages: list[Message]
    ) -> tuple[list[int], bool]:
        """(next prompt ids, drift). ``history`` ends with the assistant message."""
        prefix = self._prompt_ids + list(completion_ids)
        full_text = self._render(history + list(new_messages), add_generation_prompt=True)
        full_ids = self._encode(full_text)
        drift = full_ids[: len(prefix)] != prefix
        tail = self._tail_text(history, completion_ids, full_text)
        if tail is None:
            logger.warning("chat template does not render the reply verbatim: the next prompt is "
                           "a full re-render (a branch in training samples)")
            return full_ids, drift
        return prefix + self._encode(tail), drift

    def _tail_text(
        self, history: list[Message], completion_ids: list[int], full_text: str
    ) -> str | None:
        """The text that follows the completion's tokens in ``full_text``: what closes the
        assistant turn (minus the end token the completion already holds) + the new messages
        + the generation prompt. None when the template does not render the reply verbatim."""
        reply = history[-1]["content"]
        before = self._render(history[:-1], add_generation_prompt=True)
        with_reply = self._render(history, add_generation_prompt=False)
        if not with_reply.startswith(before + reply) or not full_text.startswith(with_reply):
            return None
        closer = with_reply[len(before) + len(reply):]
        if completion_ids and completion_ids[-1] in self._special_ids():
            # The sampled end token (e.g. <|im_end|>) is already in the sequence: keep it, add the rest.
            end_text = self._tokenizer.decode([completion_ids[-1]], skip_special_tokens=False)
            if closer.startswith(end_text):
                closer = closer[len(end_text):]
        return closer + full_text[len(with_reply):]

    def _special_ids(self) -> set[int]:
        return set(getattr(self._tokenizer, "all_special_ids", []) or [])
