"""A host's worker for ``placement.kind = "attach"``: run one on every machine of the job, then
start the run anywhere that reaches them.

    node1$ python -m torchtitan_rl.worker --address tcp://node1:26600@tcp://0.0.0.0:26600
    node2$ python -m torchtitan_rl.worker --address tcp://node2:26600@tcp://0.0.0.0:26600
    node0$ python -m torchtitan_rl.train --config run_configs/alphabet_sort_cpu.toml \\
               --placement.kind attach --num_generators 1 \\
               --placement.workers tcp://node1:26600,tcp://node2:26600

The address is Monarch's: ``tcp://ADVERTISED:PORT@tcp://BIND:PORT`` listens on BIND and tells the
controller to dial ADVERTISED (plain ``tcp://HOST:PORT`` does both). The worker serves until it is
killed; the run's procs (trainer ranks, generator ranks) are its children and are stopped when
the run ends. Connections are not authenticated (``trust_all_connections``): trusted networks only.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Procs spawned by this worker inherit it: a lost generator is noticed in ~1 s, not ~10 s.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
# A gone client's procs are stopped within a minute, not > 5 min; the worker keeps serving
# (controller/lifetime.py; an attaching client pushes its own value too).
from torchtitan_rl.controller.lifetime import set_monarch_defaults  # noqa: E402 (stdlib only)

set_monarch_defaults()

logger = logging.getLogger("torchtitan_rl.worker")


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_rl.worker",
        description="Serve this machine to runs with placement.kind = 'attach' (see the module "
                    "docstring and docs/scaling.md).")
    parser.add_argument("--address", required=True,
                        help="tcp://HOST:PORT, or tcp://ADVERTISED:PORT@tcp://0.0.0.0:PORT")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.address.startswith(("tcp://", "ipc://", "metatls://")):
        parser.error(f"--address {args.address!r}: write tcp://HOST:PORT")  # exits 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from monarch.actor import run_worker_loop_forever

    from torchtitan_rl.controller.placement import TRUST_ALL

    logger.info("serving at %s (pid %d)", args.address, os.getpid())
    run_worker_loop_forever(address=args.address, ca=TRUST_ALL)


if __name__ == "__main__":
    cli()
