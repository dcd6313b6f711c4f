"""A Monarch actor whose endpoint raises under a deep stack (the console's one-line error test)."""

from __future__ import annotations

from monarch.actor import Actor, endpoint, this_host


class Raising(Actor):
    @endpoint
    async def start(self) -> int:
        def build(depth: int) -> int:
            if depth == 0:
                raise ValueError("No common block size for 17 (CPU_ATTN: [MultipleOf(32)]).")
            return build(depth - 1)

        return build(30)


async def call_raising_actor() -> int:
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        actor = procs.spawn("generator_0", Raising)
        return await actor.start.call_one()
    finally:
        await procs.stop()
