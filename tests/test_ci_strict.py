"""CI cannot skip the real path: the plugin turns every kind of skip into a failure under CI=true."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SKIPPING = '''
import pytest
missing = pytest.importorskip("swarmroute_no_such_module") if "MODULE_SKIP" in __import__("os").environ else None

def test_runtime_skip():
    pytest.skip("no working C compiler")

@pytest.mark.skipif(True, reason="needs root and ip netns")
def test_marked_skip():
    pass

def test_plain():
    pass
'''


def _run(tmp_path: Path, ci: str | None, module_skip: bool = False) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MODULE_SKIP")}
    if ci is not None:
        env["CI"] = ci
    if module_skip:
        env["MODULE_SKIP"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "tests.support.ci_strict", "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).resolve().parent.parent, check=False)


def test_skips_stay_skips_off_ci(tmp_path: Path) -> None:
    done = _run(tmp_path, None)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 2 skipped" in done.stdout


def test_every_skip_fails_under_ci(tmp_path: Path) -> None:
    done = _run(tmp_path, "true")
    assert done.returncode != 0, done.stdout
    assert "skipped in CI (CI=true)" in done.stdout
    assert "no working C compiler" in done.stdout and "needs root and ip netns" in done.stdout
    assert "1 passed" in done.stdout


def test_a_module_level_skip_fails_under_ci(tmp_path: Path) -> None:
    done = _run(tmp_path, "true", module_skip=True)
    assert done.returncode != 0, done.stdout
    assert "swarmroute_no_such_module" in done.stdout
    off_ci = _run(tmp_path, None, module_skip=True)
    assert off_ci.returncode == 5 and "1 skipped" in off_ci.stdout, off_ci.stdout  # 5: no test ran
