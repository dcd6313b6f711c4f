"""The controller's side of ``placement.tls`` (mutual TLS to attached workers) and the warnings
for placements that talk plain TCP.

    check_addresses(config)      at resolve time: tls:// addresses iff placement.tls is set, its
                                 folder holds ca.crt, client.crt and client.key (ConfigError)
    warn_plain(config)           one console line when hosts are dialled over plain TCP beyond
                                 this machine (attach without tls, slurm, kubernetes)
    use_client_tls(config)       before attach_to_workers: this process's Monarch presents the
                                 client certificate and gives up on a worker that does not
                                 accept it after placement.host_timeout_s
    rejected(error, config)      a worker that refused the run (or is not this job's): one line

Monarch 0.6.0 reads TLS material from the environment only (``torchtitan_rl/tls.py``); a client a
worker rejects is not told so, it retries until ``HYPERACTOR_MESH_ATTACH_CONFIG_TIMEOUT``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import urllib.parse
from typing import Any

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.tls import apply_monarch_tls, tls_files

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT_ENV = "HYPERACTOR_MESH_ATTACH_CONFIG_TIMEOUT"

_warned: set[str] = set()


def check_addresses(c: Any) -> None:
    """placement.tls and the worker addresses agree: a run that asked for TLS never dials plain
    TCP, and a tls:// address needs the certificates."""
    if c.tls and c.kind != "attach":
        raise ConfigError(f"placement.tls is for kind 'attach' (kind is {c.kind!r}): Monarch "
                          f"0.6.0's {c.kind} job dials its workers over plain tcp; remove "
                          "placement.tls or use placement.kind = \"attach\"")
    if c.kind != "attach":
        return
    for i, address in enumerate(c.workers):
        scheme = urllib.parse.urlsplit(address).scheme
        if c.tls and scheme != "tls":
            raise ConfigError(
                f"placement.workers[{i}]={address!r}: placement.tls is set, so every worker is "
                f"dialled with TLS: write tls://HOST:PORT (and start that worker with --tls-dir)")
        if not c.tls and scheme == "tls":
            raise ConfigError(
                f"placement.workers[{i}]={address!r} is a TLS address: set placement.tls to the "
                "job's certificate folder (python -m torchtitan_rl.tls makes one)")
    if c.tls:
        tls_files(c.tls, "client", key="placement.tls")


def beyond_this_machine(address: str) -> bool:
    """Not a loopback address (0.0.0.0 binds every interface: beyond too)."""
    host = urllib.parse.urlsplit(address).hostname or ""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a host name: another machine, or at least reachable as one


def warn_plain(c: Any) -> None:
    """One warning line per process and kind: hosts served over plain TCP accept any client that
    reaches them, and a client that attaches can run code as the worker's user."""
    if c.kind == "attach":
        plain = [a for a in c.workers
                 if urllib.parse.urlsplit(a).scheme == "tcp" and beyond_this_machine(a)]
        if not plain:
            return
        what = f"placement.workers {', '.join(plain)} are plain tcp"
    elif c.kind in ("slurm", "kubernetes"):
        what = (f"placement.kind={c.kind}: Monarch 0.6.0 serves these workers over plain tcp "
                "(no TLS possible)")
    else:
        return
    if c.kind in _warned:
        return
    _warned.add(c.kind)
    logger.warning("%s: anyone who reaches those ports can run code as the workers' user; on a "
                   "network you do not trust, use placement.kind = \"attach\" with placement.tls "
                   "(docs/scaling.md, Mutual TLS)", what)


def use_client_tls(c: Any) -> None:
    """This process dials with the client certificate of ``placement.tls``, and a worker that does
    not accept it fails the attach within ``host_timeout_s`` instead of Monarch's default
    minute."""
    # 0.9: Monarch's error (it names the host) ends the wait before placement's own deadline.
    os.environ[ATTACH_TIMEOUT_ENV] = f"{max(1, round(c.host_timeout_s * 900))}ms"
    if c.tls:
        apply_monarch_tls(tls_files(c.tls, "client", key="placement.tls"))
    else:
        from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env

        reload_config_from_env()


_HOST_IN_ERROR = re.compile(r"\btls:([^\s:]+):(\d+)")


def rejected(error: BaseException | None, c: Any, addresses: list[str]) -> str:
    """The one line for TLS workers that did not take the run: the addresses Monarch's error
    names (else ``addresses``, the mesh's workers) and the likely causes."""
    named = [f"tls://{host}:{port}" for host, port in _HOST_IN_ERROR.findall(str(error or ""))]
    failed = [a for a in addresses if a in named] or addresses
    keys = ", ".join(f"placement.workers[{c.workers.index(a)}] {a}" for a in failed)
    hosts = ", ".join(sorted({urllib.parse.urlsplit(a).hostname or a for a in failed}))
    # Short: the console's error line is ~300 characters with the log file's path.
    return (f"{keys}: no TLS session after {c.host_timeout_s:g} s: wrong CA (not placement.tls's "
            f"job), worker certificate omits {hosts}, or no TLS worker there")
