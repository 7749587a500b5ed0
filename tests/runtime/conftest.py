"""Fixtures for the runtime tests (helpers live in runtime_helpers.py)."""

import pytest
from runtime_helpers import Slurm


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()
