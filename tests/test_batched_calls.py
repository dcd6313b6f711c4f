"""Batched calls (torchtitan_rl/batched_calls.py), both sides, over an in-process port: the
pattern a generator's submit and a rollout worker's run_groups share."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from torchtitan_rl.batched_calls import BatchedCaller, MessageCounts, ReplyBatcher


class _Port:
    """A reply port and its receiver in this process (what Monarch's Channel.open gives)."""

    def __init__(self, name: str = "port") -> None:
        self._port_ref = name
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sent: list[list] = []

    def send(self, batch: list) -> None:
        pickle.dumps(batch)  # as Monarch does: a batch that does not pickle raises here
        self.sent.append(batch)
        self.queue.put_nowait(batch)

    async def recv(self) -> list:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


def _caller(port: _Port, **kwargs):
    sent: list[list] = []
    cancelled: list[tuple] = []
    port_failures: list[str] = []
    caller = BatchedCaller(
        send=lambda batch, replies: sent.append(batch), cancel=lambda *a: cancelled.append(a),
        unpack=lambda item: item, on_port_failed=port_failures.append,
        open_port=lambda: (port, port), **kwargs)
    return caller, sent, cancelled, port_failures


def test_calls_of_one_turn_leave_in_one_message_and_results_resolve_their_keys() -> None:
    async def main() -> None:
        port = _Port()
        counts = MessageCounts()
        caller, sent, _, _ = _caller(port, counts=counts)
        a, b = caller.call("a"), caller.call("b")
        await asyncio.sleep(0)  # the end of the turn
        assert sent == [[(0, "a"), (1, "b")]]
        c = caller.call("c")
        caller.flush()  # before another message to the actor
        assert sent[1] == [(2, "c")]
        port.queue.put_nowait([(1, "B", None), (0, None, ValueError("bad a"))])
        assert await b == "B"
        with pytest.raises(ValueError, match="bad a"):
            await a
        port.queue.put_nowait([(2, "C", None), (7, "nobody's", None)])
        assert await c == "C"
        assert (counts.num_sent, counts.num_received) == (2, 2)
        assert caller.outstanding() == set()

    asyncio.run(main())


def test_a_cancelled_call_never_leaves_or_is_cancelled_at_the_actor() -> None:
    async def main() -> None:
        caller, sent, cancelled, _ = _caller(_Port())
        unsent = caller.call("x")
        unsent.cancel()
        kept = caller.call("y")
        await asyncio.sleep(0)
        assert sent == [[(1, "y")]]  # x never left
        kept.cancel()
        await asyncio.sleep(0)
        assert cancelled == [(1, "y")]

    asyncio.run(main())


def test_fail_ends_every_call_out_and_later_ones_and_a_broken_port_is_reported() -> None:
    async def main() -> None:
        port = _Port()
        caller, sent, cancelled, port_failures = _caller(port)
        out = caller.call("x")
        await asyncio.sleep(0)
        port.queue.put_nowait(ConnectionError("peer gone"))
        await asyncio.sleep(0.01)
        assert port_failures == ["its reply port failed: ConnectionError: peer gone"]
        caller.fail(lambda: RuntimeError("lost"))
        with pytest.raises(RuntimeError, match="lost"):
            await out
        later = caller.call("y")
        with pytest.raises(RuntimeError, match="lost"):
            await later
        caller.flush()
        assert sent == [[(0, "x")]] and cancelled == []  # nothing goes to a failed actor

    asyncio.run(main())


def test_results_of_one_turn_go_in_one_message_per_port_and_within_s_waits_for_more() -> None:
    async def main() -> None:
        batcher = ReplyBatcher(lambda item: (item[0], repr(item[1])))
        p, q = _Port("p"), _Port("q")
        batcher.add(p, (0, 1))
        batcher.add(q, (1, 2))
        batcher.add(p, (2, 3))
        await asyncio.sleep(0)
        assert (p.sent, q.sent) == ([[(0, 1), (2, 3)]], [[(1, 2)]])
        batcher.add(p, (3, 4), within_s=0.05)
        await asyncio.sleep(0)
        assert len(p.sent) == 1  # waits for more
        batcher.add(p, (4, 5), within_s=0.05)
        batcher.add(p, (5, 6))  # nothing else is coming: now
        await asyncio.sleep(0)
        assert p.sent[1] == [(3, 4), (4, 5), (5, 6)]
        batcher.add(p, (6, lambda: None))  # does not pickle: sent as text
        batcher.flush()
        assert p.sent[2][0][0] == 6 and p.sent[2][0][1].startswith("<function")

    asyncio.run(main())
