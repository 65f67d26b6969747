"""A process's data-plane identity (issue #29): an Ed25519 key pair and a self-signed certificate for it.

The identity is the key, not the certificate: its fingerprint is the SHA-256 of the public key's
SubjectPublicKeyInfo (DER), so a certificate renewed for the same key is the same identity and a new key is a new
one. Nodes publish the fingerprint in their advertisement (and pin it into their endpoint, ``bus.tls``); a peer only
accepts the key the registry names for a node id.

Created on first start under the process's home (key 0600), or given as files (a fleet's own keys, or a CA-issued
certificate: then the fleet's CA vouches for it instead of the registry alone).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from schemas.settings import Settings

log = logging.getLogger(__name__)

VALID_DAYS = 365
RENEW_DAYS = 30
"""A self-signed certificate this close to its end is issued again for the same key at start."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """Key and certificate on disk (``ssl`` loads files) and the key's fingerprint."""

    key_file: Path
    cert_file: Path
    fingerprint: str
    cert_pem: str


def fingerprint_of(certificate: x509.Certificate) -> str:
    """Hex SHA-256 of the certificate's SubjectPublicKeyInfo: names the key, whatever certificate carries it."""
    spki = certificate.public_key().public_bytes(serialization.Encoding.DER,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(spki).hexdigest()


def fingerprint_of_der(der: bytes) -> str:
    return fingerprint_of(x509.load_der_x509_certificate(der))


def load_or_create(directory: Path, name: str) -> Identity:
    """``<directory>/<name>.key`` and ``.crt``: read, or created (the key 0600, its directory 0700) when absent;
    a self-signed certificate near its end is renewed for the same key."""
    key_file, cert_file = directory / f"{name}.key", directory / f"{name}.crt"
    if not key_file.exists():
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = ed25519.Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        log.info("created a new data-plane identity key at %s", key_file)
    mode = key_file.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(f"{key_file} is readable by others (mode {mode:o}): chmod 600 it")
    key = _load_key(key_file)
    if not cert_file.exists() or _needs_renewal(x509.load_pem_x509_certificate(cert_file.read_bytes()), key):
        cert_file.write_bytes(self_signed(key, name).public_bytes(serialization.Encoding.PEM))
    return from_files(cert_file, key_file)


class IdentityError(ValueError):
    """A given key or certificate that cannot serve as this process's identity: missing, unreadable, not PEM, readable
    by others, or not one pair. The message names the file."""


def from_files(cert_file: Path, key_file: Path) -> Identity:
    """An identity given by the operator (fleet file, or a CA-issued certificate), checked now rather than at the
    first handshake (where ``ssl`` would only say ``PEM lib``): both files readable, the key private to its owner,
    and the certificate the key's."""
    pem = _read(cert_file, "certificate")
    try:
        certificate = x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise IdentityError(f"{cert_file} is not a PEM certificate") from None
    key_pem = _read(key_file, "key")
    mode = key_file.stat().st_mode & 0o777
    if mode & 0o077:
        raise IdentityError(f"{key_file} is readable by others (mode {mode:o}): chmod 600 it")
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise IdentityError(f"{key_file} is not an unencrypted PEM private key") from None
    if _spki(key.public_key()) != _spki(certificate.public_key()):
        raise IdentityError(f"{cert_file} is not the certificate of the key in {key_file}")
    return Identity(key_file=key_file, cert_file=cert_file, fingerprint=fingerprint_of(certificate),
                    cert_pem=pem.decode())


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise IdentityError(f"cannot read the {what} {path}: {exc.strerror}") from None


def _spki(public: Any) -> bytes:
    data: bytes = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return data


def identity_from_settings(settings: Settings, name: str) -> Identity:
    """The fleet file's key and certificate, or this process's own under ``home``/identity."""
    if (settings.tls_cert_file is None) != (settings.tls_key_file is None):
        raise ValueError("tls_cert_file and tls_key_file go together: set both, or neither")
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        return from_files(settings.tls_cert_file, settings.tls_key_file)
    return load_or_create(settings.home / "identity", name)


def self_signed(key: ed25519.Ed25519PrivateKey, name: str, *, not_before: datetime.datetime | None = None,
                days: int = VALID_DAYS) -> x509.Certificate:
    """A certificate for ``key`` signed by itself, usable by a TLS server and a TLS client alike."""
    start = not_before or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])])
    public = key.public_key()
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, None))


def _load_key(path: Path) -> ed25519.Ed25519PrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def _needs_renewal(certificate: x509.Certificate, key: ed25519.Ed25519PrivateKey) -> bool:
    """A certificate for another key (the key file was replaced) or near its end."""
    same_key = fingerprint_of(certificate) == _fingerprint_of_key(key)
    left = certificate.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    return not same_key or left < datetime.timedelta(days=RENEW_DAYS)


def _fingerprint_of_key(key: ed25519.Ed25519PrivateKey) -> str:
    spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(spki).hexdigest()
