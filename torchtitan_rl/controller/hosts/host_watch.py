"""A lost host noticed by the run itself: its Monarch worker stops answering on its port.

    GeneratorPool.spawn -> HostWatch(addresses of the generator hosts, on_lost).run() (a task)
        every interval_s: a connect to each host's worker (tcp://HOST:PORT, tls://HOST:PORT;
        ipc://PATH, a simulated host's socket)
        misses in a row -> on_lost(host index, reason), once per host
    GeneratorPool.close -> the task cancelled

Monarch 0.6 reports a proc that dies on a live host at once, but when a whole host goes (a node
fails: its worker and procs killed with it), calls to the actors there can wait forever
(monarch#3435) and the mesh's failure event did not reach the controller in 3 minutes on a
Slurm node (scripts/slurm_cluster.py kill-node). The worker's own port answers that question:
refused or silent means the host is gone. A worker that is up answers at once, so the cost is
one connect per host per interval.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Callable

logger = logging.getLogger(__name__)


class HostWatch:
    def __init__(self, addresses: list[str], on_lost: Callable[[int, str], None], *,
                 interval_s: float, misses: int = 2) -> None:
        """``addresses[i]``: host i's worker (tcp://, tls:// or ipc://; others are not watched;
        the list is read at every round);
        ``on_lost(i, reason)`` once host i missed ``misses`` probes in a row."""
        self.addresses = addresses
        self.on_lost = on_lost
        self.interval_s = interval_s
        self.misses = misses
        self.lost: set[int] = set()

    async def run(self) -> None:
        """Until cancelled; ``addresses`` may grow meanwhile (a host added mid-run)."""
        missed: dict[int, int] = {}
        while True:
            await asyncio.sleep(self.interval_s)  # the probe's period, not a synchronisation
            for index, address in enumerate(list(self.addresses)):
                if index in self.lost:
                    continue
                error = await self.probe(address)
                missed[index] = missed.get(index, 0) + 1 if error else 0
                if missed[index] >= self.misses:
                    self.lost.add(index)
                    self.on_lost(index, f"its worker at {address} stopped answering ({error})")

    async def probe(self, address: str) -> str | None:
        """None when the worker at ``address`` accepts a connection, else why not."""
        parsed = urllib.parse.urlsplit(address)
        if parsed.scheme == "ipc":
            connect = asyncio.open_unix_connection(parsed.path)
        elif parsed.scheme in ("tcp", "tls") and parsed.port is not None:
            connect = asyncio.open_connection(parsed.hostname, parsed.port)
        else:
            return None
        try:
            _, writer = await asyncio.wait_for(connect, self.interval_s)
        except (OSError, TimeoutError) as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        writer.close()
        return None
