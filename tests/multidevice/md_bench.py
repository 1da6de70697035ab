"""The sharding benchmark (python -m flashlax.bench --suite sharding) at a tiny size."""

import argparse

import pytest

from flashlax.bench import sharding


@pytest.mark.slow
def test_sharding_benchmark_rows():
    data = sharding.run(argparse.Namespace(length=32, repeats=1, min_sample_s=0.001))
    names = [row["impl"] for row in data["results"]]
    assert len(names) == 18 and all(row["median_ms"] > 0 for row in data["results"])
    assert "ring fwd_bwd | 8 devices T=256" in names and "all-gather baseline fwd | 8 devices T=256" in names
    assert "| 0." in sharding.table(data["results"]) or "| 1." in sharding.table(data["results"])
