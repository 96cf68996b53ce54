"""Fixtures locating the sample data shipped beside these tests (README.md here says where they
come from and their licence). A missing sample fails the test, so a broken checkout is never
mistaken for a passing suite."""
from pathlib import Path

import pytest

SAMPLE_DATA = Path(__file__).resolve().parent


def _sample_file(name: str) -> Path:
    path = SAMPLE_DATA / name
    if not path.is_file():
        pytest.fail(
            f"sample data file {path} is missing from the checkout (tests/data/README.md lists the samples)",
            pytrace=False,
        )
    return path


@pytest.fixture
def criteo_sample() -> Path:
    return _sample_file("criteo_sample.csv")


@pytest.fixture
def movielens_sample() -> Path:
    return _sample_file("movielens_sample.csv")
