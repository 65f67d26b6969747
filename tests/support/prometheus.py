"""A Prometheus text page, parsed with prometheus_client's own parser, for tests to read series from."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class Scrape:
    def __init__(self, text: str) -> None:
        self.samples: list[Sample] = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples if s.name == name and all(s.labels.get(k) == v
                                                                            for k, v in labels.items())]
        assert found, f"no sample {name}{labels}"
        return sum(found)

    def names(self) -> set[str]:
        return {s.name for s in self.samples}

    def labels(self, name: str, key: str) -> set[str]:
        return {s.labels[key] for s in self.samples if s.name == name and key in s.labels}
