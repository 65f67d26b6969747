"""A run keeps on disk only what a failure needs: the plugin removes a module's mktemp directories when it ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MODULE = '''
import pytest

@pytest.fixture(scope="module")
def big(tmp_path_factory):
    made = tmp_path_factory.mktemp("{name}")
    (made / "model.gguf").write_bytes(b"x" * 4096)
    return made

def test_uses_it(big, tmp_path):
    (tmp_path / "own").write_text("per test")
    assert {outcome}
'''


def _run(root: Path) -> subprocess.CompletedProcess[str]:
    (root / "tests").mkdir()
    (root / "tests" / "test_passes.py").write_text(MODULE.format(name="kept_if_failed_a", outcome="True"))
    (root / "tests" / "test_fails.py").write_text(MODULE.format(name="kept_if_failed_b", outcome="False"))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "tests.support.disk_budget", "-o", "tmp_path_retention_policy=failed",
                           "--basetemp", str(root / "base"), "--rootdir", str(root), str(root / "tests")],
                          capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).resolve().parent.parent, check=False)


def test_a_passing_modules_directories_go_and_a_failing_ones_stay(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert "1 failed, 1 passed" in done.stdout, done.stdout
    left = sorted(p.name for p in (tmp_path / "base").iterdir())
    assert any(name.startswith("kept_if_failed_b") for name in left), left
    assert not any(name.startswith("kept_if_failed_a") for name in left), left
    assert any(name.startswith("test_uses_it") for name in left), left  # the failed test's own tmp_path
    assert len([name for name in left if name.startswith("test_uses_it")]) == 1, left
