"""Mutual TLS for attach placement: the certificate command (a chain that verifies, the hosts'
SANs, private keys 0600, nothing overwritten), a real TLS handshake with those files, the config
errors; and through the stack, a job trained on TLS workers and a client without the job's
certificates refused with one line and nothing spawned."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import pathlib
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import threading

import pytest

from tests.controller.jobs import (
    REPO_ROOT,
    TINY_MODEL_BYTES,
    on_stand_in_engines,
    read_metrics,
    tiny_job,
)
from torchtitan_rl import tls
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.hosts import attach_tls
from torchtitan_rl.controller.hosts.placement import Placement


def _load(folder: pathlib.Path, name: str):
    from cryptography import x509

    return x509.load_pem_x509_certificate((folder / name).read_bytes())


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("tls") / "job"
    tls.make_certificates(out, ["127.0.0.1", "node1.example", "::1"])
    return out


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("tls") / "other"
    tls.make_certificates(out, ["127.0.0.1"])
    return out


# --- the certificate command ---------------------------------------------------------------

def test_certificates_chain_to_the_job_ca_and_name_the_hosts(certs, other_certs):
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca = _load(certs, tls.CA_CERT)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name in (tls.WORKER_CERT, tls.CLIENT_CERT):
        cert = _load(certs, name)
        cert.verify_directly_issued_by(ca)  # raises if the signature or issuer is wrong
        with pytest.raises(InvalidSignature):  # another job's CA (same name, other key)
            cert.verify_directly_issued_by(_load(other_certs, tls.CA_CERT))
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.IPAddress) == [
            ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
        assert sans.get_values_for_type(x509.DNSName) == ["node1.example"]
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
    assert not (certs / "ca.key").exists()  # nobody can mint more certificates of this CA


def test_keys_are_private_and_certificates_readable(certs):
    for name in (tls.WORKER_KEY, tls.CLIENT_KEY):
        assert stat.S_IMODE((certs / name).stat().st_mode) == 0o600, name
    for name in (tls.CA_CERT, tls.WORKER_CERT, tls.CLIENT_CERT):
        assert stat.S_IMODE((certs / name).stat().st_mode) == 0o644, name


def test_the_command_never_overwrites_without_force(tmp_path, capsys):
    out = tmp_path / "certs"
    tls.cli(["--out", str(out), "--hosts", "127.0.0.1"])
    before = (out / tls.CA_CERT).read_bytes()
    with pytest.raises(SystemExit) as e:
        tls.cli(["--out", str(out), "--hosts", "127.0.0.1"])
    assert e.value.code == 1
    assert f"{out / tls.CA_CERT} exists: not overwritten" in capsys.readouterr().err
    assert (out / tls.CA_CERT).read_bytes() == before
    tls.cli(["--out", str(out), "--hosts", "127.0.0.1", "--force"])
    assert (out / tls.CA_CERT).read_bytes() != before
    assert stat.S_IMODE((out / tls.CLIENT_KEY).stat().st_mode) == 0o600


def _handshake(server_dir: pathlib.Path, client_dir: pathlib.Path | None,
               host: str = "127.0.0.1") -> bool:
    """A TLS handshake as Monarch does it: the server demands a client certificate of its CA,
    the client checks the server's certificate against ``host``. True when both sides agree."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(server_dir / tls.WORKER_CERT, server_dir / tls.WORKER_KEY)
    server_ctx.load_verify_locations(server_dir / tls.CA_CERT)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.load_verify_locations((client_dir or server_dir) / tls.CA_CERT)
    if client_dir is not None:
        client_ctx.load_cert_chain(client_dir / tls.CLIENT_CERT, client_dir / tls.CLIENT_KEY)
    listener = socket.create_server(("127.0.0.1", 0))
    result: dict[str, str] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as s:
                s.recv(1)  # TLS 1.3 checks the client certificate after the client's finish
                result["server"] = "ok"
        except (ssl.SSLError, OSError) as e:
            result["server"] = type(e).__name__

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as raw:
            with client_ctx.wrap_socket(raw, server_hostname=host) as s:
                s.sendall(b"x")
                s.recv(1)  # the server's alert, if it rejects us
    except (ssl.SSLError, OSError) as e:
        result["client"] = type(e).__name__
    thread.join(timeout=10)
    listener.close()
    return result.get("server") == "ok" and "client" not in result


def test_job_certificates_make_a_mutual_tls_session(certs, other_certs):
    assert _handshake(certs, certs)
    assert _handshake(certs, certs, host="node1.example")
    assert not _handshake(certs, other_certs)  # another job's CA
    assert not _handshake(certs, None)  # no client certificate
    assert not _handshake(certs, certs, host="10.9.9.9")  # a host the certificate omits


# --- config errors and warnings -------------------------------------------------------------

def _config(**kwargs) -> Placement.Config:
    return Placement.Config(kind="attach", **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(workers=["tls://a:1", "tcp://b:2"], tls="CERTS"),
     "placement.workers[1]='tcp://b:2': placement.tls is set, so every worker is dialled with "
     "TLS"),
    (dict(workers=["tls://a:1", "tls://b:2"]),
     "placement.workers[0]='tls://a:1' is a TLS address: set placement.tls"),
    (dict(workers=["tls://a:1", "tls://b"], tls="CERTS"),
     "placement.workers[1]='tls://b': write tls://HOST:PORT"),
    (dict(workers=["tls://a:1", "tls://b:2"], tls="MISSING"),
     "placement.tls='MISSING': not a folder"),
    (dict(kind="process", tls="CERTS"), "placement.tls is for kind 'attach' (kind is 'process')"),
])
def test_tls_config_errors_name_the_key(kwargs, message, certs, tmp_path):
    kwargs = {k: (str(certs) if v == "CERTS" else str(tmp_path / "nope") if v == "MISSING"
                  else v) for k, v in kwargs.items()}
    message = message.replace("'MISSING'", repr(str(tmp_path / "nope")))
    placement = Placement.Config(**{"kind": "attach", **kwargs})
    with pytest.raises(ConfigError) as e:
        placement.check(num_generators=1, num_trainer_ranks=1)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_a_certificate_folder_without_the_client_key_is_named(certs, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in (tls.CA_CERT, tls.CLIENT_CERT):
        (partial / name).write_bytes((certs / name).read_bytes())
    placement = _config(workers=["tls://a:1", "tls://b:2"], tls=str(partial))
    with pytest.raises(ConfigError, match=f"placement.tls=.*{partial / tls.CLIENT_KEY} is "
                                          "missing"):
        placement.check(num_generators=1, num_trainer_ranks=1)
    _config(workers=["tls://a:1", "tls://b:2"], tls=str(certs)).check(
        num_generators=1, num_trainer_ranks=1)


def test_plain_tcp_beyond_this_machine_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(attach_tls, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl"):
        attach_tls.warn_plain(_config(workers=["tcp://127.0.0.1:1", "tcp://localhost:2"]))
        assert not caplog.records  # loopback: nobody else reaches it
        remote = _config(workers=["tcp://127.0.0.1:1", "tcp://node2:2"])
        attach_tls.warn_plain(remote)
        attach_tls.warn_plain(remote)
        attach_tls.warn_plain(_config(workers=["tls://node1:1", "tls://node2:2"], tls="x"))
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "tcp://node2:2" in line and "127.0.0.1" not in line and "placement.tls" in line
    assert "\n" not in line


def test_slurm_and_kubernetes_warn_that_they_are_plain_tcp(caplog, monkeypatch):
    monkeypatch.setattr(attach_tls, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl"):
        for kind in ("slurm", "kubernetes", "process", "local"):
            attach_tls.warn_plain(Placement.Config(kind=kind))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "placement.kind=slurm", "placement.kind=kubernetes"]


def test_a_rejection_names_the_workers_monarch_names():
    c = _config(workers=["tls://10.0.0.1:7", "tls://10.0.0.2:7"], tls="certs",
                host_timeout_s=5)
    error = RuntimeError("attach failed: config push failed during attach on 1 host(s):\n"
                         "  - tls:10.0.0.2:7: reply timed out after MESH_ATTACH_CONFIG_TIMEOUT")
    line = attach_tls.rejected(error, c, c.workers)
    assert line == ("placement.workers[1] tls://10.0.0.2:7: no TLS session after 5 s: wrong CA "
                    "(not placement.tls's job), worker certificate omits 10.0.0.2, or no TLS "
                    "worker there")
    assert "10.0.0.1" not in line and "\n" not in line
    assert attach_tls.rejected(None, c, c.workers[:1]).startswith(
        "placement.workers[0] tls://10.0.0.1:7:")


@pytest.mark.parametrize("argv, message", [
    (["--address", "tls://127.0.0.1:1"], "needs --tls-dir"),
    (["--address", "tcp://127.0.0.1:1", "--tls-dir", "CERTS"], "with --tls-dir, write tls://"),
    (["--address", "tls://0.0.0.0:1", "--tls-dir", "CERTS"], "no @ alias, no 0.0.0.0"),
    (["--address", "tls://n:1@tls://0.0.0.0:1", "--tls-dir", "CERTS"], "no @ alias"),
    (["--address", "tls://127.0.0.1:1", "--tls-dir", "MISSING"], "--tls-dir="),
])
def test_worker_command_errors(argv, message, certs, tmp_path, capsys):
    from torchtitan_rl import worker

    argv = [str(certs) if a == "CERTS" else str(tmp_path / "nope") if a == "MISSING" else a
            for a in argv]
    with pytest.raises(SystemExit) as e:
        worker.cli(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# --- through the stack ----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_tls_worker(address: str, tls_dir: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torchtitan_rl.worker", "--address", address,
         "--tls-dir", str(tls_dir)],
        cwd=REPO_ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)


def _stop(worker: subprocess.Popen) -> None:
    try:
        os.killpg(worker.pid, 9)
    except ProcessLookupError:
        pass
    worker.wait(timeout=60)


@pytest.fixture
def restored_monarch_env():
    """The run sets Monarch's TLS variables in this (pytest) process: put them back after."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    from monarch._rust_bindings.monarch_hyperactor.config import (
        reload_config_from_env,
        reset_config_to_defaults,
    )

    reset_config_to_defaults()  # a reload alone keeps the values of variables now unset
    reload_config_from_env()


@pytest.mark.slow
def test_job_attached_to_tls_workers_trains(tmp_path, certs, restored_monarch_env):
    from torchtitan_rl.train import main

    addresses = [f"tls://127.0.0.1:{_free_port()}" for _ in range(2)]
    workers = [_start_tls_worker(address, certs) for address in addresses]
    try:
        # The stand-in engine: the transport is the subject (a job on real vLLM attached to
        # workers is test_controller_placement's, over tcp).
        config = on_stand_in_engines(tiny_job(tmp_path, "tls", num_steps=2, max_staleness=1))
        config = dataclasses.replace(
            config,
            placement=Placement.Config(kind="attach", workers=addresses, tls=str(certs)),
            trainer=dataclasses.replace(config.trainer, weight_transport="message"))
        summary = main(config)
        assert all(worker.poll() is None for worker in workers)  # the run stopped procs only
    finally:
        for worker in workers:
            _stop(worker)
    assert summary["steps"] == 2
    metrics = read_metrics(tmp_path / "tls")
    for step in range(2):
        # The weights went from the trainer's host to the generator's over the TLS transport,
        # and every reply (rollouts, losses, metrics) came back to this controller over it.
        assert metrics[step]["weight_sync/generators_by_shared_memory"] == 0
        assert metrics[step]["weight_sync/bytes_moved"] == TINY_MODEL_BYTES
        assert "rollout_reward/mean" in metrics[step] and "loss/value" in metrics[step]


@pytest.mark.slow
@pytest.mark.parametrize("client", ["another job's certificates", "no certificates"])
def test_a_client_without_the_job_certificates_is_refused_and_spawns_nothing(
        tmp_path, certs, other_certs, client):
    import psutil

    address = f"tls://127.0.0.1:{_free_port()}"
    generator_address = f"tls://127.0.0.1:{_free_port()}"
    worker = _start_tls_worker(address, certs)
    if client == "no certificates":  # plain tcp to the TLS port: no certificate to show
        dial = [address.replace("tls://", "tcp://"), generator_address.replace("tls://", "tcp://")]
        tls_args: list[str] = []
    else:
        dial = [address, generator_address]
        tls_args = ["--placement.tls", str(other_certs)]
    generator_worker = _start_tls_worker(generator_address, certs)
    # A short output folder: the error line ends with the log file's path and is clipped to one
    # line's length, so pytest's deep temp paths would clip the message under test.
    output_dir = tempfile.mkdtemp(prefix="ttrl")
    try:
        before = {p.pid for p in psutil.Process(worker.pid).children(recursive=True)}
        proc = subprocess.run(
            [sys.executable, "-m", "torchtitan_rl.train",
             "--config", "tests/controller/tiny_letter_job.toml", "--output_dir", output_dir,
             "--placement.kind", "attach", "--placement.workers", ",".join(dial),
             "--placement.host_timeout_s", "5", *tls_args],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        after = {p.pid for p in psutil.Process(worker.pid).children(recursive=True)}
        assert worker.poll() is None and generator_worker.poll() is None  # still serving
    finally:
        _stop(worker)
        _stop(generator_worker)
        shutil.rmtree(output_dir, ignore_errors=True)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "HostUnreachableError" in errors[0] and "placement" in errors[0], errors[0]
    if client == "another job's certificates":
        assert f"placement.workers[0] {address}: no TLS session after 5 s: wrong CA" \
            in errors[0] and "or no TLS worker there" in errors[0], errors[0]
    assert after == before  # nothing was spawned on the worker
