"""EpisodeServer: the run's OpenAI-compatible endpoint, one URL per agent episode.

    AgentEnv --open(capture)--> EpisodeServer -> episode id -> base_url
             = http://127.0.0.1:PORT/episodes/<id>/v1            (what the agent's client gets)
    agent --POST <base_url>/chat/completions (Authorization: Bearer <run's key)--> EpisodeServer
    EpisodeServer: (TCP only: past max_concurrent_requests in flight -> 503 + Retry-After)
                   auth -> episode by id (404 unknown, 409 ended) -> body (413 over
                   max_body_bytes, 408 not received within body_timeout_s) -> parse (400 naming
                   the field; 404 another model) -> EpisodeCapture.chat/complete (generates
                   through the run's GenerateFn) -> OpenAI-format JSON
    AgentEnv --close(id)--> EpisodeServer (later calls: 409; calls in flight cancelled)

uvicorn serves a plain ASGI app (``_asgi``) as a task of the event loop that runs the rollouts
(the controller's), so a request calls the run's GenerateFn where it lives, with no thread hop. The
socket is bound before serving starts: the port is known at once and a client that connects
early waits in the listen backlog. Error answers carry ``x-should-retry: false``: the ``openai``
client would otherwise retry 409s and 5xxs, and an episode's refusal is final; the 503 of a shed
request does not (the client retries after its Retry-After).

Bad input never reaches the generator and never changes an episode: every refused request is
answered before its episode's call count, prompt or turns are touched. A TCP client that
disconnects before its answer has its call cancelled (the generator's request aborted) and no
turn recorded; its call's turn index stays spent (an aborted request id is never reused), so the
episode's next call gets the next seed. The run's own agents call the app in process
(``client``), outside the TCP limit: the gate already bounds them.
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
_SHED_RETRY_AFTER_S = 1  # what a shed request's Retry-After asks (the openai client honours it)


# Route (after /episodes/<id>) -> its method.
_ROUTES = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/models": "GET"}


def _error(status: int, message: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """(status, OpenAI error body); the response adds ``x-should-retry: false``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, error_body(message, kind=kind, **kwargs)


def _refuse_constant(name: str) -> Any:
    # json.loads takes NaN, Infinity and -Infinity by default; JSON has none of them.
    raise ValueError(f"{name} is not valid JSON")


class _BodyError(Exception):
    """A body the server will not read: answered with ``status``, naming the body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Disconnected(Exception):
    """The client went away before its answer: nothing is sent."""


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
                 model_name: str = "policy", max_body_bytes: int = 8 << 20,
                 max_concurrent_requests: int = 256, body_timeout_s: float = 30.0) -> None:
        """``max_body_bytes``: a larger body is a 413, unread. ``max_concurrent_requests``: TCP
        requests served at once; more are shed at once with a 503 and Retry-After.
        ``body_timeout_s``: a body not received in full by then is a 408 (a stalled client
        holds no slot for longer)."""
        for name, value in (("max_body_bytes", max_body_bytes),
                            ("max_concurrent_requests", max_concurrent_requests)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
        self.host = host
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.max_concurrent_requests = max_concurrent_requests
        self.body_timeout_s = body_timeout_s
        self.num_tcp_in_flight = 0
        """TCP requests being served now (<= max_concurrent_requests)."""
        self.num_shed = 0
        """TCP requests answered 503 because max_concurrent_requests were in flight."""
        self.num_disconnected = 0
        """Requests whose client went away before the answer (their call cancelled)."""
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
        config = uvicorn.Config(self._tcp_asgi, interface="asgi3", log_level="warning",
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
        routing, validation and middleware cost ~0.5 ms of the controller's CPU per call). The
        run's own agents reach it in process (``client``)."""
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        await self._serve(scope, receive, send, watch_disconnect=False)

    async def _tcp_asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The app as uvicorn serves it over TCP: a request past ``max_concurrent_requests`` in
        flight is shed before its body is read, and a client that disconnects cancels its call."""
        if scope["type"] != "http":
            return
        if self.num_tcp_in_flight >= self.max_concurrent_requests:
            self.num_shed += 1
            # The first in the log file; later ones only counted (an overload is many of them).
            logger.log(logging.WARNING if self.num_shed == 1 else logging.DEBUG,
                       "agent endpoint: %d TCP requests in flight (task.max_concurrent_"
                       "requests): shedding with 503 (%d so far)", self.num_tcp_in_flight,
                       self.num_shed)
            status, body = _error(503, f"the endpoint is serving {self.num_tcp_in_flight} "
                                       f"requests (task.max_concurrent_requests); retry after "
                                       f"{_SHED_RETRY_AFTER_S} s", code="overloaded")
            await _respond(send, status, body, [(b"retry-after",
                                                 str(_SHED_RETRY_AFTER_S).encode())])
            return
        self.num_tcp_in_flight += 1
        try:
            await self._serve(scope, receive, send, watch_disconnect=True)
        finally:
            self.num_tcp_in_flight -= 1

    async def _serve(self, scope: dict[str, Any], receive: Any, send: Any, *,
                     watch_disconnect: bool) -> None:
        path, method = scope["path"], scope["method"]
        try:
            status, body = await self._route(path, method, scope, receive, watch_disconnect)
        except _Disconnected:
            self.num_disconnected += 1
            logger.debug("%s %s: the client disconnected before its answer", method, path)
            return
        except Exception as e:  # a bug, not bad input: logged in full, answered 500
            logger.exception("%s %s failed", method, path)
            status, body = _error(500, f"the endpoint failed on this request: {e!r:.200}")
        await _respond(send, status, body, [] if status < 400 else [(b"x-should-retry",
                                                                     b"false")])

    async def _route(self, path: str, method: str, scope: dict[str, Any], receive: Any,
                     watch_disconnect: bool) -> tuple[int, dict[str, Any]]:
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
        try:
            async with asyncio.timeout(self.body_timeout_s):
                raw = await _read_body(scope, receive, self.max_body_bytes)
        except _BodyError as e:
            return _error(e.status, str(e), param="body")
        except TimeoutError:
            return _error(408, f"body: not received in full within {self.body_timeout_s} s",
                          param="body")
        call = self._call(episode_id, capture, raw, chat=tail == "/v1/chat/completions")
        if not watch_disconnect:
            return await call
        return await _unless_disconnected(call, receive)

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
            body = json.loads(raw, parse_constant=_refuse_constant)
        except ValueError as e:  # UnicodeDecodeError too
            return _error(400, f"body: not JSON ({e})", param="body")
        except RecursionError:
            return _error(400, "body: nested too deeply to parse", param="body")
        try:
            if chat:
                parsed = parse_chat_request(body)
                self._check_model(parsed.model)
                completion, message = await capture.chat(parsed.messages, parsed.tools,
                                                         parsed.max_tokens)
                return 200, chat_response(parsed, completion, message, capture.tokenizer)
            parsed_c = parse_completion_request(body)
            self._check_model(parsed_c.model)
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

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise EpisodeError(404, f"model: no model {model!r} on this endpoint; it serves "
                                    f"{self.model_name!r} (GET /v1/models)",
                               code="model_not_found", param="model")


async def _respond(send: Any, status: int, body: dict[str, Any],
                   extra_headers: list[tuple[bytes, bytes]]) -> None:
    data = json.dumps(body).encode()
    # content-length: else uvicorn answers chunked, one more write per response.
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _read_body(scope: dict[str, Any], receive: Any, limit: int) -> bytes:
    """The request's body; _BodyError (413) past ``limit`` bytes, by its content-length before
    reading or while reading; _Disconnected when the client goes away first."""
    declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _BodyError(413, f"body: {int(declared)} bytes, over the endpoint's limit of "
                              f"{limit} (task.max_body_bytes)")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyError(413, f"body: over the endpoint's limit of {limit} bytes "
                                  f"(task.max_body_bytes)")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _unless_disconnected(call: Any, receive: Any) -> tuple[int, dict[str, Any]]:
    """``call``'s answer; _Disconnected (``call`` cancelled) when the client goes away first.
    Once the body is read, uvicorn's ``receive`` returns only at a disconnect (or after the
    response)."""
    answer = asyncio.ensure_future(call)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not answer.done():  # gone, or this request itself cancelled (the server stopping)
            answer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await answer
        gone.cancel()
    if answer.cancelled():
        raise _Disconnected
    return answer.result()


async def _disconnect(receive: Any) -> None:
    """Returns when the client has gone (``receive`` says ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass
