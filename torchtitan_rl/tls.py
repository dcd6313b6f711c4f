"""Mutual TLS for ``placement.kind = "attach"``: a job's certificates, and Monarch's TLS settings.

    python -m torchtitan_rl.tls --out certs/ --hosts node0,node1,node2,10.0.0.5

makes, in ``certs/`` (the same folder serves every machine of the job):

    ca.crt                    the job's certificate authority (its private key is not kept)
    worker.crt, worker.key    the workers' certificate: ``python -m torchtitan_rl.worker --tls-dir``
    client.crt, client.key    the controller's certificate: ``placement.tls``

Both certificates are signed by the job's CA, name every ``--hosts`` entry as a subject
alternative name (IP addresses as IP SANs, names as DNS SANs) and are good for server and client
authentication: a worker checks that whoever attaches holds a certificate of this CA, the
controller checks the worker's certificate against the host it dials, and the procs a worker
spawns use the worker's certificate to answer the controller. Keys are written mode 0600;
existing files are never overwritten without ``--force``.

Monarch 0.6.0 takes TLS only through the ``tls://HOST:PORT`` transport and the environment
(``HYPERACTOR_TLS_CA`` / ``_CERT`` / ``_KEY``; its ``ca=`` arguments raise NotImplementedError):
``monarch_tls_env`` gives those variables for a folder and a role.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import ipaddress
import logging
import os
import pathlib
import sys

from torchtitan_rl.config.errors import ConfigError

logger = logging.getLogger(__name__)

CA_CERT = "ca.crt"
WORKER_CERT, WORKER_KEY = "worker.crt", "worker.key"
CLIENT_CERT, CLIENT_KEY = "client.crt", "client.key"
ROLES = {"worker": (WORKER_CERT, WORKER_KEY), "client": (CLIENT_CERT, CLIENT_KEY)}

ENV_CA, ENV_CERT, ENV_KEY = "HYPERACTOR_TLS_CA", "HYPERACTOR_TLS_CERT", "HYPERACTOR_TLS_KEY"

DEFAULT_DAYS = 30
"""A job's certificates expire: a stolen client key is not good forever."""


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """One role's three files in a TLS folder (all checked to exist)."""

    ca: pathlib.Path
    cert: pathlib.Path
    key: pathlib.Path

    def env(self) -> dict[str, str]:
        """Monarch's TLS variables, as absolute paths (the procs may run in another cwd)."""
        return {ENV_CA: str(self.ca.resolve()), ENV_CERT: str(self.cert.resolve()),
                ENV_KEY: str(self.key.resolve())}


def tls_files(folder: str | os.PathLike, role: str, *, key: str) -> TlsFiles:
    """The ``role`` ("worker" or "client") files of ``folder``; a missing one is a ConfigError
    naming ``key`` and the file."""
    root = pathlib.Path(folder).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{key}={str(folder)!r}: not a folder (make one with python -m "
                          f"torchtitan_rl.tls --out {folder} --hosts ...)")
    cert, private = ROLES[role]
    files = TlsFiles(ca=root / CA_CERT, cert=root / cert, key=root / private)
    for path in (files.ca, files.cert, files.key):
        if not path.is_file():
            raise ConfigError(f"{key}={str(folder)!r}: {path} is missing (the folder needs "
                              f"{CA_CERT}, {cert} and {private}; python -m torchtitan_rl.tls "
                              f"makes them)")
    return files


def apply_monarch_tls(files: TlsFiles) -> None:
    """Point this process's Monarch (and the procs it starts, which inherit the environment) at
    ``files``. Monarch reads its config from the environment at import: reload it."""
    os.environ.update(files.env())
    from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env

    reload_config_from_env()


# ---------------------------------------------------------------------------------------------
# Making a job's certificates (the `cryptography` package; no openssl command).

def _host_names(hosts: list[str]) -> list:
    from cryptography import x509

    names: list = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _certificate(subject: str, public_key, issuer, issuer_key, *, days: int, ca: bool,
                 hosts: list[str]):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder()
               .subject_name(name)
               .issuer_name(issuer or name)
               .public_key(public_key)
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))  # clock skew between hosts
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None),
                              critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key),
                              critical=False))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        builder = (builder
                   .add_extension(x509.KeyUsage(
                       digital_signature=True, key_encipherment=False, key_cert_sign=False,
                       crl_sign=False, content_commitment=False, data_encipherment=False,
                       key_agreement=True, encipher_only=False, decipher_only=False),
                       critical=True)
                   .add_extension(x509.ExtendedKeyUsage(
                       [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
                   .add_extension(x509.SubjectAlternativeName(_host_names(hosts)),
                                  critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                       issuer_key.public_key()), critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def make_certificates(out: str | os.PathLike, hosts: list[str], *, days: int = DEFAULT_DAYS,
                      force: bool = False) -> list[pathlib.Path]:
    """A new CA, a worker and a client certificate for ``hosts`` in ``out``; returns the files.
    An existing file is a FileExistsError naming it unless ``force``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not hosts:
        raise ValueError("--hosts: name at least one worker host (a name or an IP address)")
    root = pathlib.Path(out).expanduser()
    names = [CA_CERT, WORKER_CERT, WORKER_KEY, CLIENT_CERT, CLIENT_KEY]
    if not force:
        for name in names:
            if (root / name).exists():
                raise FileExistsError(f"{root / name} exists: not overwritten (pass --force to "
                                      "replace the folder's certificates)")
    root.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate("torchtitan_rl job CA", ca_key.public_key(), None, ca_key, days=days,
                           ca=True, hosts=[])
    pem = serialization.Encoding.PEM
    files = {CA_CERT: ca_cert.public_bytes(pem)}
    for role, (cert_name, key_name) in ROLES.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(f"torchtitan_rl {role}", key.public_key(), ca_cert.subject, ca_key,
                            days=days, ca=False, hosts=hosts)
        files[cert_name] = cert.public_bytes(pem)
        files[key_name] = key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption())
    written = []
    for name in names:
        path = root / name
        secret = name.endswith(".key")
        if force and path.exists():
            path.unlink()  # a new file: the mode below holds even for a replaced one
        # The key is created 0600 (never briefly world-readable); certificates are public.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(files[name])
        os.chmod(path, 0o600 if secret else 0o644)  # the umask may have narrowed 0644
        written.append(path)
    return written


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_rl.tls",
        description="Make a job's mutual-TLS certificates for placement.kind = 'attach': "
                    f"{CA_CERT}, {WORKER_CERT}/{WORKER_KEY} (workers: --tls-dir), "
                    f"{CLIENT_CERT}/{CLIENT_KEY} (the controller: placement.tls). "
                    "See docs/scaling.md, 'Mutual TLS'.")
    parser.add_argument("--out", required=True, help="the folder to write (made if missing)")
    parser.add_argument("--hosts", required=True,
                        help="comma-separated worker hosts as the controller dials them (names "
                             "and IP addresses), e.g. node1,node2,10.0.0.7")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS,
                        help=f"validity of the certificates (default {DEFAULT_DAYS})")
    parser.add_argument("--force", action="store_true", help="replace existing files")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if not hosts:
        parser.error("--hosts: name at least one worker host")
    if args.days < 1:
        parser.error(f"--days must be >= 1, got {args.days}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        written = make_certificates(args.out, hosts, days=args.days, force=args.force)
    except FileExistsError as e:
        parser.exit(1, f"error: {e}\n")
    logger.info("wrote %s (hosts %s, valid %d days)", ", ".join(str(p) for p in written),
                ",".join(hosts), args.days)


if __name__ == "__main__":
    cli()
