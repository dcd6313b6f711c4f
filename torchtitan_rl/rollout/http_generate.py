"""HttpGenerateFn: a GenerateFn over any OpenAI-compatible completions server that speaks token ids
(vLLM's ``vllm serve`` / ``python -m vllm.entrypoints.openai.api_server``), so rollouts can run
against a server outside the Monarch mesh.

    Rollouter --GenerateRequest(prompt ids, request/session id, Sampling)--> HttpGenerateFn
        POST {base_url}/v1/completions   headers X-Request-Id, X-Session-ID
            {prompt: [ids], max_tokens, temperature, top_p, top_k, seed, stop_token_ids,
             logprobs: 0, return_token_ids, return_tokens_as_token_ids, skip_special_tokens: false,
             neutral penalties}
        <-- 200 {choices: [{token_ids, logprobs: {token_logprobs}, finish_reason}]}
    HttpGenerateFn --Completion(token ids, sampled-token logprobs, constant policy version)-->
        Rollouter

    connection refused / timeout / HTTP error status / malformed reply
        -> counted (metrics()["http_generate/errors/<kind>"]), logged at WARNING with the
           request id, retried when it may pass (connection, 429, 5xx), else the call returns None
           (the Rollouter ends that rollout ERROR_ABORT; its siblings carry on)

Every attempt is bounded by ``timeout_s`` (waiting for a pooled connection, connecting, sending and
reading the reply), so a call returns within (max_retries + 1) x timeout_s + the backoffs.
aiohttp is imported lazily: importing the rollout package stays light.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.types import (
    Completion,
    CompletionMetrics,
    FinishReason,
    GenerateRequest,
    Sampling,
)

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

ERROR_KINDS = ("connection", "timeout", "http_status", "malformed")
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class MalformedReply(ValueError):
    """The server answered 200 with something that is not a usable completion."""


class _AttemptError(Exception):
    """One failed attempt: its kind (one of ERROR_KINDS), whether retrying may help, a message."""

    def __init__(self, kind: str, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable


def completions_url(base_url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` (the OpenAI client's
    convention) all mean ``http://host:8000/v1/completions``."""
    url = base_url.rstrip("/")
    if not url.endswith("/v1"):
        url += "/v1"
    return url + "/completions"


def request_body(request: GenerateRequest, sampling: Sampling, model: str | None) -> dict[str, Any]:
    """The JSON body of one completions request: token ids in, token ids and logprobs out."""
    body: dict[str, Any] = {
        "prompt": list(request.prompt_token_ids),
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # vLLM extension; -1 and 0 both disable it there
        "stop_token_ids": list(sampling.stop_token_ids),
        # Explicit neutral values: vLLM fills omitted ones from the model's generation_config.json
        # (e.g. a repetition_penalty), which would sample from another distribution than the one
        # the trainer assumes; our in-process engine never applies those defaults.
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "n": 1,
        "stream": False,
        # logprobs=0: the sampled token's logprob only (its top_logprobs entry is that token).
        "logprobs": 0,
        "return_token_ids": True,  # vLLM extension: choices[0].token_ids and prompt_token_ids
        # Token strings as "token_id:N": bytes that are not valid UTF-8 cannot break the JSON.
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if model is not None:
        body["model"] = model
    return body


def parse_completion(reply: Any, request: GenerateRequest, policy_version: int) -> Completion:
    """A completions reply (parsed JSON) as a Completion; raises MalformedReply if it is not one."""
    try:
        choices = reply["choices"]
        if not isinstance(choices, list) or len(choices) != 1:
            raise MalformedReply(f"expected 1 choice, got {choices!r:.200}")
        choice = choices[0]
        token_ids = choice["token_ids"]
        logprobs = choice["logprobs"]["token_logprobs"]
        reason = choice["finish_reason"]
    except (KeyError, TypeError, IndexError) as e:
        raise MalformedReply(f"missing field {e!r} (was the server started without vLLM's "
                             f"return_token_ids support?)") from None
    if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
        raise MalformedReply(f"token_ids is not a list of ints: {token_ids!r:.200}")
    if not isinstance(logprobs, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in logprobs
    ):
        raise MalformedReply(f"token_logprobs is not a list of numbers: {logprobs!r:.200}")
    if len(logprobs) != len(token_ids):
        raise MalformedReply(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
    if reason not in _FINISH_REASONS:
        raise MalformedReply(f"unknown finish_reason {reason!r}")
    # The server echoes the prompt it ran: a different one would mean training on tokens that were
    # never generated from this prompt.
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and echoed != list(request.prompt_token_ids):
        raise MalformedReply(f"server ran a different prompt ({len(echoed)} tokens, "
                             f"sent {len(request.prompt_token_ids)})")
    values = [float(x) for x in logprobs]
    if any(math.isnan(x) or x > 1e-4 for x in values):
        raise MalformedReply("a logprob is NaN or positive")
    return Completion(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        token_ids=token_ids,
        token_logprobs=values,
        token_policy_versions=[policy_version] * len(token_ids),
        finish_reason=_FINISH_REASONS[reason],
    )


class HttpGenerateFn(Configurable):
    """GenerateFn (``await fn(request) -> Completion | None``) over an OpenAI-compatible server.

    Built with ``HttpGenerateFn.Config(base_url=...).build()``; call ``await fn.close()`` (or use
    ``async with``) when done. One instance may serve several event loops one after another (a
    connection pool per loop); ``metrics()`` counts since construction.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        base_url: str = "http://127.0.0.1:8000"
        """The server's root (``/v1`` may be included): requests go to
        ``{base_url}/v1/completions``."""
        model: str | None = None
        """The served model name (``--served-model-name``); None omits it (vLLM then uses the one
        model it serves)."""
        timeout_s: float = 300.0
        """Wall-clock limit of one attempt, in seconds: pool wait, connect, generation, reading."""
        max_retries: int = 2
        """Extra attempts after a connection error or a 429/5xx status. Timeouts, 4xx statuses and
        malformed replies are not retried (the same request would fail alike or add load)."""
        retry_backoff_s: float = 0.5
        """Wait before retry k (k = 0, 1, ...) is retry_backoff_s * 2**k."""
        policy_version: int = 0
        """Policy version stamped on every token: the server's weights do not change under us."""
        sampling: Sampling = dataclasses.field(default_factory=Sampling)
        """Sampling for requests that carry none."""
        max_connections: int = 256
        """Concurrent connections per event loop; more requests wait for one (within timeout_s)."""
        api_key_env: str | None = None
        """Name of an environment variable holding a bearer token (kept out of config files)."""

        def __post_init__(self) -> None:
            if not self.base_url.startswith(("http://", "https://")):
                raise ValueError(
                    f"base_url must start with http:// or https://, got {self.base_url!r}")
            if not self.timeout_s > 0:
                raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
            if self.max_retries < 0:
                raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
            if self.retry_backoff_s < 0:
                raise ValueError(f"retry_backoff_s must be >= 0, got {self.retry_backoff_s}")
            if self.max_connections < 1:
                raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")

    def __init__(self, config: Config) -> None:
        self.config = config
        self.url = completions_url(config.base_url)
        self._headers = {"Content-Type": "application/json"}
        if config.api_key_env is not None:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ValueError(
                    f"api_key_env {config.api_key_env!r} is not set in the environment")
            self._headers["Authorization"] = f"Bearer {key}"
        self.num_errors: dict[str, int] = dict.fromkeys(ERROR_KINDS, 0)
        self.num_requests = 0
        self.num_completions = 0
        self.num_dropped = 0
        self.num_retries = 0
        self.num_output_tokens = 0
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def metrics(self) -> dict[str, float]:
        """Counters since construction, named for the metrics logger."""
        out = {f"http_generate/errors/{kind}": float(n) for kind, n in self.num_errors.items()}
        out.update({
            "http_generate/requests": float(self.num_requests),
            "http_generate/completions": float(self.num_completions),
            "http_generate/dropped": float(self.num_dropped),
            "http_generate/retries": float(self.num_retries),
            "http_generate/output_tokens": float(self.num_output_tokens),
        })
        return out

    async def __call__(self, request: GenerateRequest) -> Completion | None:
        sampling = request.sampling if request.sampling is not None else self.config.sampling
        body = request_body(request, sampling, self.config.model)
        headers = dict(self._headers, **{"X-Request-Id": request.request_id})
        if request.session_id is not None:
            # Lets a router in front of several servers pin a session to one (prefix cache reuse).
            headers["X-Session-ID"] = request.session_id
        self.num_requests += 1
        start = time.perf_counter()
        attempts = self.config.max_retries + 1
        for attempt in range(attempts):
            try:
                reply = await self._post(body, headers)
                completion = parse_completion(reply, request, self.config.policy_version)
            except MalformedReply as e:
                error = _AttemptError("malformed", str(e), retryable=False)
            except _AttemptError as e:
                error = e
            else:
                n = len(completion.token_ids)
                completion.metrics = CompletionMetrics(
                    # Client-side wall time: the server's own queue and first-token times are
                    # not in its reply unless it runs with per-request metrics.
                    generation_time_s=time.perf_counter() - start, num_output_tokens=n)
                self.num_completions += 1
                self.num_output_tokens += n
                return completion
            self.num_errors[error.kind] += 1
            retry = error.retryable and attempt + 1 < attempts
            logger.warning("%s: %s error from %s (attempt %d/%d%s): %s", request.request_id,
                           error.kind, self.url, attempt + 1, attempts,
                           ", retrying" if retry else ", dropped", error)
            if not retry:
                break
            self.num_retries += 1
            await asyncio.sleep(self.config.retry_backoff_s * 2**attempt)
        self.num_dropped += 1
        return None

    async def _post(self, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """One attempt: the parsed JSON reply, or _AttemptError / MalformedReply."""
        import aiohttp

        try:
            # asyncio.timeout bounds the whole attempt, pool wait and body read included.
            async with asyncio.timeout(self.config.timeout_s):
                session = self._get_session()
                async with session.post(self.url, json=body, headers=headers) as response:
                    text = await response.text(errors="replace")
                    status = response.status
        except TimeoutError:  # aiohttp's own timeout errors subclass it too
            raise _AttemptError("timeout", f"no complete reply within {self.config.timeout_s} s",
                                retryable=False) from None
        except aiohttp.ClientError as e:
            # Refused, reset, DNS, the server closing mid-reply (ServerDisconnected, payload).
            raise _AttemptError("connection", f"{type(e).__name__}: {e}", retryable=True) from None
        if status != 200:
            raise _AttemptError("http_status", f"HTTP {status}: {text[:300]}",
                                retryable=status == 429 or status >= 500)
        try:
            return json.loads(text)
        except ValueError as e:
            raise MalformedReply(f"reply is not JSON ({e}): {text[:200]!r}") from None

    def _get_session(self) -> aiohttp.ClientSession:
        """The pooled session of the running event loop (a session is bound to one loop)."""
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # A session of an earlier, finished loop cannot be closed from this one; drop it.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.max_connections),
                # asyncio.timeout in _post bounds each attempt; no second, different limit here.
                timeout=aiohttp.ClientTimeout(total=None),
            )
            self._session_loop = loop
        return self._session

    async def close(self) -> None:
        """Close the connection pool of the running loop (safe to call twice)."""
        session, self._session, self._session_loop = self._session, None, None
        if session is not None and not session.closed:
            await session.close()

    async def __aenter__(self) -> HttpGenerateFn:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
