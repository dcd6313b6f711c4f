"""The agent endpoint under bad input: the real EpisodeServer over real HTTP on 127.0.0.1 (uvicorn,
httpx, raw sockets), with a scripted generate function and the tiny model's tokenizer. Every bad
request gets a 4xx naming what is wrong (or a 503 with Retry-After when the endpoint is full),
nothing reaches the generator, and the episode's next good call is the one it would have been:
as if the bad ones had not come. docs/fault_tolerance.md#bad-input summarises these cases."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import pytest

from tests.rollout.rollout_testlib import ScriptedGenerate, run, tiny_tokenizer
from torchtitan_rl.rollout.agent_capture import EpisodeCapture, EpisodeLimits
from torchtitan_rl.rollout.agent_server import EpisodeServer
from torchtitan_rl.rollout.types import request_seed
from torchtitan_rl.types import Completion, GenerateRequest, Sampling

GOOD_CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
GOOD_COMPLETION = {"model": "policy", "prompt": [5, 6, 7]}

FUZZ_TABLE: list[tuple[str, str, Any, int, str | None]] = [
    # (case, route, body: a JSON value, or bytes sent as they are, status, error param)
    ("malformed JSON", "chat/completions", b"{not json", 400, "body"),
    ("NaN (not JSON)", "chat/completions", b'{"model": "policy", "max_tokens": NaN}', 400, "body"),
    ("not UTF-8", "chat/completions", b"\xff\xfe{}", 400, "body"),
    ("nested 30,000 deep", "chat/completions", b"[" * 30_000 + b"]" * 30_000, 400, "body"),
    ("a number of 5,000 digits", "chat/completions", b'{"max_tokens": ' + b"9" * 5000 + b"}", 400, "body"),
    ("a list, not an object", "chat/completions", [1, 2], 400, "body"),
    ("empty body", "chat/completions", b"", 400, "body"),
    ("model missing", "chat/completions", {"messages": GOOD_CHAT["messages"]}, 400, "model"),
    ("model of the wrong type", "chat/completions", {**GOOD_CHAT, "model": 7}, 400, "model"),
    ("unknown model", "chat/completions", {**GOOD_CHAT, "model": "gpt-4o"}, 404, "model"),
    ("unknown model (completions)", "completions", {**GOOD_COMPLETION, "model": "x"}, 404,
     "model"),
    ("messages missing", "chat/completions", {"model": "policy"}, 400, "messages"),
    ("messages empty", "chat/completions", {**GOOD_CHAT, "messages": []}, 400, "messages"),
    ("messages a string", "chat/completions", {**GOOD_CHAT, "messages": "hi"}, 400, "messages"),
    ("a message a number", "chat/completions", {**GOOD_CHAT, "messages": [3]}, 400, "messages[0]"),
    ("unknown role", "chat/completions", {**GOOD_CHAT, "messages": [{"role": "robot", "content": "x"}]},
     400, "messages[0].role"),
    ("content missing", "chat/completions", {**GOOD_CHAT, "messages": [{"role": "user"}]}, 400,
     "messages[0].content"),
    ("content a number", "chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": 5}]},
     400, "messages[0].content"),
    ("an image part", "chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]"),
    ("tools not a list", "chat/completions", {**GOOD_CHAT, "tools": "calc"}, 400, "tools"),
    ("max_tokens 0", "chat/completions", {**GOOD_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "chat/completions", {**GOOD_CHAT, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens 2^63", "chat/completions", {**GOOD_CHAT, "max_tokens": 2**63}, 400, "max_tokens"),
    ("max_tokens a string", "chat/completions", {**GOOD_CHAT, "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens a float", "chat/completions", {**GOOD_CHAT, "max_tokens": 1.5}, 400, "max_tokens"),
    ("max_completion_tokens true", "chat/completions", {**GOOD_CHAT, "max_completion_tokens": True}, 400,
     "max_completion_tokens"),
    ("temperature a string", "chat/completions", {**GOOD_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("seed a float", "chat/completions", {**GOOD_CHAT, "seed": 0.5}, 400, "seed"),
    ("logprobs a string", "chat/completions", {**GOOD_CHAT, "logprobs": "yes"}, 400, "logprobs"),
    ("stream", "chat/completions", {**GOOD_CHAT, "stream": True}, 400, "stream"),
    ("n = 2", "chat/completions", {**GOOD_CHAT, "n": 2}, 400, "n"),
    ("stop strings", "chat/completions", {**GOOD_CHAT, "stop": ["\n"]}, 400, "stop"),
    ("token id out of the vocabulary", "completions", {**GOOD_COMPLETION, "prompt": [1, 10**9]},
     400, "prompt"),
    ("token id negative", "completions", {**GOOD_COMPLETION, "prompt": [1, -1]}, 400, "prompt"),
    ("token id a float", "completions", {**GOOD_COMPLETION, "prompt": [1, 2.5]}, 400, "prompt"),
    ("a batch of two prompts", "completions", {**GOOD_COMPLETION, "prompt": ["a", "b"]}, 400,
     "prompt"),
    ("prompt empty", "completions", {**GOOD_COMPLETION, "prompt": []}, 400, "prompt"),
    ("a prompt over the token budget", "completions", {**GOOD_COMPLETION, "prompt": [5] * 300},
     400, "prompt"),
]
"""The cases docs/fault_tolerance.md lists (its table is this one); the body-size, overload,
stalled and disconnecting clients are the tests below it."""

MAX_BODY_BYTES = 64 << 10


def _capture(generate_fn: Any, *, max_turns: int = 8) -> EpisodeCapture:
    return EpisodeCapture(
        generate_fn=generate_fn, tokenizer=tiny_tokenizer(), sampling=Sampling(max_tokens=8),
        base_seed=3, group_id=1, rollout_index=0, attempt=0,
        limits=EpisodeLimits(max_turns=max_turns, max_rollout_tokens=256),
        count_special=lambda ids, finish: 0)


async def _post(http: httpx.AsyncClient, url: str, body: Any, headers: dict[str, str]
                ) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    return await http.post(url, headers={**headers, "content-type": "application/json"},
                           **kwargs)


def _request_head(server: EpisodeServer, episode: str, route: str, content_length: int) -> bytes:
    return (f"POST /episodes/{episode}/v1/{route} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"authorization: Bearer {server.api_key}\r\ncontent-type: application/json\r\n"
            f"content-length: {content_length}\r\n\r\n").encode()


async def _until(condition: Any) -> None:
    """Wait for ``condition()`` (the server's own counters), polling the event loop."""
    while not condition():
        await asyncio.sleep(0.005)


def test_every_bad_request_is_a_4xx_naming_the_field_and_the_episode_goes_on_untouched() -> None:
    async def main() -> None:
        generate = ScriptedGenerate(lambda rid, _: "yes")
        server = EpisodeServer(max_body_bytes=MAX_BODY_BYTES)
        server.start()
        capture = _capture(generate)
        episode = server.open(capture)
        url, auth = server.base_url(episode), {"Authorization": f"Bearer {server.api_key}"}
        try:
            async with httpx.AsyncClient() as http:
                for case, route, body, status, param in FUZZ_TABLE:
                    r = await _post(http, f"{url}/{route}", body, auth)
                    assert r.status_code == status, (case, r.status_code, r.text[:300])
                    error = r.json()["error"]
                    assert error["param"] == param, (case, error)
                    # a malformed field leads its message; a refusal has a code of its own
                    assert error["message"].startswith(f"{param}:") or error["code"], (case, error)
                    assert r.headers["x-should-retry"] == "false"
                assert not generate.calls and not capture.turns  # nothing reached the generator
                # the one case that marks the episode: an agent's prompt over the budget (as
                # the agents guide says, its rollout ends truncated_length if it returns a reward)
                assert capture.status is not None and capture.status.value == "truncated_length"
                # not HTTP at all: uvicorn's own 400
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(b"NOT HTTP AT ALL\r\n\r\n")
                await writer.drain()
                assert (await reader.readline()).startswith(b"HTTP/1.1 400")
                writer.close()
                # the episode's first good call is its turn 0, as if nothing had come before
                r = await _post(http, f"{url}/chat/completions", GOOD_CHAT, auth)
                assert r.status_code == 200, r.text
                assert [c.request_id for c in generate.calls] == ["group=1/rollout=0/turn=0"]
                assert generate.calls[0].sampling.seed == request_seed(3, 1, 0, 0)
                # a huge max_tokens that fits is taken, clipped to the run's
                r = await _post(http, f"{url}/chat/completions",
                                {**GOOD_CHAT, "max_tokens": 2**31 - 1}, auth)
                assert r.status_code == 200 and generate.calls[1].sampling.max_tokens == 8
        finally:
            await server.aclose()

    run(main())


def _mutations(seed: int, count: int) -> list[tuple[str, dict[str, Any]]]:
    """``count`` requests, each a good body with one to three fields replaced, removed or added
    (seeded)."""
    junk = [None, True, False, 0, -1, 1.5, 2**40, 1e308, "", "x" * 1000, "\u0000", [], {},
            [None], [[1]], {"a": 1}, [{"role": "user"}], [{"role": "user", "content": None}],
            [{"role": "user", "content": "hi", "name": 5}], [{"type": "text"}], [-1], [2**40]]
    fields = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "tools",
              "logprobs", "temperature", "seed", "stream", "n", "stop", "return_token_ids",
              "tool_choice", "unknown_field"]
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        route, body = rng.choice([("chat/completions", GOOD_CHAT),
                                  ("completions", GOOD_COMPLETION)])
        body = json.loads(json.dumps(body))
        for _ in range(rng.randint(1, 3)):
            field = rng.choice(fields)
            if rng.random() < 0.2:
                body.pop(field, None)
            else:
                body[field] = rng.choice(junk)
        requests.append((route, body))
    return requests


def test_seeded_random_bodies_get_a_200_or_a_4xx_never_a_5xx_and_only_200s_are_calls() -> None:
    async def main() -> None:
        generate = ScriptedGenerate(lambda rid, _: "yes")
        server = EpisodeServer()
        capture = _capture(generate, max_turns=10_000)
        episode = server.open(capture)
        auth = {"Authorization": f"Bearer {server.api_key}"}
        transport = httpx.ASGITransport(app=server._asgi)
        statuses: dict[int, int] = {}
        async with httpx.AsyncClient(transport=transport, base_url="http://endpoint") as http:
            for route, body in _mutations(seed=0, count=400):
                r = await _post(http, f"/episodes/{episode}/v1/{route}", body, auth)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code in (200, 400, 404), (body, r.status_code, r.text[:300])
                if r.status_code != 200:
                    error = r.json()["error"]
                    assert error["param"] and (error["message"].startswith(
                        f"{error['param']}:") or error["code"]), (body, error)
        assert statuses.get(200, 0) == len(capture.turns) == len(generate.calls)
        assert statuses[400] > 200  # the mutations mostly break the request
        assert statuses.get(200, 0) > 0  # ... and some leave it good

    run(main())


def test_a_body_over_the_limit_is_a_413_declared_or_streamed() -> None:
    async def main() -> None:
        generate = ScriptedGenerate(lambda rid, _: "yes")
        server = EpisodeServer(max_body_bytes=MAX_BODY_BYTES)
        server.start()
        episode = server.open(_capture(generate))
        url, auth = server.base_url(episode), {"Authorization": f"Bearer {server.api_key}"}
        big = json.dumps({**GOOD_CHAT, "padding": "x" * MAX_BODY_BYTES}).encode()

        async def chunks() -> Any:  # no content-length: the limit holds while reading
            for start in range(0, len(big), 8192):
                yield big[start:start + 8192]

        try:
            async with httpx.AsyncClient() as http:
                for body in (big, chunks()):
                    r = await http.post(f"{url}/chat/completions", headers=auth, content=body)
                    assert r.status_code == 413, r.text
                    assert "task.max_body_bytes" in r.json()["error"]["message"]
            assert not generate.calls
        finally:
            await server.aclose()

    run(main())


def test_past_max_concurrent_requests_hundreds_are_shed_with_503_and_retry_after() -> None:
    """Four clients stall mid-body and hold the four slots; 200 concurrent requests are answered
    503 with Retry-After at once; the stalled clients disconnect, their slots free, and the
    episode serves its next call as its turn 0."""
    async def main() -> None:
        generate = ScriptedGenerate(lambda rid, _: "yes")
        server = EpisodeServer(max_concurrent_requests=4)
        server.start()
        capture = _capture(generate)
        episode = server.open(capture)
        url, auth = server.base_url(episode), {"Authorization": f"Bearer {server.api_key}"}
        stalled = []
        try:
            for _ in range(4):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(_request_head(server, episode, "chat/completions", 1000) + b'{"mo')
                await writer.drain()
                stalled.append(writer)
            await _until(lambda: server.num_tcp_in_flight == 4)
            limits = httpx.Limits(max_connections=250)
            async with httpx.AsyncClient(limits=limits, timeout=60) as http:
                answers = await asyncio.gather(*(
                    _post(http, f"{url}/chat/completions", GOOD_CHAT, auth) for _ in range(200)))
                assert [r.status_code for r in answers] == [503] * 200
                assert {r.headers["retry-after"] for r in answers} == {"1"}
                assert "x-should-retry" not in answers[0].headers  # the client may retry it
                assert "task.max_concurrent_requests" in answers[0].json()["error"]["message"]
                assert server.num_shed == 200 and not generate.calls
                for writer in stalled:  # they go away mid-request: nothing is answered or kept
                    writer.close()
                await _until(lambda: server.num_tcp_in_flight == 0)
                assert server.num_disconnected == 4
                r = await _post(http, f"{url}/chat/completions", GOOD_CHAT, auth)
                assert r.status_code == 200
                assert [t.request_id for t in capture.turns] == ["group=1/rollout=0/turn=0"]
        finally:
            await server.aclose()

    run(main())


def test_a_stalled_body_is_a_408() -> None:
    async def main() -> None:
        server = EpisodeServer(body_timeout_s=0.2)
        server.start()
        episode = server.open(_capture(ScriptedGenerate(lambda rid, _: "yes")))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(_request_head(server, episode, "chat/completions", 100) + b'{"mo')
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408")
            writer.close()
            assert server.num_tcp_in_flight == 0
        finally:
            await server.aclose()

    run(main())


class _HeldGenerate:
    """A GenerateFn that holds its first call until cancelled, then answers as ScriptedGenerate."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.scripted = ScriptedGenerate(lambda rid, _: "yes")

    async def __call__(self, request: GenerateRequest) -> Completion | None:
        if not self.entered.is_set():
            self.entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return await self.scripted(request)


def test_a_client_that_disconnects_mid_call_cancels_it_and_no_turn_is_kept() -> None:
    async def main() -> None:
        generate = _HeldGenerate()
        server = EpisodeServer()
        server.start()
        capture = _capture(generate)
        episode = server.open(capture)
        url, auth = server.base_url(episode), {"Authorization": f"Bearer {server.api_key}"}
        try:
            body = json.dumps(GOOD_CHAT).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(_request_head(server, episode, "chat/completions", len(body)) + body)
            await writer.drain()
            await generate.entered.wait()  # the call is generating
            writer.close()
            await generate.cancelled.wait()  # the generator's request is cancelled
            await _until(lambda: server.num_tcp_in_flight == 0)
            assert server.num_disconnected == 1 and not capture.turns
            async with httpx.AsyncClient() as http:
                r = await _post(http, f"{url}/chat/completions", GOOD_CHAT, auth)
            assert r.status_code == 200
            # the abandoned call's turn index stays spent: its request id is never reused
            assert [t.request_id for t in capture.turns] == ["group=1/rollout=0/turn=1"]
        finally:
            await server.aclose()

    run(main())


@pytest.mark.parametrize("kwargs, message", [
    ({"max_body_bytes": 0}, "max_body_bytes must be >= 1, got 0"),
    ({"max_concurrent_requests": 0}, "max_concurrent_requests must be >= 1, got 0"),
    ({"body_timeout_s": 0}, "body_timeout_s must be > 0, got 0"),
])
def test_endpoint_limits_are_checked(kwargs: dict[str, Any], message: str) -> None:
    from tests.controller.letter_task import LetterTask
    from torchtitan_rl.rollout.agent_task import AgentTask

    with pytest.raises(ValueError, match=message):
        AgentTask.Config(agent="tests.rollout.agent_testlib:three_turns",
                         episodes=LetterTask.Config(), **kwargs)
