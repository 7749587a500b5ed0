import os
from types import SimpleNamespace

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
    # is the one way to leave them out, and pytest reports how many were deselected (under xdist too, below).
    config.addinivalue_line("markers", "docker: builds and runs the image recipes (needs a Docker daemon; the "
                                       "fixture starts dockerd as root when none runs); "
                                       "-m 'not gpu and not upstream_src and not docker' leaves them out")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the marks to name each item's group
def pytest_collection_modifyitems(config, items):
    # `make test` runs two pytest-xdist workers (--dist loadgroup). Tests that share something costly stay on one
    # worker: a service (one Slurm cluster and one dockerd per run, not per worker) or a module-scoped fixture (a
    # reference training run, built once per module, not once per worker).
    for item in items:
        names = getattr(item, "fixturenames", ())
        group = next((service for service in ("slurm", "docker") if service in names), None)
        fixtures = getattr(item, "_fixtureinfo", None)
        if group is None and fixtures is not None and any(
                defs[-1].scope in ("package", "module", "class") for defs in fixtures.name2fixturedefs.values()):
            group = item.nodeid.split("::")[0]
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


_DESELECTED: list[str] = []


def pytest_deselected(items):
    _DESELECTED.extend(item.nodeid for item in items)


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller writes the summary line
        workeroutput["deselected"] = list(_DESELECTED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    # Every worker collects and deselects the same tests: the controller counts them once, so the summary line
    # says "N deselected" as one pytest process does (what a -m leaves out stays visible).
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    deselected = getattr(node, "workeroutput", {}).get("deselected", [])
    if reporter is not None and deselected and not reporter.stats.get("deselected"):
        reporter.stats["deselected"] = [SimpleNamespace(nodeid=nodeid) for nodeid in deselected]  # report-like
