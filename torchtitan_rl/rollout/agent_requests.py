"""OpenAI-format requests in, responses out: validation of what an agent sends to the episode
endpoint (a 400 naming the field on bad input) and the response bodies it gets back.

    JSON body --parse_chat_request / parse_completion_request--> ChatRequest / CompletionRequest
    Completion + reply text --chat_response / completion_response--> JSON body

Sampling settings an agent sends (temperature, top_p, seed, ...) are not applied: every call
samples with the run's own settings, as the Rollouter's requests do, so the logprobs the trainer
gets describe the distribution the policy is trained on.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

from torchtitan_rl.types import Completion

logger = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields that change what is generated in ways the run's sampling cannot honour: refused, never
# silently dropped.
_REFUSED_IF_SET = {
    "stop": "stop strings are not supported; the run's sampling decides where replies end",
    "n": "one choice per request (n = 1)",
    "stream": "streaming is not supported; send stream = false",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "best_of": "best_of is not supported",
    "response_format": "response_format is not supported",
}
_NEUTRAL = {"n": 1, "stream": False, "echo": False, "best_of": 1}
# Sampling settings the run does not apply, but whose type is still checked: a request that
# sends a string for a number is malformed, as vLLM's server says too.
_NUMBERS_IF_SET = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
MAX_TOKENS_LIMIT = 2**31 - 1
"""The largest ``max_tokens`` taken (then clipped to the run's); beyond it, a 400."""


class RequestError(ValueError):
    """A malformed request: answered 400, naming ``param``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclasses.dataclass(kw_only=True, slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    """Normalised: text content as one string, keys whose value is None dropped."""
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    logprobs: bool = False
    return_token_ids: bool = False
    """vLLM's extension: the response carries ``prompt_token_ids`` and the choice's
    ``token_ids`` (what the generator got and produced)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    max_tokens: int | None = None
    logprobs: bool = False
    return_token_ids: bool = False
    """As ChatRequest.return_token_ids."""


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("body", f"a JSON object expected, got {type(body).__name__}")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model", f"a model name (string) is required, got {model!r:.80}")
    return model


def _common(body: dict[str, Any]) -> None:
    for name, why in _REFUSED_IF_SET.items():
        value = body.get(name)
        if value is not None and value != _NEUTRAL.get(name):
            raise RequestError(name, f"{why} (got {value!r:.80})")
    for name in _NUMBERS_IF_SET:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise RequestError(name, f"a number expected, got {value!r:.80}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError("seed", f"an integer expected, got {seed!r:.80}")


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(name, f"true or false expected, got {value!r:.80}")
    return bool(value)


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not (
                1 <= value <= MAX_TOKENS_LIMIT):
            raise RequestError(name, f"an integer in [1, {MAX_TOKENS_LIMIT}] expected, got "
                                     f"{value!r:.80}")
        return value
    return None


def _text_content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise RequestError(f"{where}[{j}]", "only text parts ({'type': 'text', "
                                                    "'text': ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(where, f"a string or a list of text parts expected, got "
                              f"{type(content).__name__}")


def _message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(where, f"an object expected, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role", f"one of {list(ROLES)} expected, got {role!r:.80}")
    out = {k: v for k, v in message.items() if v is not None}
    content = _text_content(message.get("content"), f"{where}.content")
    if content is None and not (role == "assistant" and message.get("tool_calls")):
        raise RequestError(f"{where}.content", "required (a string)")
    # An assistant message that only calls tools renders with empty content, as vLLM's server
    # does: templates read message.content unguarded (the OpenAI Agents SDK sends none).
    out["content"] = "" if content is None else content
    return out


def parse_chat_request(body: Any) -> ChatRequest:
    body = _require_object(body)
    model = _model(body)
    _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", f"a non-empty list of messages expected, got "
                                       f"{messages!r:.80}")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) for t in tools)):
        raise RequestError("tools", "a list of tool objects expected")
    return ChatRequest(model=model, messages=[_message(m, i) for i, m in enumerate(messages)],
                       tools=tools or None, max_tokens=_max_tokens(body),
                       logprobs=_flag(body, "logprobs"),
                       return_token_ids=_flag(body, "return_token_ids"))


def parse_completion_request(body: Any) -> CompletionRequest:
    body = _require_object(body)
    model = _model(body)
    _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ok_ids = isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise RequestError("prompt", "one prompt expected: a non-empty string or a list of "
                                     f"token ids, got {prompt!r:.80}")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or logprobs < 0):
        raise RequestError("logprobs", f"an integer >= 0 expected, got {logprobs!r:.80}")
    return CompletionRequest(model=model, prompt=prompt, max_tokens=_max_tokens(body),
                             logprobs=logprobs is not None,
                             return_token_ids=_flag(body, "return_token_ids"))


def _usage(completion: Completion) -> dict[str, int]:
    prompt, generated = len(completion.prompt_token_ids), len(completion.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": generated,
            "total_tokens": prompt + generated}


def _finite(logprob: float) -> float:
    # JSON has no NaN; the trainer gets the generator's value as is, the agent a floor.
    return logprob if math.isfinite(logprob) else -9999.0


def _with_token_ids(body: dict[str, Any], completion: Completion, wanted: bool
                    ) -> dict[str, Any]:
    if wanted:
        body["prompt_token_ids"] = list(completion.prompt_token_ids)
        body["choices"][0]["token_ids"] = list(completion.token_ids)
    return body


def chat_response(request: ChatRequest, completion: Completion, message: dict[str, Any],
                  tokenizer: Any) -> dict[str, Any]:
    """``message``: the assistant message (EpisodeCapture.chat); a reply that calls tools ends
    with finish_reason "tool_calls", as OpenAI's (unless it was cut off: "length")."""
    logprobs = None
    if request.logprobs:
        logprobs = {"content": [
            {"token": tokenizer.decode([t]), "logprob": _finite(lp), "bytes": None,
             "top_logprobs": []}
            for t, lp in zip(completion.token_ids, completion.token_logprobs)]}
    finish_reason = completion.finish_reason
    if message.get("tool_calls") and finish_reason == "stop":
        finish_reason = "tool_calls"
    return _with_token_ids({
        "id": f"chatcmpl-{completion.request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                     "logprobs": logprobs}],
        "usage": _usage(completion),
    }, completion, request.return_token_ids)


def completion_response(request: CompletionRequest, completion: Completion, text: str,
                        tokenizer: Any) -> dict[str, Any]:
    logprobs = None
    if request.logprobs:
        logprobs = {"tokens": [tokenizer.decode([t]) for t in completion.token_ids],
                    "token_logprobs": [_finite(lp) for lp in completion.token_logprobs],
                    "top_logprobs": None, "text_offset": None}
    return _with_token_ids({
        "id": f"cmpl-{completion.request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [{"index": 0, "text": text, "finish_reason": completion.finish_reason,
                     "logprobs": logprobs}],
        "usage": _usage(completion),
    }, completion, request.return_token_ids)


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: the ``openai`` client raises it with this message."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
