"""Fixtures locating the shared sample data: `<repo>/../shared/data` (CI clones the repo with
`../shared` beside it). A missing sample fails the test, so a broken checkout is never
mistaken for a passing suite."""
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


def _shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.fail(
            f"sample data file {path.resolve()} is missing: the tests expect the shared data "
            f"directory beside the repository (<repo>/../shared/data, see its README.md)",
            pytrace=False,
        )
    return path


@pytest.fixture
def criteo_sample() -> Path:
    return _shared_file("criteo_sample.csv")


@pytest.fixture
def movielens_sample() -> Path:
    return _shared_file("movielens_sample.csv")
