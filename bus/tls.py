"""TLS 1.3 with mutual authentication on the data plane, pinned to the registry (issue #29).

**Pins ride in the endpoint.** A node serving TLS advertises ``https://<fingerprint>@host:port``: every holder of an
endpoint (a route from the tracker, whose signed capabilities bind the endpoints; a standby reference; a link
probe's peers) thereby knows which key must answer there, with no other lookup. A client (``client_context``)
presents its own certificate and, before it writes a byte, checks the server's key against the endpoint's pin
(``check_pin``): OpenSSL has already verified that the server holds the key of the certificate it showed (TLS 1.3
CertificateVerify), the pin says it is the key the registry names.

**Servers require a client certificate** (``ServerTrust``): OpenSSL accepts one whose certificate is in the trust
store, which holds the registered nodes' certificates (from their advertisements), the trusted gateways' certificates
(a file: gateways are not in the registry) and, in a fleet with its own CA, that CA. After the handshake the
connection is admitted only if the key is one the registry names right now (or a trusted gateway's, or the fleet
CA issued it): a removed node's key is refused from then on, although its certificate stays in the store.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import re
import ssl
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpcore
import httpx
from cryptography import x509

from bus.identity import Identity, fingerprint_of, identity_from_settings
from schemas.settings import Settings

log = logging.getLogger(__name__)

_PIN = re.compile(r"^[0-9a-f]{64}$")

Pins = Callable[[str, int], str | None]
"""(host, port) -> the fingerprint that must answer there, or None if nobody named one."""


class PinError(ssl.SSLError):
    """The peer's key is not the one its endpoint names (or no key was named for a TLS endpoint). An ``OSError``,
    so every transport path treats it as a peer it cannot reach."""


def pin_endpoint(url: str, fingerprint: str) -> str:
    """``https://host:port`` with ``fingerprint`` as its pin."""
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"only an https://host:port endpoint carries a pin, got {url!r}")
    if not _PIN.match(fingerprint):
        raise ValueError(f"a pin is 64 lower-case hex digits (SHA-256), got {fingerprint!r}")
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, f"{fingerprint}@{host}", parts.path, parts.query, parts.fragment))


def split_pin(endpoint: str) -> tuple[str, str | None]:
    """(the endpoint without its pin, the pin or None). A user part that is not a pin is an error: it would
    otherwise turn into an Authorization header."""
    scheme, netloc, path, query, fragment = urlsplit(endpoint)
    user, at, host = netloc.rpartition("@")
    if not at:
        return endpoint, None
    if not _PIN.match(user):
        raise ValueError(f"endpoint {endpoint!r}: the part before @ must be a key fingerprint (64 hex digits)")
    return urlunsplit((scheme, host, path, query, fragment)), user


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def client_context(identity: Identity, ca_file: Path | None = None) -> ssl.SSLContext:
    """TLS 1.3 only, presenting ``identity``. Without a fleet CA the server's certificate is not checked by OpenSSL
    (it is self-signed): ``check_pin`` is the check, and no request goes out before it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # nodes are named by key, not by host name
    if ca_file is not None:
        context.load_verify_locations(cafile=str(ca_file))
        context.verify_mode = ssl.CERT_REQUIRED
    else:
        context.verify_mode = ssl.CERT_NONE
    context.load_cert_chain(str(identity.cert_file), str(identity.key_file))
    return context


def client_from_settings(settings: Settings, name: str) -> ssl.SSLContext | None:
    """The client context of a process named ``name`` (its identity created on first use), None with TLS off."""
    if settings.tls == "off":
        return None
    return client_context(identity_from_settings(settings, name), settings.tls_ca_file)


def gateway_context(settings: Settings, host: str) -> ssl.SSLContext | None:
    """The gateway's HTTPS for its clients: the operator's certificate, or off loopback (``tls`` not ``off``) its
    own self-signed one, whose fingerprint the log names for clients to pin. None: plain HTTP (loopback, or
    ``tls = off``, warned about off loopback)."""
    cert, key = settings.gateway_tls_cert_file, settings.gateway_tls_key_file
    if (cert is None) != (key is None):
        raise ValueError("gateway_tls_cert_file and gateway_tls_key_file go together: set both, or neither")
    if cert is None or key is None:
        if is_loopback(host) or settings.tls == "off":
            if not is_loopback(host):
                log.warning("the gateway serves plain HTTP on %s (tls = off): prompts, completions and API keys "
                            "cross the network in clear; put a TLS terminating proxy in front", host)
            return None
        identity = identity_from_settings(settings, settings.member_name or "gateway")
        cert, key = identity.cert_file, identity.key_file
        log.warning("the gateway on %s serves HTTPS with its self-signed certificate (key fingerprint %s): give "
                    "it gateway_tls_cert_file/_key_file, or set tls = off behind a TLS terminating proxy", host,
                    identity.fingerprint)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # OpenAI clients and browsers, not only our own
    context.load_cert_chain(str(cert), str(key))
    return context


def check_pin(ssl_object: Any, expected: str | None, *, where: str) -> str:
    """The peer's fingerprint, if it is ``expected`` and its certificate is within its validity; ``PinError``
    otherwise (``ssl_object``: an ``ssl.SSLObject`` or ``SSLSocket``)."""
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise PinError(f"{where} showed no certificate")
    certificate = x509.load_der_x509_certificate(der)
    fingerprint = fingerprint_of(certificate)
    if expected is None:
        raise PinError(f"{where} speaks TLS but its endpoint names no key fingerprint to check it against")
    if fingerprint != expected:
        raise PinError(f"{where} answered with key {fingerprint[:16]}..., not the registered {expected[:16]}...")
    _check_validity(certificate, where)
    return fingerprint


def _check_validity(certificate: x509.Certificate, where: str) -> None:
    now = datetime.datetime.now(datetime.UTC)
    if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
        raise PinError(f"{where}'s certificate is not valid now (valid {certificate.not_valid_before_utc:%Y-%m-%d} "
                       f"to {certificate.not_valid_after_utc:%Y-%m-%d})")


class ServerTrust:
    """What a TLS server (a node) accepts: its ``context`` for the listening socket and ``admits`` for each
    connection after its handshake. ``register``/``forget`` follow the registry (any thread)."""

    def __init__(self, identity: Identity, *, ca_file: Path | None = None,
                 trusted_certs: Path | None = None) -> None:
        self.identity = identity
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_3
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.context.load_cert_chain(str(identity.cert_file), str(identity.key_file))
        self._lock = threading.Lock()
        self._stored: set[str] = set()
        self._static: set[str] = set()
        self._by_node: dict[str, str] = {}
        self._ca = ca_file is not None
        if ca_file is not None:
            self.context.load_verify_locations(cafile=str(ca_file))
        if trusted_certs is not None:
            for certificate in x509.load_pem_x509_certificates(trusted_certs.read_bytes()):
                self._store(certificate)
                self._static.add(fingerprint_of(certificate))
        self._static.add(identity.fingerprint)  # a node's own probes and loops back to itself
        self._store(x509.load_pem_x509_certificate(identity.cert_pem.encode()))

    def _store(self, certificate: x509.Certificate) -> None:
        fingerprint = fingerprint_of(certificate)
        if fingerprint not in self._stored:
            from cryptography.hazmat.primitives.serialization import Encoding

            self.context.load_verify_locations(cadata=certificate.public_bytes(Encoding.DER))
            self._stored.add(fingerprint)

    def register(self, node_id: str, fingerprint: str, cert_pem: str) -> bool:
        """A node's advertised key. Refused (False, logged) when the certificate is not for that fingerprint or
        another live node already holds the fingerprint: a node cannot borrow another's identity."""
        try:
            certificate = x509.load_pem_x509_certificate(cert_pem.encode())
        except ValueError:
            log.warning("node %s advertises an unreadable certificate: not admitted", node_id)
            return False
        if fingerprint_of(certificate) != fingerprint:
            log.warning("node %s advertises fingerprint %s... with a certificate for another key: not admitted",
                        node_id, fingerprint[:16])
            return False
        with self._lock:
            holder = next((n for n, fp in self._by_node.items() if fp == fingerprint and n != node_id), None)
            if holder is not None:
                log.warning("node %s advertises the key of node %s: not admitted", node_id, holder)
                return False
            self._store(certificate)
            self._by_node[node_id] = fingerprint
        return True

    def forget(self, node_id: str) -> None:
        with self._lock:
            self._by_node.pop(node_id, None)

    def retain(self, node_ids: Iterable[str]) -> None:
        """Forget every node not in ``node_ids`` (the registry's live nodes)."""
        keep = set(node_ids)
        with self._lock:
            for node_id in [n for n in self._by_node if n not in keep]:
                del self._by_node[node_id]

    def admits_fingerprint(self, fingerprint: str) -> bool:
        """Whether a key is admitted now, by name (a fleet CA's other certificates aside)."""
        with self._lock:
            return fingerprint in self._static or fingerprint in self._by_node.values()

    def admits(self, ssl_object: Any) -> bool:
        """A connection whose handshake OpenSSL completed: its key is registered now, a trusted gateway's, or the
        fleet CA issued its certificate (OpenSSL checked that chain)."""
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if not der:
            return False
        certificate = x509.load_der_x509_certificate(der)
        named = self.admits_fingerprint(fingerprint_of(certificate))
        return named or (self._ca and certificate.issuer != certificate.subject)


# ---- httpx (control requests) with pins ------------------------------------------------------------------------


class _PinnedStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream, host: str, port: int, pins: Pins) -> None:
        self._inner = inner
        self._where = f"{host}:{port}"
        self._pin = pins(host, port)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.start_tls(ssl_context, server_hostname, timeout)
        try:
            check_pin(stream.get_extra_info("ssl_object"), self._pin, where=self._where)
        except PinError as exc:
            await stream.aclose()
            raise httpcore.ConnectError(str(exc)) from None
        return stream

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _PinningBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, pins: Pins) -> None:
        self._inner = httpcore.AnyIOBackend()
        self._pins = pins

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _PinnedStream(stream, host, port, self._pins)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class PinnedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport, whose TLS connections are checked against ``pins`` before the first request goes out."""

    def __init__(self, context: ssl.SSLContext, pins: Pins, *, limits: httpx.Limits | None = None,
                 socket_options: Iterable[Any] | None = None) -> None:
        limits = limits or httpx.Limits(max_connections=100, max_keepalive_connections=20)  # httpx's defaults
        super().__init__(verify=context, limits=limits)
        # httpx takes no network backend; its pool does (the pool is what httpx itself would have built).
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context, max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
            socket_options=socket_options, network_backend=_PinningBackend(pins))


class PinTable:
    """Pins by (host, port), learnt from the endpoints a client is handed (``url`` strips and records them)."""

    def __init__(self) -> None:
        self._pins: dict[tuple[str, int], str] = {}

    def url(self, endpoint: str) -> str:
        bare, pin = split_pin(endpoint)
        if pin is not None:
            parts = urlsplit(bare)
            if parts.hostname:
                self._pins[(parts.hostname, parts.port or 443)] = pin
        return bare

    def __call__(self, host: str, port: int) -> str | None:
        return self._pins.get((host.strip("[]"), port))
