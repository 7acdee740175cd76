"""Certificates for a Ray cluster with TLS on, made on the spot: a self-signed CA and a node certificate it signs.

Ray encrypts its traffic, and dsgd's streams theirs (``dsgd.transport.tls``),
when every process of the cluster has ``RAY_USE_TLS=1`` and the three files
in its environment (what ``make`` returns). One certificate serves every
node: it names their addresses (as IP addresses, and as DNS names as Ray's
own test certificates do), for a peer that checks them. EC P-256 keys, quick
to make. Needs the ``cryptography`` package (the test and bench extras).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dsgd.transport import tls

VALID_DAYS = 2


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, mode: int = 0o644) -> str:
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def make(directory: str | Path, addresses: Sequence[str] = ("127.0.0.1",)) -> dict[str, str]:
    """A new CA (``ca.crt``) and a certificate it signs (``node.crt``, key ``node.key``) naming ``addresses`` and
    localhost, written in ``directory``; the environment variables that turn Ray's TLS on with them."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("dsgd test CA")).issuer_name(_name("dsgd test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), *(x509.DNSName(a) for a in addresses),
             *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses)]
    node = (x509.CertificateBuilder().subject_name(_name("dsgd test node")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return {
        tls.USE_TLS: "1",
        tls.CERT: _write(directory / "node.crt", node.public_bytes(pem)),
        tls.KEY: _write(directory / "node.key", key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                                  serialization.NoEncryption()), 0o600),
        tls.CA: _write(directory / "ca.crt", ca.public_bytes(pem)),
    }


def contexts(env: dict[str, str]) -> tls.Contexts:
    """Both ends' contexts of the files ``make`` wrote."""
    return tls.contexts(env[tls.CERT], env[tls.KEY], env[tls.CA])
