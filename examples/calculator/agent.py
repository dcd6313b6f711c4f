"""A calculator-tool agent for reasoning-gym's chain_sum questions, played over the run's endpoint.

    run(episode, client):                         (task.agent)
        call 1: the question, tools=[calculate]   -> the model's reply, its tool calls parsed
        each tool call: calculate(expression)     -> a `tool` message with the result (or the error)
        call 2: the conversation so far           -> the model's answer
        reward: reasoning-gym's score_answer(answer, entry), unchanged
    demonstration(episode):                       (task.demonstration: the warm start's data)
        the same conversation with the right call and answer, and the tools it offers
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

from openai import AsyncOpenAI

TOOLS = [{"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression of integers with + and -.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]

_EXPRESSION = re.compile(r"problem:\s*(.+?)\s*=\s*$")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub}


def calculate(expression: str) -> str:
    """The value of ``expression`` (integers, + and -, parentheses), or ``error: ...``."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an expression of integers, + and -: {expression!r}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as e:
        return f"error: {e}"


def _entry(episode: Any) -> dict[str, Any]:
    return episode.entries[0]


async def run(episode: Any, client: AsyncOpenAI) -> float:
    from reasoning_gym import get_score_answer_fn

    entry = _entry(episode)
    messages: list[dict[str, Any]] = [{"role": "user", "content": entry["question"]}]
    response = await client.chat.completions.create(model="policy", messages=messages,
                                                    tools=TOOLS)
    message = response.choices[0].message
    if message.tool_calls and response.choices[0].finish_reason != "length":
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
                result = (calculate(str(arguments.get("expression", "")))
                          if call.function.name == "calculate" and isinstance(arguments, dict)
                          else f"error: no tool {call.function.name!r}")
            except json.JSONDecodeError as e:
                result = f"error: arguments are not JSON: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        response = await client.chat.completions.create(model="policy", messages=messages,
                                                        tools=TOOLS)
        message = response.choices[0].message
    score = get_score_answer_fn(entry["metadata"]["source_dataset"])
    return float(score(message.content, entry))


def demonstration(episode: Any) -> dict[str, Any]:
    """The conversation ``run`` has when the model calls the tool on the question's expression
    and answers with its result."""
    entry = _entry(episode)
    expression = _EXPRESSION.search(entry["question"]).group(1)
    call = {"type": "function", "function": {"name": "calculate",
                                             "arguments": {"expression": expression}}}
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": entry["question"]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": calculate(expression)},
        {"role": "assistant", "content": str(entry["answer"])},
    ]}
