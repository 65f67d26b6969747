"""NATS over TLS in a fleet (issue #29): a real nats-server started with the shipped ``deploy/nats/tls.conf``, a
tracker, two nodes and a gateway connecting with ``tls://`` and the fleet's CA. The fleet serves, survives the NATS
server's restart (the registry comes back, requests route again), and a client without the CA is refused."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
from pathlib import Path

import nats
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bus.connection import connect, nats_context
from bus.server import EmbeddedNats, NatsServerConfig, wait_port_free
from tests.support.swarm import Swarms, make_settings, stub
from tests.support.waiting import eventually

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "nats"
MODEL = "stub-model"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 it signed: (ca, cert, key) PEM files."""
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("fleet ca")).issuer_name(_name("fleet ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("nats")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = directory / "ca.crt", directory / "nats.crt", directory / "nats.key"
    files[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return files


@pytest.fixture
def tls_nats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[NatsServerConfig, Path]:
    ca, cert, key = make_ca(tmp_path)
    monkeypatch.setenv("NATS_TLS_CERT", str(cert))
    monkeypatch.setenv("NATS_TLS_KEY", str(key))
    monkeypatch.setenv("NATS_TLS_CA", str(ca))
    conf = tmp_path / "server.conf"
    (tmp_path / "tls.conf").write_text((DEPLOY / "tls.conf").read_text())  # includes are relative to the config
    conf.write_text("include ./tls.conf\n")
    with socket.socket() as probe:  # a fixed port: the restarted server comes back on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return NatsServerConfig(store_dir=tmp_path / "js", config_file=conf, port=port), ca


async def test_a_fleet_on_nats_over_tls_serves_and_survives_a_nats_restart(
        tls_nats: tuple[NatsServerConfig, Path], tmp_path: Path) -> None:
    config, ca = tls_nats
    server = await asyncio.to_thread(EmbeddedNats(config).start)
    try:
        url = f"tls://127.0.0.1:{config.port}"
        with pytest.raises(ssl.SSLCertVerificationError):  # without the CA the server's certificate is refused
            await nats.connect(url, name="untrusting", connect_timeout=2.0, allow_reconnect=False)
        settings = make_settings(url, tmp_path / "home", nats_tls_ca_file=ca)
        trusting = await connect(url, name="trusting", tls=nats_context(settings))
        await trusting.close()
        async with Swarms() as swarms:
            swarm = await swarms.start(settings, [stub(0, 4), stub(4, 8)], model_id=MODEL)
            client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
            first = await client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0,
                                                    extra_body={"ignore_eos": True})
            assert first.usage is not None and first.usage.completion_tokens == 6
            server.kill()
            await asyncio.to_thread(wait_port_free, "127.0.0.1", config.port)
            server = await asyncio.to_thread(EmbeddedNats(config).start)

            async def served() -> bool:
                try:
                    again = await client.completions.create(model=MODEL, prompt="hello", max_tokens=6,
                                                            temperature=0, extra_body={"ignore_eos": True})
                except openai.APIStatusError:
                    return False  # the registry is still coming back
                return again.choices[0].text == first.choices[0].text

            await eventually(served, timeout=60.0, interval=0.5, what="the fleet serving again after the restart")
            assert all(node.nc.is_connected for node in swarm.nodes)
    finally:
        server.stop()
