"""EpisodeServer: the run's OpenAI-compatible endpoint, one URL per agent episode.

    AgentEnv --open(capture)--> EpisodeServer -> episode id -> base_url
             = http://127.0.0.1:PORT/episodes/<id>/v1            (what the agent's client gets)
    agent --POST <base_url>/chat/completions (Authorization: Bearer <run's key)--> EpisodeServer
    EpisodeServer: auth -> episode by id (404 unknown, 409 ended) -> parse (400 naming the field)
                   -> EpisodeCapture.chat/complete (generates through the run's GenerateFn)
                   -> OpenAI-format JSON
    AgentEnv --close(id)--> EpisodeServer (later calls: 409; calls in flight cancelled)

uvicorn serves the FastAPI app as a task of the event loop that runs the rollouts (the
controller's), so a request calls the run's GenerateFn where it lives, with no thread hop. The
socket is bound before serving starts: the port is known at once and a client that connects
early waits in the listen backlog. Error answers carry ``x-should-retry: false``: the ``openai``
client would otherwise retry 409s and 5xxs, and an episode's refusal is final.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations, and
# `Request` is imported inside `_app` (FastAPI loads only when an agent task runs).

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import secrets
import socket
import time
from typing import Any

from torchtitan_rl.rollout.agent_capture import EpisodeCapture, EpisodeError
from torchtitan_rl.rollout.agent_requests import (
    RequestError,
    chat_response,
    completion_response,
    error_body,
    parse_chat_request,
    parse_completion_request,
)

logger = logging.getLogger(__name__)

_ENDED_KEPT = 100_000  # ended episode ids remembered, to answer 409 (not 404) for late calls
_NO_RETRY = {"x-should-retry": "false"}


def _error(status: int, message: str, **kwargs: Any) -> Any:
    from fastapi.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, kind=kind, **kwargs), status_code=status,
                        headers=_NO_RETRY)


def _pool_client_class() -> type:
    """The shared client's HTTP client: every episode's copy holds it, and an agent that closes
    its copy (``async with client``) must not close the run's pool under the other episodes."""
    import openai

    class _PoolClient(openai.DefaultAsyncHttpxClient):
        async def aclose(self) -> None:
            pass  # an episode's close: the pool stays for the other episodes

        async def close_pool(self) -> None:
            await super().aclose()

    return _PoolClient


class EpisodeServer:
    """Serves episodes at ``http://{host}:{port}/episodes/<id>/v1``; ``port`` 0 picks a free one.
    ``api_key`` None makes one for this server (``secrets.token_urlsafe``)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 model_name: str = "policy") -> None:
        self.host = host
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.model_name = model_name
        self._requested_port = port
        self.port: int | None = None
        self._episodes: dict[str, EpisodeCapture] = {}
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._server: Any = None
        self._serving: asyncio.Task | None = None
        self._client: Any = None  # the run's openai.AsyncOpenAI, made on first use

    # ---- lifecycle ----

    def start(self) -> None:
        """Bind and start serving as a task of the running event loop."""
        import uvicorn

        class _Server(uvicorn.Server):
            # The job owns the process's signals (SIGINT/SIGTERM/USR1): uvicorn must not take them.
            def capture_signals(self) -> contextlib.AbstractContextManager[None]:
                return contextlib.nullcontext()

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._requested_port))
        sock.listen(1024)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=60)
        self._server = _Server(config)
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]),
                                            name="agent-endpoint")
        self._serving.add_done_callback(self._on_stopped)
        logger.info("agent endpoint: http://%s:%d/episodes/<id>/v1", self.host, self.port)

    def _on_stopped(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("agent endpoint stopped: %r", task.exception())

    async def aclose(self) -> None:
        for episode_id in list(self._episodes):
            self.close(episode_id, "the run is shutting down")
        if self._client is not None:
            await self._client._client.close_pool()
            self._client = None
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._serving), 10.0)
            except TimeoutError:
                self._serving.cancel()
            except Exception:  # logged by _on_stopped
                pass
        self._server = self._serving = None

    # ---- episodes ----

    def open(self, capture: EpisodeCapture) -> str:
        """Serve ``capture`` at a new episode id (unguessable, never reused)."""
        episode_id = f"g{capture.group_id}-r{capture.rollout_index}-{secrets.token_hex(6)}"
        self._episodes[episode_id] = capture
        return episode_id

    def base_url(self, episode_id: str) -> str:
        if self.port is None:
            raise RuntimeError("EpisodeServer.start() first")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/episodes/{episode_id}/v1"

    def client(self, episode_id: str) -> Any:
        """An ``openai.AsyncOpenAI`` for the episode: a copy (``with_options``, ~60 us) of one
        client per server, sharing its connection pool; a new client would cost ~30 ms of CPU
        (httpx builds an SSL context) and a new connection per episode."""
        if self._client is None:
            import openai

            self._client = openai.AsyncOpenAI(
                base_url=self.base_url(episode_id), api_key=self.api_key,
                http_client=_pool_client_class()())
        return self._client.with_options(base_url=self.base_url(episode_id))

    def close(self, episode_id: str, why: str = "the agent returned") -> None:
        capture = self._episodes.pop(episode_id, None)
        if capture is None:
            return
        capture.end()
        self._ended[episode_id] = why
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)

    # ---- HTTP ----

    def _app(self) -> Any:
        from fastapi import FastAPI, Request

        app = FastAPI(title="torchtitan_rl agent endpoint", docs_url=None, redoc_url=None,
                      openapi_url=None)

        @app.get("/v1/models")
        async def models(request: Request) -> Any:
            return self._authorized(request) or self._models()

        @app.get("/episodes/{episode_id}/v1/models")
        async def episode_models(episode_id: str, request: Request) -> Any:
            refused = self._authorized(request)
            if refused is None:
                found = self._episode(episode_id)
                refused = found if not isinstance(found, EpisodeCapture) else None
            return refused or self._models()

        @app.post("/episodes/{episode_id}/v1/chat/completions")
        async def chat(episode_id: str, request: Request) -> Any:
            return await self._call(episode_id, request, chat=True)

        @app.post("/episodes/{episode_id}/v1/completions")
        async def complete(episode_id: str, request: Request) -> Any:
            return await self._call(episode_id, request, chat=False)

        return app

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": int(time.time()),
                                            "owned_by": "torchtitan_rl"}]}

    def _authorized(self, request: Any) -> Any:
        """None when the request carries the run's key, else the 401 answer."""
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.api_key.encode()):
            return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                               "with the key the agent was given", code="invalid_api_key")
        return None

    def _episode(self, episode_id: str) -> Any:
        """The episode's capture, or the 404/409 answer."""
        capture = self._episodes.get(episode_id)
        if capture is not None:
            return capture
        if episode_id in self._ended:
            return _error(409, f"episode {episode_id} has ended ({self._ended[episode_id]}); "
                               f"no more calls are taken", code="episode_ended")
        return _error(404, f"no episode {episode_id} on this endpoint (each rollout gets its "
                           f"own base_url)", code="episode_not_found")

    async def _call(self, episode_id: str, request: Any, *, chat: bool) -> Any:
        refused = self._authorized(request)
        if refused is not None:
            return refused
        capture = self._episode(episode_id)
        if not isinstance(capture, EpisodeCapture):
            return capture
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return _error(400, f"body: not JSON ({e})", param="body")
        try:
            if chat:
                parsed = parse_chat_request(body)
                completion, text = await capture.chat(parsed.messages, parsed.tools,
                                                      parsed.max_tokens)
                return chat_response(parsed, completion, text, capture.tokenizer)
            parsed_c = parse_completion_request(body)
            prompt = parsed_c.prompt
            ids = capture.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            if max(ids) >= len(capture.tokenizer):
                raise RequestError("prompt", f"token id {max(ids)} is not in the model's "
                                             f"vocabulary of {len(capture.tokenizer)}")
            completion, text = await capture.complete(list(ids), parsed_c.max_tokens)
            return completion_response(parsed_c, completion, text, capture.tokenizer)
        except RequestError as e:
            logger.debug("episode %s: 400 %s", episode_id, e)
            return _error(400, str(e), param=e.param)
        except EpisodeError as e:
            logger.debug("episode %s: %d %s", episode_id, e.status_code, e)
            return _error(e.status_code, str(e), param=e.param, code=e.code)
