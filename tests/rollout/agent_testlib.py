"""Agent programs for the agent-task tests: each talks to its episode URL with the real `openai`
client the run gives it, as a user's agent would; most close it (``async with client``), which
must leave the run's connection pool to the group's other episodes. A test names one as
``tests.rollout.agent_testlib:<name>``; the episode spec is LetterTask's prompt string."""

from __future__ import annotations

import asyncio
import json

import openai
from openai import AsyncOpenAI


async def three_turns(episode: str, client: AsyncOpenAI) -> tuple[float, list[float]]:
    """Three chat calls, each extending the history with the model's reply and a user message;
    reward: replies containing "yes" (per call: 1 or 0)."""
    messages = [{"role": "user", "content": episode}]
    scores = []
    async with client:
        for turn in range(3):
            response = await client.chat.completions.create(model="policy", messages=messages,
                                                            max_tokens=6)
            reply = response.choices[0].message.content or ""
            scores.append(float("yes" in reply))
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"again {turn}"}]
    return sum(scores), scores


async def rewrites(episode: str, client: AsyncOpenAI) -> float:
    """Two calls; the second drops the first exchange (a rewritten history: a new branch)."""
    async with client:
        first = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": episode}])
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "start over"}])
    return float("yes" in (first.choices[0].message.content or ""))


async def completes(episode: str, client: AsyncOpenAI) -> float:
    """One /v1/completions call with token ids, one with a string."""
    async with client:
        by_ids = await client.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=4)
        by_text = await client.completions.create(model="policy", prompt=episode)
    return float("yes" in by_ids.choices[0].text) + float("yes" in by_text.choices[0].text)


async def raises_on_no(episode: str, client: AsyncOpenAI) -> float:
    """Raises when the model's reply holds no "yes"."""
    async with client:
        response = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": episode}])
    if "yes" not in (response.choices[0].message.content or ""):
        raise RuntimeError("agent broke")
    return 1.0


async def until_refused(episode: str, client: AsyncOpenAI) -> float:
    """Calls until the endpoint refuses (turn cap): returns the number of answered calls."""
    answered = 0
    async with client:
        while True:
            try:
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": f"{episode} {answered}"}])
            except openai.ConflictError:
                return float(answered)
            answered += 1


async def hangs(episode: str, client: AsyncOpenAI) -> float:
    """Never returns: only the task's timeout ends it."""
    await asyncio.Event().wait()
    return 0.0


async def returns_text(episode: str, client: AsyncOpenAI) -> str:
    """Returns no reward."""
    return "done"


def not_async(episode: str, client: AsyncOpenAI) -> float:
    return 0.0


async def old_signature(episode: str, base_url: str, api_key: str) -> float:
    """The first slice's (episode, base_url, api_key): refused at load, naming the signature."""
    return 0.0


ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}
TOOL_REPLIES: list[dict] = []
"""What the tool agents were sent on their first call: the assistant message and finish_reason."""


async def uses_a_tool(episode: str, client: AsyncOpenAI) -> float:
    """Offers the `add` tool, runs the call the model makes, sends the result back (a `tool`
    message) with the model's message as the client returned it; reward: 1 when the model then
    answers without a tool call."""
    messages = [{"role": "user", "content": episode}]
    first = await client.chat.completions.create(model="policy", messages=messages,
                                                 tools=[ADD_TOOL])
    message = first.choices[0].message
    TOOL_REPLIES.append({"message": message.model_dump(exclude_none=True),
                         "finish_reason": first.choices[0].finish_reason})
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": str(args["a"] + args["b"])})
    second = await client.chat.completions.create(model="policy", messages=messages,
                                                  tools=[ADD_TOOL])
    return float(not second.choices[0].message.tool_calls)


SDK_RESULTS: list[dict] = []
"""What each `openai_agents_sdk` run ended with: its final output and the tool results it made."""


async def openai_agents_sdk(episode: str, client: AsyncOpenAI) -> float:
    """An agent written with the OpenAI Agents SDK (`openai-agents`), unchanged but for its model:
    the SDK's own loop (`Runner.run`) calls the episode endpoint through the run's client, runs the
    `add` function tool the model calls, sends its result back and stops at the model's final
    answer. Reward: 1 when the final answer holds the tool's result."""
    from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

    added: list[int] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Adds two integers."""
        added.append(a + b)
        return a + b

    agent = Agent(name="adder", instructions="Use the add tool.", tools=[add],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    result = await Runner.run(agent, episode, max_turns=4,
                              run_config=RunConfig(tracing_disabled=True))
    SDK_RESULTS.append({"final_output": result.final_output, "added": added})
    return float(str(sum(added)) in str(result.final_output)) if added else 0.0
