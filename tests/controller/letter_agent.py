"""LetterTask played by an agent program with the real `openai` client (a test fixture for
tests/controller/test_controller_agent_job.py, named ``tests.controller.letter_agent:run``).

Two chat calls per episode (the second extends the first with the reply and a user message);
reward: the share of the replies' letters in a..m. Each call asks for vLLM's ``return_token_ids``
and keeps what the endpoint returned in ``CALLS`` (the job runs its rollouts in the test's
process), so the test can compare the trained tokens with the generator's. Before its first call
the agent of rollout 0 checks that an unknown episode is a 404 and a malformed request a 400;
the agent of rollout 3 raises after its calls (its rollout must end errored, untrained); the
agent of rollout 1 offers a tool and sends a tool result as its second call's new message.

With ``SEND_JUNK`` set (the agent job's fixture sets it in the test process; rollout workers,
other processes, leave it off), the first training agent of rollout 0 sends its live episode URL
the junk of JUNK_CASES over TCP before its first call, plus 200 concurrent bad requests, a body
over the size limit, bytes that are not HTTP and a client that disconnects mid-body (all to
127.0.0.1, each with a timeout), and keeps each answer's status in ``JUNK``: the run must train
as if none of it had come.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import openai

from tests.controller.multi_turn_letter_task import letter_share
from torchtitan_rl.controller.loop.validation import VALIDATION_GROUP_OFFSET

CALLS: dict[tuple[int, int], list[dict]] = {}
"""(group id, rollout index) -> each call's {"prompt_token_ids", "token_ids", "text"}."""
CHECKS: list[tuple[str, str]] = []
TOOL_CALLS: list[tuple[int, str]] = []
"""(group, finish_reason) of each first call of rollout 1, which offers COUNT_TOOL and answers
its second call with a `tool` message (environment tokens)."""
COUNT_TOOL = {"type": "function", "function": {
    "name": "count", "description": "Counts the words of a text.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}
"""The error answers each agent of rollout 0 saw: (unknown episode, malformed request)."""
SEND_JUNK = False
JUNK: list[tuple[str, int]] = []
"""(case, HTTP status) of every junk request sent (SEND_JUNK)."""
_GOOD = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
JUNK_CASES: list[tuple[str, str, Any]] = [
    ("malformed JSON", "chat/completions", b"{not json"),
    ("wrong type", "chat/completions", {**_GOOD, "messages": "hi"}),
    ("missing field", "chat/completions", {"messages": _GOOD["messages"]}),
    ("unknown model", "chat/completions", {**_GOOD, "model": "gpt-4o"}),
    ("negative max_tokens", "chat/completions", {**_GOOD, "max_tokens": -1}),
    ("huge max_tokens", "chat/completions", {**_GOOD, "max_tokens": 2**63}),
    ("token id out of the vocabulary", "completions", {"model": "policy", "prompt": [1, 10**9]}),
]


async def run(episode: str, client: openai.AsyncOpenAI) -> float:
    base_url = str(client.base_url)
    group, rollout = map(int, re.search(r"/episodes/g(\d+)-r(\d+)-", base_url).groups())
    calls = CALLS.setdefault((group, rollout), [])
    messages = [{"role": "user", "content": episode}]
    if rollout == 0:
        await _check_errors(client, base_url)
        if SEND_JUNK and not JUNK and group < VALIDATION_GROUP_OFFSET:  # while it trains
            JUNK.append(("started", 0))  # one agent sends it (no await before this line)
            await _send_junk(base_url, client.api_key)
    tools = {"tools": [COUNT_TOOL]} if rollout == 1 else {}
    for _ in range(2):
        response = await client.chat.completions.create(
            model="policy", messages=messages, extra_body={"return_token_ids": True}, **tools)
        choice = response.choices[0]
        calls.append({"prompt_token_ids": response.prompt_token_ids,
                      "token_ids": choice.token_ids, "text": choice.message.content or ""})
        if choice.finish_reason == "length":
            break
        if tools:  # the model's message as returned, then a tool's result
            messages += [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": "call-0", "content": "count: 3"}]
            TOOL_CALLS.append((group, choice.finish_reason))
        else:
            messages += [{"role": "assistant", "content": choice.message.content},
                         {"role": "user", "content": "Turn 2: more words:"}]
    if rollout == 3:
        raise RuntimeError("agent of rollout 3 fails on purpose")
    return letter_share("".join(call["text"] for call in calls))


async def _check_errors(client: openai.AsyncOpenAI, base_url: str) -> None:
    seen = ["no error", "no error"]
    unknown = base_url.replace("/episodes/g", "/episodes/unknown-g")
    try:
        # A client of its own, as an agent library given the URL and key would make.
        async with openai.AsyncOpenAI(base_url=unknown, api_key=client.api_key) as other:
            await other.chat.completions.create(model="policy",
                                                messages=[{"role": "user", "content": "x"}])
    except openai.NotFoundError as e:
        seen[0] = f"404 {e.message}"
    try:
        await client.chat.completions.create(model="policy", messages=[{"role": "robot"}])
    except openai.BadRequestError as e:
        seen[1] = f"400 {e.body['param']} {e.message}"
    CHECKS.append((seen[0], seen[1]))


async def _send_junk(base_url: str, api_key: str) -> None:
    base_url = base_url.rstrip("/")
    auth = {"Authorization": f"Bearer {api_key}", "content-type": "application/json"}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200), timeout=60) as http:
        for case, route, body in JUNK_CASES:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await http.post(f"{base_url}/{route}", headers=auth, content=content)
            JUNK.append((case, r.status_code))
        burst = await asyncio.gather(*(
            http.post(f"{base_url}/chat/completions", headers=auth,
                      content=json.dumps({**_GOOD, "model": f"junk-{i}"}).encode())
            for i in range(200)))
        JUNK.extend(("200 concurrent: unknown model", r.status_code) for r in burst)
    host, port = re.match(r"http://([\d.]+):(\d+)/", base_url).groups()
    path = base_url.split(port, 1)[1]
    for case, request in [
        ("body over the size limit", (f"POST {path}/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                      f"authorization: Bearer {api_key}\r\n"
                                      f"content-length: {1 << 40}\r\n\r\n{{").encode()),
        ("not HTTP", b"NOT HTTP\r\n\r\n"),
        ("disconnects mid-body", (f"POST {path}/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                  f"authorization: Bearer {api_key}\r\n"
                                  f"content-length: 1000\r\n\r\n{{\"mo").encode()),
    ]:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        await writer.drain()
        if case == "disconnects mid-body":
            JUNK.append((case, 0))  # no answer: the client is gone
        else:
            line = await asyncio.wait_for(reader.readline(), 60)
            JUNK.append((case, int(line.split()[1])))
        writer.close()
        await writer.wait_closed()
