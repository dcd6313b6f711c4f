"""EpisodeCapture: one agent episode's calls, generated through the run's GenerateFn and recorded
token-exactly as the RolloutTurns of one Rollout.

    EpisodeServer --chat(messages) / complete(prompt)--> EpisodeCapture
    EpisodeCapture: prompt ids = previous prompt + completion's exact tokens + rendered tail
                    (the agent's history extends the previous call), else a full render (a branch)
    EpisodeCapture --GenerateRequest(request/session id, seed, clipped max_tokens)--> GenerateFn
    GenerateFn --Completion--> EpisodeCapture: RolloutTurn(prompt ids, completion ids, logprobs,
                                                           policy versions) -> reply text

The model's text is decoded from its tokens for the agent; nothing the agent sends back is ever
tokenized in place of those tokens: a history that repeats the reply verbatim is continued from
the generated ids, any other history is a new branch (packing.split_branches sees it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from torchtitan_rl.rollout.agent_tools import ToolCalls, same_reply
from torchtitan_rl.rollout.types import (
    RolloutStatus,
    RolloutTurn,
    request_id,
    request_seed,
    session_id,
)
from torchtitan_rl.types import Completion, GenerateFn, GenerateRequest, Sampling

logger = logging.getLogger(__name__)


class EpisodeError(Exception):
    """A call the episode refuses; the server answers it with ``status_code`` and the message."""

    def __init__(self, status_code: int, message: str, *, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.param = param


@dataclasses.dataclass(kw_only=True, slots=True)
class EpisodeLimits:
    """The Rollouter's limits, applied to an agent's calls."""

    max_turns: int
    """Most generate calls in the episode (rollouter.max_turns)."""
    max_rollout_tokens: int
    """Most tokens of one call's prompt + completion (rollouter.max_rollout_tokens)."""
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True, slots=True)
class _ChatState:
    """The last chat call: what the next call's history must repeat to extend it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    completion_ids: list[int]
    reply: str
    """The reply's text as generated (tool calls unparsed): what continuing renders."""
    message: dict[str, Any]
    """The assistant message the agent was sent (content, parsed tool calls)."""
    turn: RolloutTurn


class EpisodeCapture:
    """The calls of one rollout (group ``group_id``, sibling ``rollout_index``)."""

    def __init__(self, *, generate_fn: GenerateFn, tokenizer: Any, sampling: Sampling,
                 base_seed: int, group_id: int, rollout_index: int, attempt: int,
                 limits: EpisodeLimits, count_special: Callable[[list[int], str], int],
                 tool_calls: ToolCalls | None = None) -> None:
        self._generate_fn = generate_fn
        self._tool_calls = tool_calls
        self.tokenizer = tokenizer
        self._sampling = sampling
        self._base_seed = base_seed
        self.group_id = group_id
        self.rollout_index = rollout_index
        self._attempt = attempt
        self._limits = limits
        self._count_special = count_special
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        self._num_calls = 0
        self._last_chat: _ChatState | None = None
        self._inflight: set[asyncio.Future] = set()
        self.turns: list[RolloutTurn] = []
        self.ended = False
        self.status: RolloutStatus | None = None
        """A status the calls decided (ERROR_ABORT, TRUNCATED_*); None: the agent's outcome."""
        self.error: str | None = None
        self.infra_error: BaseException | None = None
        """What the GenerateFn raised: it fails the whole group, as in MessageEnv rollouts."""

    # ---- calls ----

    async def chat(self, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None,
                   max_tokens: int | None = None) -> tuple[Completion, dict[str, Any]]:
        """Generate the assistant reply to ``messages`` (normalised OpenAI messages): the
        completion and the assistant message for the agent (tool calls parsed when ``tools``
        are offered and the episode has a tool parser)."""
        self._check_open()
        parsing = bool(tools) and self._tool_calls is not None
        params = self._tool_calls.validate(tools) if parsing else []
        prompt_ids, previous, drift = self._chat_prompt(messages, tools)
        completion, text, turn = await self._generate(prompt_ids, max_tokens)
        if previous is not None:  # this call continued the previous one
            previous.turn.env_messages = [dict(m) for m in messages[len(previous.messages) + 1:]]
            previous.turn.drift = drift
        message = {"role": "assistant", "content": text}
        if parsing:
            message = self._tool_calls.parse(text, params)
        self._last_chat = _ChatState(messages=list(messages), tools=tools, prompt_ids=prompt_ids,
                                     completion_ids=list(completion.token_ids), reply=text,
                                     message=message, turn=turn)
        return completion, message

    async def complete(self, prompt_ids: list[int],
                       max_tokens: int | None = None) -> tuple[Completion, str]:
        """Generate a completion of raw ``prompt_ids``."""
        self._check_open()
        self._last_chat = None  # a chat call after this one renders its history anew
        completion, text, _ = await self._generate(list(prompt_ids), max_tokens, param="prompt")
        return completion, text

    def end(self) -> None:
        """No more calls: later ones are refused; calls in flight are cancelled."""
        self.ended = True
        for future in list(self._inflight):
            future.cancel()

    # ---- helpers ----

    def _check_open(self) -> None:
        if self.ended:
            raise EpisodeError(409, f"episode group={self.group_id}/rollout={self.rollout_index}"
                                    f" has ended ({self.error or 'the agent returned'})")
        if self._num_calls >= self._limits.max_turns:
            self._truncate(RolloutStatus.TRUNCATED_MAX_TURNS,
                           f"call {self._num_calls + 1} is past rollouter.max_turns="
                           f"{self._limits.max_turns}")
            raise EpisodeError(409, f"the episode allows {self._limits.max_turns} model calls "
                                    f"(rollouter.max_turns); this was call {self._num_calls + 1}",
                               code="max_turns_exceeded")

    def _truncate(self, status: RolloutStatus, why: str) -> None:
        if self.status is None:
            self.status, self.error = status, why

    async def _generate(self, prompt_ids: list[int], max_tokens: int | None,
                        param: str = "messages") -> tuple[Completion, str, RolloutTurn]:
        """``param``: the request field that made ``prompt_ids`` (named by a 400)."""
        room = self._limits.max_rollout_tokens - len(prompt_ids)
        if room < 1:
            self._truncate(RolloutStatus.TRUNCATED_LENGTH,
                           f"a prompt of {len(prompt_ids)} tokens left no room")
            raise EpisodeError(
                400, f"the prompt has {len(prompt_ids)} tokens; this episode's budget "
                     f"(rollouter.max_rollout_tokens) is {self._limits.max_rollout_tokens} "
                     f"tokens for prompt and completion", code="context_length_exceeded",
                param=param)
        turn_index = self._num_calls
        self._num_calls += 1
        rid = request_id(self.group_id, self.rollout_index, turn_index)
        if self._attempt:
            rid += f"/attempt={self._attempt}"

        wanted = self._sampling.max_tokens if max_tokens is None else min(max_tokens,
                                                                            self._sampling.max_tokens)
        sampling = dataclasses.replace(
            self._sampling, max_tokens=max(1, min(wanted, room)),
            seed=request_seed(self._base_seed, self.group_id, self.rollout_index, turn_index))
        request = GenerateRequest(prompt_token_ids=list(prompt_ids), request_id=rid,
                                  session_id=session_id(self.group_id, self.rollout_index),
                                  sampling=sampling)
        # A future of its own so that end() (the agent finished or was cancelled) can cancel it.
        call = asyncio.ensure_future(self._generate_fn(request))
        self._inflight.add(call)
        try:
            completion = await call
        except asyncio.CancelledError:
            if self.ended:
                raise EpisodeError(
                    409, "the episode ended while this call was generating") from None
            raise
        except Exception as e:
            self.infra_error = self.infra_error or e
            self.end()
            raise EpisodeError(500, f"the generator failed: {e!r}") from e
        finally:
            self._inflight.discard(call)
        if completion is None or completion.finish_reason == "abort":
            self.status = RolloutStatus.ERROR_ABORT
            self.error = ("generator returned no completion" if completion is None
                          else "generator aborted the request")
            self.end()
            raise EpisodeError(503, f"{rid}: the {self.error}")
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        turn = RolloutTurn(
            turn_index=turn_index, request_id=rid, prompt_token_ids=list(prompt_ids),
            completion_token_ids=list(completion.token_ids),
            completion_logprobs=list(completion.token_logprobs),
            policy_versions=list(completion.token_policy_versions),
            finish_reason=completion.finish_reason, completion_text=text,
            num_cached_prompt_tokens=completion.metrics.num_cached_prompt_tokens,
            num_special_tokens=self._count_special(completion.token_ids,
                                                   completion.finish_reason))
        self.turns.append(turn)
        self.turns.sort(key=lambda t: t.turn_index)  # concurrent calls finish in any order
        logger.debug("%s: %d prompt + %d completion tokens (%s)", rid, len(prompt_ids),
                     len(completion.token_ids), completion.finish_reason)
        return completion, text, turn

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
                add_generation_prompt: bool) -> str:
        kwargs = dict(self._limits.chat_template_kwargs)
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                     ) -> tuple[list[int], _ChatState | None, bool]:
        """(prompt ids, the previous call when this one extends it, drift) for ``messages``."""
        try:
            full_text = self._render(messages, tools, add_generation_prompt=True)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise EpisodeError(400, f"the model's chat template cannot render these messages: "
                                    f"{e}", param="messages") from e
        previous = self._last_chat
        if previous is None or not self._extends(previous, messages, tools):
            return self._encode(full_text), None, False
        if previous.message.get("tool_calls"):
            # Render the reply as generated, not from its parsed tool calls: the template's
            # rendering of the JSON need not be the model's text.
            messages = list(messages)
            messages[len(previous.messages)] = {"role": "assistant", "content": previous.reply}
            full_text = self._render(messages, tools, add_generation_prompt=True)
        full_ids = self._encode(full_text)
        prefix = previous.prompt_ids + previous.completion_ids
        drift = full_ids[: len(prefix)] != prefix
        history = messages[: len(previous.messages) + 1]
        tail = self._tail_text(previous, history, full_text, tools)
        if tail is None:
            logger.warning("chat template does not render the reply verbatim: the next prompt "
                           "is a full re-render (a branch in training samples)")
            return full_ids, None, drift
        return prefix + self._encode(tail), previous, drift

    @staticmethod
    def _extends(previous: _ChatState, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None) -> bool:
        """True when ``messages`` repeat the previous call's messages and then its reply verbatim."""
        n = len(previous.messages)
        if tools != previous.tools or len(messages) <= n or messages[:n] != previous.messages:
            return False
        return same_reply(previous.message, messages[n])

    def _tail_text(self, previous: _ChatState, history: list[dict[str, Any]], full_text: str,
                   tools: list[dict[str, Any]] | None) -> str | None:
        """What follows the previous completion's tokens in ``full_text`` (as TokenEnv._tail_text):
        the assistant turn's closer (minus the end token the completion holds), the new messages,
        the generation prompt. None when the template does not render the reply verbatim."""
        before = self._render(history[:-1], tools, add_generation_prompt=True)
        with_reply = self._render(history, tools, add_generation_prompt=False)
        if not with_reply.startswith(before + previous.reply) or not full_text.startswith(
                with_reply):
            return None
        closer = with_reply[len(before) + len(previous.reply):]
        ids = previous.completion_ids
        if ids and ids[-1] in self._special_ids:
            end_text = self.tokenizer.decode([ids[-1]], skip_special_tokens=False)
            if closer.startswith(end_text):
                closer = closer[len(end_text):]
        return closer + full_text[len(with_reply):]
