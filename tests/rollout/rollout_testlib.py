"""Fakes for the rollout unit tests: scripted generate functions and environments.

Only pure-logic tests use these; the real-engine test lives in test_rollout_vllm.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import pathlib
from collections.abc import Callable
from typing import Any

from torchtitan_rl.rollout import EnvStep, Message, MessageEnv
from torchtitan_rl.types import Completion, GenerateRequest, Sampling

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


@functools.cache
def tiny_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from torchtitan_rl.assets.make_model import ensure_model

    return AutoTokenizer.from_pretrained(str(ensure_model("tiny", REPO_ROOT / "assets" / "models")))


def run(coro: Any, timeout_s: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@dataclasses.dataclass
class Call:
    prompt_token_ids: list[int]
    request_id: str
    session_id: str
    sampling: Sampling


class ScriptedGenerate:
    """A GenerateFn answering with ``reply(request_id, prompt_ids)`` text + the end token.

    Logprobs are -0.25 per token (or NaN where ``nan_logprobs``), policy version ``version``.
    ``reply`` may return None (request dropped) or (text, finish_reason).
    """

    def __init__(self, reply: Callable[[str, list[int]], Any], *, version: int = 7,
                 nan_logprobs: bool = False, add_eos: bool = True) -> None:
        self.tokenizer = tiny_tokenizer()
        self.reply = reply
        self.version = version
        self.nan_logprobs = nan_logprobs
        self.add_eos = add_eos
        self.calls: list[Call] = []

    async def __call__(self, request: GenerateRequest) -> Completion | None:
        prompt_token_ids, request_id = request.prompt_token_ids, request.request_id
        assert request.session_id is not None and request.sampling is not None
        sampling = request.sampling
        self.calls.append(Call(list(prompt_token_ids), request_id, request.session_id, sampling))
        answer = self.reply(request_id, prompt_token_ids)
        if answer is None:
            return None
        text, finish = answer if isinstance(answer, tuple) else (answer, "stop")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if finish == "stop" and self.add_eos:
            ids = ids + [self.tokenizer.eos_token_id]
        ids = ids[: sampling.max_tokens]
        logprob = float("nan") if self.nan_logprobs else -0.25
        return Completion(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                          token_ids=ids, token_logprobs=[logprob] * len(ids),
                          token_policy_versions=[self.version] * len(ids), finish_reason=finish)


class CountingEnv(MessageEnv):
    """``num_turns`` scripted user turns; reward part = 1.0 when the reply contains "yes"."""

    def __init__(self, num_turns: int = 3, *, fail_on_turn: int | None = None,
                 hang_on_turn: int | None = None, fail_init: bool = False) -> None:
        self.num_turns = num_turns
        self.fail_on_turn = fail_on_turn
        self.hang_on_turn = hang_on_turn
        self.fail_init = fail_init
        self.turn = 0
        self.closed = 0

    async def init(self) -> list[Message]:
        if self.fail_init:
            raise RuntimeError("init broke")
        return [{"role": "user", "content": "turn 0: say yes"}]

    async def step(self, assistant_message: Message) -> EnvStep:
        if self.turn == self.fail_on_turn:
            raise RuntimeError(f"env broke on turn {self.turn}")
        if self.turn == self.hang_on_turn:
            await asyncio.Event().wait()  # never set: only the step timeout ends it
        parts = {"yes": 1.0 if "yes" in assistant_message["content"] else 0.0}
        self.turn += 1
        if self.turn >= self.num_turns:
            return EnvStep(done=True, reward_parts=parts)
        return EnvStep(messages=[{"role": "user", "content": f"turn {self.turn}: again"}],
                       reward_parts=parts)

    async def close(self) -> None:
        self.closed += 1
