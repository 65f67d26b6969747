"""Which upload limit a holder seeds within (``swarmroute.seeder.upload_limit``): a serving node shares its CPU with
decoding, a seeder does nothing else, and ``--upload-limit`` overrides either."""

from __future__ import annotations

import argparse

import pytest

from schemas.settings import Settings
from swarmroute.seeder import add_upload_limit, upload_limit


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_upload_limit(p)
    return p.parse_args(list(argv))


def test_a_serving_node_seeds_within_its_limit_and_a_seeder_without_one_by_default() -> None:
    settings = Settings()
    assert upload_limit(parse(), settings, serving=True) == settings.seed_upload_limit > 0
    assert upload_limit(parse(), settings, serving=False) == settings.seeder_upload_limit == 0


@pytest.mark.parametrize("serving", [True, False])
def test_the_flag_overrides_the_setting_and_zero_means_unlimited(serving: bool) -> None:
    settings = Settings(seed_upload_limit=7, seeder_upload_limit=9)
    assert upload_limit(parse("--upload-limit", "1234"), settings, serving=serving) == 1234
    assert upload_limit(parse("--upload-limit", "0"), settings, serving=serving) == 0
    assert upload_limit(parse(), settings, serving=serving) == (7 if serving else 9)


def test_the_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMROUTE_SEED_UPLOAD_LIMIT", "5000000")
    monkeypatch.setenv("SWARMROUTE_SEEDER_UPLOAD_LIMIT", "6000000")
    settings = Settings()
    assert (settings.seed_upload_limit, settings.seeder_upload_limit) == (5_000_000, 6_000_000)
