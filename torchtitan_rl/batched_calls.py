"""Calls to an actor batched by event-loop turn, their results batched by reply port: the one
Monarch pattern behind a generator's ``submit`` and a rollout worker's ``run_groups``.

    caller (BatchedCaller)                                   actor (ReplyBatcher)
    call(request) -> a future, keyed
    end of the event-loop turn: send([(key, request)], port)  -> one message
                                                                each result: add(port, result)
    receive: [result, ...] on the port  <-  one message        end of its turn (or within_s):
    each result resolves its key's future                        one message per port
    a future cancelled: unsent -> dropped; sent -> cancel(key, request)
    fail(error): every future still out raises (a SIGKILLed actor never replies, monarch#3435)

A Monarch message costs CPU on both sides: batching keeps the messages per event-loop turn rather
than per request, in both directions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

RequestT = TypeVar("RequestT")
ResultT = TypeVar("ResultT")
ItemT = TypeVar("ItemT")


@dataclasses.dataclass(kw_only=True, slots=True)
class MessageCounts:
    num_sent: int = 0
    """Messages sent (each carries the calls made in one event-loop turn)."""
    num_received: int = 0
    """Result batches received (each carries the results ready together)."""


def open_channel() -> tuple[Any, Any]:
    """A Monarch reply port and its receiver."""
    from monarch.actor import Channel

    return Channel.open()


class BatchedCaller(Generic[RequestT, ResultT]):
    """The client side of batched calls to one actor (see the module docstring).

    ``send(batch, port)``: sends ``[(key, request)]`` with the reply port in one message.
    ``cancel(key, request)``: the caller gave up a call already sent.
    ``unpack(item)``: a received item -> ``(key, result, error)``.
    ``on_port_failed(reason)``: the reply port broke; no result can arrive any more (the owner
    then calls ``fail``)."""

    def __init__(self, *, send: Callable[[list[tuple[int, RequestT]], Any], None],
                 cancel: Callable[[int, RequestT], None],
                 unpack: Callable[[Any], tuple[int, ResultT | None, BaseException | None]],
                 on_port_failed: Callable[[str], None],
                 counts: MessageCounts | None = None,
                 open_port: Callable[[], tuple[Any, Any]] = open_channel) -> None:
        self._send = send
        self._cancel = cancel
        self._unpack = unpack
        self._on_port_failed = on_port_failed
        self._open_port = open_port
        self.counts = counts if counts is not None else MessageCounts()
        self.failed: Callable[[], BaseException] | None = None
        """Set by fail(): the error every later call raises."""
        self._keys = itertools.count()
        self._waiting: dict[int, asyncio.Future[ResultT]] = {}
        """Futures by key, until their result comes back."""
        self._unsent: dict[int, RequestT] = {}
        """Calls made in this event-loop turn, sent together at its end."""
        self._port: Any = None
        self._receiving: asyncio.Future[None] | None = None

    def call(self, request: RequestT) -> asyncio.Future[ResultT]:
        """A future of the request's result; the request leaves at the end of this event-loop
        turn with every other call made in the turn (or at the next ``flush``)."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[ResultT] = loop.create_future()
        if self.failed is not None:
            result.set_exception(self.failed())
            return result
        if self._port is None:
            self._port, receiver = self._open_port()
            self._receiving = asyncio.ensure_future(self._receive(receiver))
        key = next(self._keys)
        self._waiting[key] = result
        if not self._unsent:
            loop.call_soon(self.flush)
        self._unsent[key] = request

        def forget(done: asyncio.Future[ResultT]) -> None:
            # A call still in _waiting and no longer in _unsent left in a message; one given up
            # before it left is in neither (flush dropped it) or still in _unsent.
            sent = self._waiting.pop(key, None) is not None and key not in self._unsent
            self._unsent.pop(key, None)
            if done.cancelled() and sent and self.failed is None:
                self._cancel(key, request)  # after its message, so the actor finds it

        result.add_done_callback(forget)
        return result

    def flush(self) -> None:
        """Send the calls made so far in this turn now (before another message to the actor,
        which must not overtake them); a call given up already never leaves."""
        unsent, self._unsent = self._unsent, {}
        batch = []
        for key, request in unsent.items():
            if self._waiting[key].cancelled():
                del self._waiting[key]
            else:
                batch.append((key, request))
        if batch and self.failed is None:
            self._send(batch, self._port)
            self.counts.num_sent += 1

    def fail_calls(self, keys: list[int], error: BaseException) -> None:
        """The calls ``keys`` raise ``error`` (their message failed)."""
        for key in keys:
            waiting = self._waiting.get(key)
            if waiting is not None and not waiting.done():
                waiting.set_exception(error)

    def fail(self, error: Callable[[], BaseException]) -> None:
        """Every call still out, and every later one, raises ``error()``; stop receiving."""
        if self.failed is None:
            self.failed = error
        for future in list(self._waiting.values()):
            if not future.done():
                future.set_exception(error())
        self.stop_receiving()

    def stop_receiving(self) -> None:
        if self._receiving is not None:
            self._receiving.cancel()

    def outstanding(self) -> set[asyncio.Future[ResultT]]:
        return set(self._waiting.values())

    async def _receive(self, receiver: Any) -> None:
        try:
            while True:
                batch = await receiver.recv()
                self.counts.num_received += 1
                for item in batch:
                    key, result, error = self._unpack(item)
                    waiting = self._waiting.get(key)
                    if waiting is None or waiting.done():  # cancelled, or failed already
                        continue
                    if error is None:
                        waiting.set_result(result)  # type: ignore[arg-type]
                    else:
                        waiting.set_exception(error)
        except Exception as e:  # no result can reach its caller any more: never hang them
            self._on_port_failed(f"its reply port failed: {type(e).__name__}: {e}")


class ReplyBatcher(Generic[ItemT]):
    """The actor side: results go to their reply port in one message per port, at the end of
    the event-loop turn they are added in (``within_s`` > 0: with whatever else is added within
    that many seconds). ``as_text(item)``: the item with its error as text, sent in place of a
    batch that does not pickle (the caller still learns what failed)."""

    def __init__(self, as_text: Callable[[ItemT], ItemT]) -> None:
        self._as_text = as_text
        self._batches: dict[str, tuple[Any, list[ItemT]]] = {}
        self._timer: asyncio.Handle | None = None
        self._flush_soon = False

    def add(self, port: Any, item: ItemT, *, within_s: float = 0.0) -> None:
        # Every message of one caller carries the same port, unpickled into a new object each
        # time: its reference names it.
        self._batches.setdefault(repr(port._port_ref), (port, []))[1].append(item)
        loop = asyncio.get_running_loop()
        if within_s <= 0:
            if not self._flush_soon:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = loop.call_soon(self.flush)
                self._flush_soon = True
        elif self._timer is None:
            self._timer = loop.call_later(within_s, self.flush)

    def flush(self) -> None:
        batches, self._batches = self._batches, {}
        self._timer, self._flush_soon = None, False
        for port, batch in batches.values():
            try:
                port.send(batch)
            except Exception:  # an error that does not pickle still reaches its caller, as text
                logger.warning("results did not pickle: errors sent as text", exc_info=True)
                port.send([self._as_text(item) for item in batch])
