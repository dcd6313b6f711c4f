"""Tool calls of an agent episode: the model's reply parsed into OpenAI ``tool_calls`` with vLLM's
tool parser for the model's template, and the agent's echo of that reply recognised.

    reply text (decoded from the generated tokens) --ToolCalls.parse--> assistant message
        {"role": "assistant", "content": text before the calls or None,
         "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": JSON str}}]}
    next call's messages[n] --same_reply(sent message)--> True: the call extends the previous one

The parser only shapes what the agent reads. What is trained is the generated tokens themselves:
the capture renders the previous reply as its raw text (``<tool_call>...`` as generated) when it
continues the conversation, so the tool call is never re-rendered from the parsed JSON.
"""

from __future__ import annotations

import logging
from typing import Any

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.rollout.agent_requests import RequestError

logger = logging.getLogger(__name__)


def load_tool_parser(name: str) -> type:
    """vLLM's tool parser class registered as ``name`` (ConfigError naming task.tool_parser)."""
    from vllm.tool_parsers import ToolParserManager  # imports vLLM: only when tools are parsed

    try:
        parser = ToolParserManager.get_tool_parser(name)
    except KeyError as e:
        raise ConfigError(f"task.tool_parser = {name!r}: not one of vLLM's tool parsers "
                          f"{sorted(ToolParserManager.list_registered())}") from e
    # A parser logs a reply it cannot read as an ERROR with its traceback; here such a reply is
    # the policy's own output (early in training, most of them) and goes back to the agent as
    # text, so the parser's log is kept out of the console (ToolCalls.parse logs it at debug).
    logging.getLogger(parser.__module__).setLevel(logging.CRITICAL)
    return parser


class ToolCalls:
    """Parses replies with one vLLM tool parser (a new parser object per reply: a parser keeps
    streaming state, and building one is cheap)."""

    def __init__(self, parser_class: type, tokenizer: Any) -> None:
        self._parser_class = parser_class
        self._tokenizer = tokenizer

    @staticmethod
    def validate(tools: list[dict[str, Any]]) -> list[Any]:
        """vLLM's tool objects for ``tools``; RequestError naming ``tools[i]`` for one that is not
        an OpenAI function tool (checked before generating: a bad request costs no call)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

        params = []
        for i, tool in enumerate(tools):
            try:
                params.append(ChatCompletionToolsParam.model_validate(tool))
            except ValueError as e:
                raise RequestError(f"tools[{i}]", f"not an OpenAI function tool: {e}") from e
        return params

    def parse(self, text: str, params: list[Any]) -> dict[str, Any]:
        """The assistant message for reply ``text`` to a request that offered the tools
        ``params`` (from ``validate``)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        # Some parsers read the offered tools from the request (names, argument schemas).
        request = ChatCompletionRequest.model_construct(messages=[], tools=params,
                                                        tool_choice="auto")
        info = self._parser_class(self._tokenizer, params).extract_tool_calls(text, request)
        if not info.tools_called:
            if "<tool_call>" in text:
                logger.debug("reply has a tool call the parser cannot read: %.200r", text)
            return {"role": "assistant", "content": text}
        calls = [{"id": call.id, "type": "function",
                  "function": {"name": call.function.name, "arguments": call.function.arguments}}
                 for call in info.tool_calls]
        logger.debug("reply parsed into %d tool call(s)", len(calls))
        return {"role": "assistant", "content": info.content or None, "tool_calls": calls}


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any, Any]]:
    out = []
    for call in message.get("tool_calls") or []:
        call = call if isinstance(call, dict) else {}
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        out.append((call.get("id"), function.get("name"), function.get("arguments")))
    return out


def same_reply(sent: dict[str, Any], got: Any) -> bool:
    """True when ``got`` (a message of the agent's next call) repeats the assistant message the
    agent was sent: same text (None and "" alike) and the same tool calls (id, name, arguments);
    other keys a client adds (``refusal``, ``annotations``) do not matter."""
    if not isinstance(got, dict) or got.get("role") != "assistant":
        return False
    return (got.get("content") or "") == (sent.get("content") or "") and _calls(got) == _calls(
        sent)
