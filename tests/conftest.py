import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def demo_corpus():
    """The embedded stdlib corpus (megatron_ds.data.demo_corpus), built once into data/demo and reused
    across sessions (MDS_DEMO_DIR overrides the place)."""
    from megatron_ds.data.demo_corpus import prepare

    return prepare(os.environ.get("MDS_DEMO_DIR", os.path.join(REPO, "data", "demo")))


def pytest_configure(config):
    # Tests that need a piece of the system fail, naming it, when it is missing; deselecting them by marker
    # is the one way to leave them out, and pytest reports how many were deselected.
    config.addinivalue_line("markers", "docker: builds and runs the image recipes (needs a Docker daemon; the "
                                       "fixture starts dockerd as root when none runs); "
                                       "-m 'not gpu and not upstream_src and not docker' leaves them out")
