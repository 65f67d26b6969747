"""A pytest plugin: a test module's temporary directories go when the module ends, unless one of its tests failed.

pyproject.toml's ``tmp_path_retention_policy = "failed"`` already removes a passed test's ``tmp_path`` as the test
ends; this does the same for what module fixtures make with ``tmp_path_factory.mktemp`` (real-width models of a GB
and more, fleets' node homes, torrent downloads). Without it a whole run's worth stayed on disk until the run ended,
and CI failed on a full disk.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

_FAILED_MODULES: set[str] = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    if outcome.get_result().failed:
        _FAILED_MODULES.add(str(item.path))


@pytest.fixture(scope="module", autouse=True)
def _module_temp_dirs_removed(request: pytest.FixtureRequest,
                              tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if str(request.path) in _FAILED_MODULES:
        return
    for made in set(base.iterdir()) - before:
        _remove(made)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
