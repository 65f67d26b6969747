"""Connecting to NATS with optional credentials, with reconnects on so a NATS server restart is survived."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator
from typing import Any

import nats
from nats.aio.client import Client as NATS

from schemas.settings import Settings

log = logging.getLogger(__name__)


def keep_cancellation() -> None:
    """Call after awaiting a nats.py publish or request: re-raise a cancellation that was lost on the way.

    A request waits with ``asyncio.wait_for``, which on Python 3.11 returns the reply and drops the cancellation
    when both arrive in the same loop turn; ``Client._flush_pending`` catches ``CancelledError`` outright
    (nats-py 2.16). Either way the task goes on as if it was never cancelled: a loop cancelled that way runs on,
    and whoever awaits its end (a session's ``close()``) waits for good.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def connect(
    url: str,
    *,
    name: str,
    user: str | None = None,
    password: str | None = None,
    token: str | None = None,
    creds: str | None = None,
    connect_timeout: float = 5.0,
    inbox_prefix: str = "_INBOX",
    randomize: bool = True,
    tls: ssl.SSLContext | None = None,
) -> NATS:
    """Connect to one or more comma-separated NATS URLs; credentials are passed through and never logged."""
    servers = [u.strip() for u in url.split(",") if u.strip()]

    async def on_error(exc: Exception) -> None:
        # Only a permissions violation's text is logged (it names the refused subject); other errors may quote
        # a server URL, which can embed credentials.
        text = str(exc)
        shown = text if "permissions violation" in text.lower() else type(exc).__name__
        log.warning("nats error (%s): %s", name, shown)

    async def on_disconnect() -> None:
        log.info("nats disconnected (%s)", name)

    async def on_reconnect() -> None:
        log.info("nats reconnected (%s)", name)

    options: dict[str, Any] = dict(
        servers=servers, name=name, connect_timeout=connect_timeout, allow_reconnect=True,
        max_reconnect_attempts=-1, reconnect_time_wait=0.5, error_cb=on_error,
        disconnected_cb=on_disconnect, reconnected_cb=on_reconnect, inbox_prefix=inbox_prefix,
        dont_randomize=not randomize,
    )
    if user is not None:
        options.update(user=user, password=password)
    if token is not None:
        options["token"] = token
    if creds is not None:
        options["user_credentials"] = creds
    if tls is not None:
        options["tls"] = tls
    return await nats.connect(**options)


async def connect_settings(settings: Settings, *, name: str) -> NATS:
    return await connect(
        settings.nats_url,
        name=name,
        user=settings.nats_user,
        password=settings.nats_password.get_secret_value() if settings.nats_password else None,
        token=settings.nats_token.get_secret_value() if settings.nats_token else None,
        creds=str(settings.nats_creds) if settings.nats_creds else None,
        inbox_prefix=settings.nats_inbox_prefix,
        randomize=settings.nats_randomize,
        tls=nats_context(settings),
    )


def nats_context(settings: Settings) -> ssl.SSLContext | None:
    """TLS to the NATS servers (issue #29) when a CA or a client certificate is configured: the servers'
    certificate checked against ``nats_tls_ca_file`` (or the system's CAs), host name included."""
    if settings.nats_tls_ca_file is None and settings.nats_tls_cert_file is None:
        return None
    context = ssl.create_default_context(cafile=str(settings.nats_tls_ca_file) if settings.nats_tls_ca_file else None)
    if settings.nats_tls_cert_file is not None:
        key = settings.nats_tls_key_file
        context.load_cert_chain(str(settings.nats_tls_cert_file), str(key) if key is not None else None)
    return context


@contextlib.asynccontextmanager
async def connected(settings: Settings, *, name: str) -> AsyncIterator[NATS]:
    """A connection for the length of a block, drained at its end: operators' tools (``watch``, ``fleet status``).
    An actor connects through ``bus.actor.NatsActor`` instead."""
    nc = await connect_settings(settings, name=name)
    try:
        yield nc
    finally:
        await nc.drain()
