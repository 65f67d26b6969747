"""A TCP relay that records every byte it carries, both ways: what anyone on the path between two hosts sees."""

from __future__ import annotations

from tests.support.proxy import CountingProxy


class RecordingRelay(CountingProxy):
    """Listens on 127.0.0.1 (or ``listen_host``) and forwards each connection to ``target``; ``captured`` holds
    both directions of every connection."""

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(target[1], target[0], record_downstream=True)

    @classmethod
    async def start(cls, target: tuple[str, int], listen_host: str = "127.0.0.1") -> RecordingRelay:  # type: ignore[override]
        relay = cls(target)
        await relay.listen(listen_host)
        return relay

    @property
    def captured(self) -> bytes:
        return bytes(self.upstream) + bytes(self.downstream)
