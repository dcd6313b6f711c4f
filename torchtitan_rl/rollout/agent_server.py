"""EpisodeServer: the run's OpenAI-compatible endpoint, one URL per agent episode.

    AgentEnv --open(capture)--> EpisodeServer -> episode id -> base_url
             = http://127.0.0.1:PORT/episodes/<id>/v1            (what the agent's client gets)
    agent --POST <base_url>/chat/completions (Authorization: Bearer <run's key)--> EpisodeServer
    EpisodeServer: auth -> episode by id (404 unknown, 409 ended) -> parse (400 naming the field)
                   -> EpisodeCapture.chat/complete (generates through the run's GenerateFn)
                   -> OpenAI-format JSON
    AgentEnv --close(id)--> EpisodeServer (later calls: 409; calls in flight cancelled)

uvicorn serves a plain ASGI app (``_asgi``) as a task of the event loop that runs the rollouts
(the controller's), so a request calls the run's GenerateFn where it lives, with no thread hop. The
socket is bound before serving starts: the port is known at once and a client that connects
early waits in the listen backlog. Error answers carry ``x-should-retry: false``: the ``openai``
client would otherwise retry 409s and 5xxs, and an episode's refusal is final.
"""

from __future__ import annotations

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


# Route (after /episodes/<id>) -> its method.
_ROUTES = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/models": "GET"}


def _error(status: int, message: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """(status, OpenAI error body); the response adds ``x-should-retry: false``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, error_body(message, kind=kind, **kwargs)


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
        self._sock: socket.socket | None = None  # the listening socket

    # ---- lifecycle ----

    def start(self) -> None:
        """Bind and start serving as a task of the running event loop."""
        import uvicorn

        class _Server(uvicorn.Server):
            # The job owns the process's signals (SIGINT/SIGTERM/USR1): uvicorn must not take them.
            def capture_signals(self) -> contextlib.AbstractContextManager[None]:
                return contextlib.nullcontext()

        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP (an
        # accepted socket copies the listener's proto); with Nagle on, a response's body waits
        # for the client's delayed ACK of its headers, ~40 ms per call.
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET,
                             socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._requested_port))
        sock.listen(1024)
        self.port = sock.getsockname()[1]
        self._sock = sock
        # interface: uvicorn's guess takes a bound method for ASGI2; proxy headers: bound to
        # the agents' host, no proxy in between.
        config = uvicorn.Config(self._asgi, interface="asgi3", log_level="warning",
                                access_log=False, proxy_headers=False, lifespan="off",
                                timeout_keep_alive=60)
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
        client per server; a new client would cost ~30 ms of CPU (httpx builds an SSL context).
        Its requests reach this server's ASGI app in process (no socket, no uvicorn: the same
        app, so the same answers), while ``base_url`` serves any other client over TCP."""
        if self._client is None:
            import httpx2  # openai 3's own httpx
            import openai

            self._client = openai.AsyncOpenAI(
                base_url=self.base_url(episode_id), api_key=self.api_key,
                http_client=_pool_client_class()(transport=httpx2.ASGITransport(app=self._asgi)))
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

    async def _asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The whole app: five routes, so a plain ASGI callable rather than a framework (FastAPI's
        routing, validation and middleware cost ~0.5 ms of the controller's CPU per call)."""
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        path, method = scope["path"], scope["method"]
        status, body = await self._route(path, method, scope, receive)
        data = json.dumps(body).encode()
        # content-length: else uvicorn answers chunked, one more write per response.
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(data)).encode())]
        if status >= 400:
            headers.append((b"x-should-retry", b"false"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def _route(self, path: str, method: str, scope: dict[str, Any], receive: Any
                     ) -> tuple[int, dict[str, Any]]:
        """(status, JSON body) for one request."""
        episode_id, tail = None, path
        if path.startswith("/episodes/"):
            episode_id, _, rest = path[len("/episodes/"):].partition("/")
            tail = "/" + rest
        if tail not in _ROUTES:
            return _error(404, f"no route {path} (the endpoint serves /episodes/<id>/v1/"
                               f"{{chat/completions,completions,models}})")
        if method != _ROUTES[tail]:
            return _error(405, f"{path}: {_ROUTES[tail]} expected, got {method}")
        refused = self._authorized(scope)
        if refused is not None:
            return refused
        if tail == "/v1/models" and episode_id is None:
            return 200, self._models()
        capture = self._episode(episode_id or "")
        if not isinstance(capture, EpisodeCapture):
            return capture
        if tail == "/v1/models":
            return 200, self._models()
        raw = await _read_body(receive)
        return await self._call(episode_id, capture, raw, chat=tail == "/v1/chat/completions")

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": int(time.time()),
                                            "owned_by": "torchtitan_rl"}]}

    def _authorized(self, scope: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """None when the request carries the run's key, else the 401 answer."""
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, key = header.decode("latin-1").partition(" ")
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

    async def _call(self, episode_id: str, capture: EpisodeCapture, raw: bytes, *, chat: bool
                    ) -> tuple[int, dict[str, Any]]:
        try:
            body = json.loads(raw)
        except ValueError as e:
            return _error(400, f"body: not JSON ({e})", param="body")
        try:
            if chat:
                parsed = parse_chat_request(body)
                completion, message = await capture.chat(parsed.messages, parsed.tools,
                                                         parsed.max_tokens)
                return 200, chat_response(parsed, completion, message, capture.tokenizer)
            parsed_c = parse_completion_request(body)
            prompt = parsed_c.prompt
            ids = capture.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            if max(ids) >= len(capture.tokenizer):
                raise RequestError("prompt", f"token id {max(ids)} is not in the model's "
                                             f"vocabulary of {len(capture.tokenizer)}")
            completion, text = await capture.complete(list(ids), parsed_c.max_tokens)
            return 200, completion_response(parsed_c, completion, text, capture.tokenizer)
        except RequestError as e:
            logger.debug("episode %s: 400 %s", episode_id, e)
            return _error(400, str(e), param=e.param)
        except EpisodeError as e:
            logger.debug("episode %s: %d %s", episode_id, e.status_code, e)
            return _error(e.status_code, str(e), param=e.param, code=e.code)


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)
