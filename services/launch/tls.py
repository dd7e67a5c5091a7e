"""TLS material for NATS and Redis across hosts: a private CA and one server certificate.

A TLS folder (mode 0700; the key 0600) holds

    ca.pem           the CA certificate every client verifies the servers against
                     (`--nats-tls-ca-file`, `--redis-tls-ca-file`)
    server.pem       the servers' certificate, signed by the CA, for the names in `hosts`
    server-key.pem   its private key (nats-server `tls { key_file }`, redis `--tls-key-file`)

`make_tls` makes one with the `openssl` binary (no Python dependency): `up --tls` at every
start, in its work directory; `hicache-mesh credentials DIR --tls-hosts ...` in `DIR/tls`.
The CA's own key is thrown away once the server certificate is signed, so nobody can sign
another certificate with it: to rotate, make a new folder and restart everything with it.
Any other CA and certificate will do (`up --tls-dir DIR` with the three files).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bus_schemas.connection import tls_context

CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "server.pem", "server-key.pem"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1")
DAYS = 825  # the longest validity clients commonly accept for a server certificate


class TLSMaterialError(ValueError):
    """TLS files that cannot be used or made."""


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """The files a TLS server needs, and the CA its clients verify it with."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    @classmethod
    def from_dir(cls, root: Path) -> ServerTLS:
        """The three files in `root` (as `make_tls` leaves them); raises TLSMaterialError
        naming a missing one or a key others may read."""
        tls = cls(*(Path(root).resolve() / name for name in (CA_FILE, CERT_FILE, KEY_FILE)))
        for path in (tls.ca_file, tls.cert_file, tls.key_file):
            if not path.is_file():
                raise TLSMaterialError(f"TLS folder {root}: no {path.name}")
        mode = tls.key_file.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TLSMaterialError(
                f"TLS key {tls.key_file} is mode {stat.S_IMODE(mode):04o}: others may read it "
                "(chmod 600 it)"
            )
        tls_context(tls.ca_file)  # TLSConfigError (a ValueError) when it is no CA file
        return tls


def _san(hosts: Sequence[str]) -> str:
    names = []
    for host in hosts:
        host = host.strip()
        if not host or (any(c in host for c in ",:/ \t\n") and not _is_ip(host)):
            raise TLSMaterialError(f"bad TLS host name {host!r}")
        names.append(f"IP:{host}" if _is_ip(host) else f"DNS:{host}")
    if not names:
        raise TLSMaterialError("no host name for the server certificate")
    return ",".join(names)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _openssl() -> str:
    found = shutil.which("openssl")
    if found is None:
        raise TLSMaterialError(
            "making TLS certificates needs the `openssl` binary (apt-get install openssl); "
            "or give your own CA and certificate: --tls-dir DIR with ca.pem, server.pem, "
            "server-key.pem"
        )
    return found


def make_tls(root: Path, hosts: Sequence[str] = LOOPBACK_HOSTS, days: int = DAYS) -> ServerTLS:
    """A fresh CA and a server certificate for `hosts` (names or IP addresses) in `root`
    (created 0700; existing files are replaced). EC P-256 keys."""
    san = _san(hosts)
    openssl = _openssl()
    root = Path(root)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    with tempfile.TemporaryDirectory(prefix="hicache-ca-") as tmp:
        work = Path(tmp)  # 0700: the CA key and the request live here, then go
        ca_key, csr, ext = work / "ca-key.pem", work / "server.csr", work / "server.ext"
        ext.write_text(
            f"subjectAltName={san}\n"
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"  # clientAuth: NATS cluster routes (mutual TLS)
            "subjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid\n"
        )
        ca, cert, key = root / CA_FILE, root / CERT_FILE, root / KEY_FILE
        key.unlink(missing_ok=True)  # openssl keeps an existing file's mode
        serial = "0x" + secrets.token_hex(16)
        ca_ext = ("basicConstraints=critical,CA:TRUE", "keyUsage=critical,keyCertSign,cRLSign")
        steps = [
            [openssl, "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days",
             str(days), "-subj", "/CN=hicache-mesh private CA", "-addext", ca_ext[0],
             "-addext", ca_ext[1]],
            [openssl, "req", *ec, "-keyout", str(key), "-out", str(csr), "-subj",
             "/CN=hicache-mesh server"],
            [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-set_serial", serial, "-days", str(days), "-extfile", str(ext), "-out", str(cert)],
        ]  # fmt: skip
        old_umask = os.umask(0o077)  # the key is never readable by others, not even briefly
        try:
            for argv in steps:
                done = subprocess.run(argv, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise TLSMaterialError(f"openssl failed: {done.stderr.strip()[-500:]}")
        finally:
            os.umask(old_umask)
    os.chmod(key, 0o600)
    for public in (ca, cert):
        os.chmod(public, 0o644)
    return ServerTLS.from_dir(root)


def nats_tls_block(tls: ServerTLS) -> str:
    """The nats-server config `tls` block: clients must speak TLS (no client certificates:
    they authenticate with their users and passwords)."""

    def q(path: Path) -> str:
        text = str(path)
        if any(c in text for c in '"\\\n'):
            raise TLSMaterialError(f"a TLS file path with a quote, backslash or newline: {text}")
        return f'"{text}"'

    return f"tls {{\n  cert_file: {q(tls.cert_file)}\n  key_file: {q(tls.key_file)}\n  timeout: 5\n}}\n"


def redis_tls_argv(tls: ServerTLS, port: int) -> list[str]:
    """redis-server flags: TLS only on `port` (the plain port off), no client certificates."""
    return [
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(tls.cert_file),
        "--tls-key-file",
        str(tls.key_file),
        "--tls-ca-cert-file",
        str(tls.ca_file),
        "--tls-auth-clients",
        "no",
    ]
