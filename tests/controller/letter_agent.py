"""LetterTask played by an agent program with the real `openai` client (a test fixture for
tests/controller/test_controller_agent_job.py, named ``tests.controller.letter_agent:run``).

Two chat calls per episode (the second extends the first with the reply and a user message);
reward: the share of the replies' letters in a..m. Each call asks for vLLM's ``return_token_ids``
and keeps what the endpoint returned in ``CALLS`` (the job runs its rollouts in the test's
process), so the test can compare the trained tokens with the generator's. Before its first call
the agent of rollout 0 checks that an unknown episode is a 404 and a malformed request a 400;
the agent of rollout 3 raises after its calls (its rollout must end errored, untrained); the
agent of rollout 1 offers a tool and sends a tool result as its second call's new message.
"""

from __future__ import annotations

import re

import openai

from tests.controller.multi_turn_letter_task import letter_share

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


async def run(episode: str, client: openai.AsyncOpenAI) -> float:
    base_url = str(client.base_url)
    group, rollout = map(int, re.search(r"/episodes/g(\d+)-r(\d+)-", base_url).groups())
    calls = CALLS.setdefault((group, rollout), [])
    messages = [{"role": "user", "content": episode}]
    if rollout == 0:
        await _check_errors(client, base_url)
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
