"""Routing strategies over several generators (pure logic: GenerateFns are plain functions here;
the end-to-end test with real generator meshes lives in the async-loop tests)."""

from __future__ import annotations

import asyncio

import pytest

from torchtitan_rl.generator.router import GeneratorRouter
from torchtitan_rl.types import Completion, GenerateRequest, Sampling


class _RecordingGenerator:
    def __init__(self, index: int, release: asyncio.Event | None = None) -> None:
        self.index = index
        self.release = release
        self.request_ids: list[str] = []

    async def __call__(self, request: GenerateRequest):
        prompt_token_ids, request_id = request.prompt_token_ids, request.request_id
        self.request_ids.append(request_id)
        if self.release is not None:
            await self.release.wait()
        return Completion(request_id=request_id, prompt_token_ids=prompt_token_ids, token_ids=[1],
                          token_logprobs=[0.0], token_policy_versions=[0], finish_reason="stop")


def _request(request_id: str, session_id: str) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[1], request_id=request_id, session_id=session_id,
                           sampling=Sampling())


def _router(strategy: str, n: int = 3, release: asyncio.Event | None = None):
    gens = [_RecordingGenerator(i, release) for i in range(n)]
    return GeneratorRouter.Config(strategy=strategy).build(generators=gens), gens


def test_round_robin_cycles_through_generators():
    router, gens = _router("round_robin")

    async def go():
        for i in range(6):
            await router(_request(f"r{i}", f"s{i}"))

    asyncio.run(asyncio.wait_for(go(), 10))
    assert [g.request_ids for g in gens] == [["r0", "r3"], ["r1", "r4"], ["r2", "r5"]]


def test_least_loaded_prefers_the_generator_with_fewest_inflight_requests():
    release = asyncio.Event()
    router, gens = _router("least_loaded", n=2, release=release)

    async def go():
        first = asyncio.create_task(router(_request("a", "x")))
        await asyncio.sleep(0)  # let `a` reach generator 0 and block there
        second = asyncio.create_task(router(_request("b", "y")))
        await asyncio.sleep(0)
        assert router.inflight_requests == [1, 1]
        release.set()
        await asyncio.gather(first, second)

    asyncio.run(asyncio.wait_for(go(), 10))
    assert gens[0].request_ids == ["a"] and gens[1].request_ids == ["b"]
    assert router.inflight_requests == [0, 0]


def test_sticky_session_pins_turns_and_repins_while_in_a_push():
    router, gens = _router("sticky_session", n=2)

    async def turn(session: str, t: int):
        await router(_request(f"{session}/turn={t}", session))

    async def go():
        await turn("group=0/rollout=0", 0)
        await turn("group=0/rollout=1", 0)
        await turn("group=0/rollout=0", 1)
        router.set_in_push([0], True)
        await turn("group=0/rollout=0", 2)  # generator 0 takes a push: re-pinned to 1
        router.set_in_push([0], False)
        await turn("group=0/rollout=0", 3)  # stays on its new generator

    asyncio.run(asyncio.wait_for(go(), 10))
    assert gens[0].request_ids == ["group=0/rollout=0/turn=0", "group=0/rollout=0/turn=1"]
    assert gens[1].request_ids == ["group=0/rollout=1/turn=0", "group=0/rollout=0/turn=2",
                                   "group=0/rollout=0/turn=3"]


def test_a_failing_generator_fails_the_request_with_its_error():
    class Broken:
        async def __call__(self, *args, **kwargs):
            raise RuntimeError("generator 0 died: engine core exited")

    router = GeneratorRouter.Config(strategy="round_robin").build(generators=[Broken()])
    with pytest.raises(RuntimeError, match="generator 0 died"):
        asyncio.run(asyncio.wait_for(router(_request("r", "s")), 10))
    assert router.inflight_requests == [0]


def test_unknown_strategy_is_a_config_error():
    from torchtitan_rl.config.errors import ConfigError
    from torchtitan_rl.config.manager import config_from_toml_text

    with pytest.raises(ConfigError, match="strategy: expected one of"):
        config_from_toml_text(GeneratorRouter.Config, 'strategy = "random"\n')
