import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def demo_corpus():
    """The embedded stdlib corpus (megatron_ds.data.demo_corpus), built once into data/demo and reused
    across sessions (MDS_DEMO_DIR overrides the place)."""
    from megatron_ds.data.demo_corpus import prepare

    return prepare(os.environ.get("MDS_DEMO_DIR", os.path.join(REPO, "data", "demo")))
