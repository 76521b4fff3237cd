"""A Prometheus exposition read back with prometheus_client's own parser."""
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """Each family's type, and every sample by (name, labels)."""
    types, samples = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"{key} twice"
            samples[key] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]
