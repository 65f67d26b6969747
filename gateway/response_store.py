"""Background responses kept in NATS JetStream (issue #31): one stream per response, readable from any gateway.

A background response's stream (``<ns>_response_<session>``) captures three subjects of its session:

- ``<ns>.tokens.<session>``: what the head publishes anyway (``TokenEvent``\\s, ``RouteChanged``, the one
  ``SessionEnd``). The head is the actor that survives a gateway's death; JetStream keeps what it publishes, so no
  gateway has to be alive for the events to be retained.
- ``<ns>.responses.<session>.end``: an end a gateway found that the head cannot report (its own death), or a
  cancel whose head was gone (``append_end``, once per session by message id). Not the token subject: a gateway
  may not publish there (deploy/nats/auth.conf), so it can never forge the head's tokens.
- ``<ns>.responses.<session>.record``: the ``ResponseRecord`` the opening gateway writes once the head opened
  (request, prompt tokens, tool-call format, route): what a gateway needs to render the events.
- ``<ns>.client.<session>``: the head's "does my client still listen?" probes. JetStream answers a captured
  request with its publish ack, so while the stream exists the head always finds a listener and runs the session to
  its end, whichever gateways live (a chat stream, whose subject no stream captures, is cancelled by its head once
  its gateway is gone). The probes also keep the stream's last message fresh while a session runs.

Retention: a response is gone ``responses_retention_s`` after its stream's last message (``expired``); every gateway
deletes such streams (``sweep``), and a read of one past the window is a 404 even before the sweep ran.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import AsyncIterator

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api

from bus import codec
from bus.subjects import Subjects
from schemas.errors import NotFoundError, SwarmrouteError
from schemas.openai_responses import ResponseRecord
from schemas.session import TOKEN_SUBJECT_MESSAGES, RouteChanged, SessionEnd, TokenEvent
from schemas.settings import Settings

log = logging.getLogger(__name__)

StoredMessage = TokenEvent | SessionEnd | RouteChanged
"""What the token subject carries, in the order the stream holds it."""

CAUGHT_UP_S = 5.0
"""Longest a snapshot read waits for a message the stream already holds."""


class StoreUnavailableError(SwarmrouteError):
    """JetStream does not answer (not enabled on the server, or no meta leader): background mode cannot start."""

    status = 503
    code = "responses_store_unavailable"


class ResponseStore:
    """The JetStream side of background responses; one per gateway, on its NATS connection."""

    def __init__(self, nc: NATS, settings: Settings) -> None:
        self.js = nc.jetstream()
        self.subjects = Subjects(settings.namespace)
        self.retention_s = settings.responses_retention_s
        self.replicas = settings.responses_replicas

    def stream(self, session_id: str) -> str:
        return f"{self.subjects.namespace}_response_{session_id}"

    def record_subject(self, session_id: str) -> str:
        return f"{self.subjects.namespace}.responses.{session_id}.record"

    def end_subject(self, session_id: str) -> str:
        return f"{self.subjects.namespace}.responses.{session_id}.end"

    def _read(self, session_id: str) -> list[str]:
        """What a reader consumes, interleaved in stream order: the head's messages and a gateway's end."""
        return [self.subjects.tokens(session_id), self.end_subject(session_id)]

    async def create(self, session_id: str) -> None:
        """The response's stream, before its session opens: the head's first event is captured."""
        config = api.StreamConfig(
            name=self.stream(session_id), description="swarmroute background response (issue #31)",
            subjects=[*self._read(session_id), self.subjects.client(session_id), self.record_subject(session_id)],
            retention=api.RetentionPolicy.LIMITS, storage=api.StorageType.FILE, num_replicas=self.replicas,
            discard=api.DiscardPolicy.OLD, duplicate_window=min(self.retention_s, 120.0))
        try:
            await self.js.add_stream(config)
        except (nats.js.errors.Error, nats.errors.Error) as exc:
            raise StoreUnavailableError(f"background responses need JetStream on the NATS server, which did not "
                                        f"create the response's stream: {exc}") from exc

    async def delete(self, session_id: str) -> None:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_stream(self.stream(session_id))

    async def put_record(self, record: ResponseRecord) -> None:
        await self.js.publish(self.record_subject(record.session_id), codec.encode(record),
                              stream=self.stream(record.session_id))

    async def record(self, session_id: str, response_id: str) -> ResponseRecord:
        """The response's record; a ``NotFoundError`` if there is none, or it is past the retention window."""
        missing = NotFoundError(f"No response found with id '{response_id}'", param="response_id",
                                code="response_not_found")
        name = self.stream(session_id)
        try:
            if await self.expired(name):
                await self.delete(session_id)
                raise missing
            raw = await self.js.get_last_msg(name, self.record_subject(session_id))
        except nats.js.errors.NotFoundError:
            raise missing from None
        return codec.decode(raw.data or b"", ResponseRecord)

    async def expired(self, name: str) -> bool:
        """Whether a response's stream saw its last message longer than the retention window ago (raises
        ``nats.js.errors.NotFoundError`` when there is no such stream)."""
        info = await self.js.stream_info(name)
        if not info.state.last_seq:
            return False
        last = await self.js.get_msg(name, seq=info.state.last_seq)
        if last.time is None:
            return False
        age = datetime.datetime.now(datetime.UTC) - last.time
        return age.total_seconds() > self.retention_s

    async def append_end(self, end: SessionEnd) -> None:
        """An end the head could not publish (the gateway found it lost, or cancelled it while it was gone). Once
        per session whoever appends it: a reader stops at the first end the stream holds anyway."""
        with contextlib.suppress(nats.js.errors.Error, nats.errors.Error):
            await self.js.publish(self.end_subject(end.session_id), codec.encode(end),
                                  stream=self.stream(end.session_id), headers={"Nats-Msg-Id": f"end-{end.session_id}"})

    async def ended(self, session_id: str) -> bool:
        """Whether the stream holds the session's end (the head's or a gateway's)."""
        for subject in reversed(self._read(session_id)):
            try:
                raw = await self.js.get_last_msg(self.stream(session_id), subject)
            except nats.js.errors.NotFoundError:
                continue
            with contextlib.suppress(codec.DecodeError):
                if isinstance(_decode(raw.data or b""), SessionEnd):
                    return True
        return False

    async def messages(self, session_id: str, *, follow: bool, tick_s: float) -> AsyncIterator[StoredMessage | None]:
        """The session's token-subject messages from the first, in stream order (an ordered consumer: no gap, no
        duplicate). ``follow``: then every later one as it comes, with ``None`` every ``tick_s`` of silence; else
        only what the stream holds now."""
        name, subjects = self.stream(session_id), self._read(session_id)
        if not follow:
            info = await self.js.stream_info(name, subjects_filter=">")
            if not any((info.state.subjects or {}).get(s) for s in subjects):
                return
        sub = await self.js.subscribe(subjects[0], stream=name, ordered_consumer=True,
                                      config=api.ConsumerConfig(filter_subjects=subjects),
                                      deliver_policy=api.DeliverPolicy.ALL, inactive_threshold=max(30.0, tick_s * 4))
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=tick_s if follow else CAUGHT_UP_S)
                except nats.errors.TimeoutError:
                    if not follow:
                        raise
                    yield None
                    continue
                try:
                    yield _decode(msg.data)
                except codec.DecodeError as exc:
                    log.warning("response %s: undecodable message in its stream: %s", session_id, exc)
                if not follow and msg.metadata.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def sweep(self) -> int:
        """Delete every response stream past the retention window; how many were deleted."""
        deleted = 0
        prefix = f"{self.subjects.namespace}_response_"
        names: list[str] = []
        while page := await self.js.streams_info(offset=len(names)):
            names += [info.config.name or "" for info in page]
        for stream in names:
            if not stream.startswith(prefix):
                continue
            with contextlib.suppress(nats.js.errors.NotFoundError):
                if await self.expired(stream):
                    await self.js.delete_stream(stream)
                    deleted += 1
        return deleted


def _decode(data: bytes) -> StoredMessage:
    message = codec.decode_tagged(data, TOKEN_SUBJECT_MESSAGES)
    assert isinstance(message, TokenEvent | SessionEnd | RouteChanged)
    return message
