"""A host's worker for ``placement.kind = "attach"``: run one on every machine of the job, then
start the run anywhere that reaches them. With mutual TLS (any network you do not fully trust):

    node0$ python -m torchtitan_rl.tls --out certs --hosts node1,node2   # once, on a shared disk
    node1$ python -m torchtitan_rl.worker --tls-dir certs --address tls://node1:26600
    node2$ python -m torchtitan_rl.worker --tls-dir certs --address tls://node2:26600
    node0$ python -m torchtitan_rl.train --config run_configs/alphabet_sort_cpu.toml \\
               --placement.kind attach --num_generators 1 --placement.tls certs \\
               --placement.workers tls://node1:26600,tls://node2:26600

A TLS worker listens at exactly the address the controller dials (Monarch 0.6.0 has no
``ADVERTISED@BIND`` alias and no 0.0.0.0 for tls://); a plain one may use
``tcp://ADVERTISED:PORT@tcp://BIND:PORT`` (listen on BIND, tell the controller ADVERTISED).
``--tls-dir`` holds ca.crt, worker.crt and worker.key (torchtitan_rl/tls.py): the worker accepts
only clients with a certificate of that CA, and the procs it spawns inherit the settings. Without it the worker
serves plain ``tcp://`` and accepts any connection (``trust_all_connections``): whoever reaches
the port can run code as this user, so trusted networks only. Either way a local user of this
machine can reach the worker through its unix socket: give it a machine, container or namespace
of its own. The worker serves until it is killed; the run's procs (trainer ranks, generator
ranks) are its children and are stopped when the run ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# A gone client's procs are stopped within a minute, not > 5 min; the worker keeps serving
# (controller/hosts/reaper.py; an attaching client pushes its own value too).
from torchtitan_rl.controller.hosts.reaper import set_monarch_defaults  # noqa: E402 (stdlib only)
from torchtitan_rl.threads import set_openmp_spin  # noqa: E402 (stdlib only)

set_monarch_defaults()
set_openmp_spin()  # the procs it hosts inherit it (threads.py)

logger = logging.getLogger("torchtitan_rl.worker")


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_rl.worker",
        description="Serve this machine to runs with placement.kind = 'attach' (see the module "
                    "docstring and docs/scaling.md).")
    parser.add_argument("--address", required=True,
                        help="tls://HOST:PORT with --tls-dir (HOST: as the controller dials it); "
                             "tcp://HOST:PORT or tcp://ADVERTISED:PORT@tcp://0.0.0.0:PORT without "
                             "(trusted networks only)")
    parser.add_argument("--tls-dir", default="",
                        help="the job's certificate folder (python -m torchtitan_rl.tls): "
                             "ca.crt, worker.crt, worker.key; serve mutual TLS on a tls:// "
                             "address")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.tls_dir:
        if not args.address.startswith("tls://"):
            parser.error(f"--address {args.address!r}: with --tls-dir, write tls://HOST:PORT")
        host = args.address[len("tls://"):].rpartition(":")[0]
        if "@" in args.address or host in ("", "0.0.0.0", "*", "[::]"):
            # Monarch 0.6.0's TLS worker is known by the address it binds: the controller
            # dials exactly that (no ADVERTISED@BIND alias, no wildcard).
            parser.error(f"--address {args.address!r}: a TLS worker serves at tls://HOST:PORT, "
                         "HOST being the name or IP the controller dials (no @ alias, no 0.0.0.0)")
    elif args.address.startswith("tls://"):
        parser.error(f"--address {args.address!r} needs --tls-dir (the job's certificates)")
    elif not args.address.startswith(("tcp://", "ipc://", "metatls://")):
        parser.error(f"--address {args.address!r}: write tcp://HOST:PORT (or tls://HOST:PORT "
                     "with --tls-dir)")  # exits 2
    from torchtitan_rl.config.errors import ConfigError
    from torchtitan_rl.tls import tls_files

    if args.tls_dir:
        try:
            # Before monarch is imported: it reads the TLS variables from the environment.
            os.environ.update(tls_files(args.tls_dir, "worker", key="--tls-dir").env())
        except ConfigError as e:
            parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from monarch.actor import run_worker_loop_forever

    from torchtitan_rl.controller.hosts import attach_tls
    from torchtitan_rl.controller.hosts.placement import TRUST_ALL

    if args.tls_dir:
        logger.info("serving at %s with mutual TLS (certificates in %s; pid %d)", args.address,
                    args.tls_dir, os.getpid())
    else:
        logger.info("serving at %s (pid %d)", args.address, os.getpid())
        if attach_tls.beyond_this_machine(args.address.split("@")[-1]):
            logger.warning("plain tcp: anyone who reaches this port can run code as this user; "
                           "use --tls-dir on a network you do not trust (docs/scaling.md)")
    # TRUST_ALL is only the Python wrapper's argument (its ca= raises NotImplementedError in
    # Monarch 0.6.0): on a tls:// address the transport enforces the environment's CA.
    run_worker_loop_forever(address=args.address, ca=TRUST_ALL)


if __name__ == "__main__":
    cli()
