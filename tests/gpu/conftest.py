"""MDS_GPU_TESTS_SHARE_GPU=1 (both ranks of a two-rank case on one GPU, over gloo) deselects the cases marked
not_on_shared_gpu: they cannot run that way (test_gpu_training.py says which and why)."""

import os


def shared_gpu_deselects(item, env=os.environ) -> bool:
    return env.get("MDS_GPU_TESTS_SHARE_GPU") == "1" and item.get_closest_marker("not_on_shared_gpu") is not None


def pytest_collection_modifyitems(config, items):
    deselected = [item for item in items if shared_gpu_deselects(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]
