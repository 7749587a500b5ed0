"""--data-order megatron against upstream Megatron-DeepSpeed's own index builders (upstream_src).

Upstream's functions run from its source: megatron/data/helpers.cpp compiled here (the system C++ compiler and
pybind11, as upstream's megatron/data/Makefile does) and `_build_index_mappings` (with its `_build_doc_idx`,
`_build_shuffle_idx`, `_num_epochs`, `_num_tokens`), `get_train_valid_test_split_` and
`get_datasets_weights_and_num_samples` taken out of its files by name and run with stubs for its
torch.distributed / args / accelerator calls (one rank). Their arrays must equal ours element for element.

CI has no GitHub access (only PyPI and Debian) and Megatron-DeepSpeed is on neither, so this runs when asked,
with a checkout at the pinned commit: MDS_MEGATRON_DS_SRC=<deepspeedai/Megatron-DeepSpeed at 4efb479d...>
`pytest -m upstream_src tests/data/test_megatron_order.py`. Selected without it, it fails, naming the variable.
"""

import ast
import math
import os
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import numpy as np
import pytest

from megatron_ds.data.gpt_dataset import build_gpt_datasets, megatron_epochs, split_bounds
from megatron_ds.data.indexed import IndexedDataset, IndexedDatasetWriter

MEGATRON_DS_COMMIT = "4efb479d5317ce9b86096b9d8e3e8030b0b5263b"  # deepspeedai/Megatron-DeepSpeed, 2025-07-16
SEQ, SEED = 16, 1234

pytestmark = pytest.mark.upstream_src


def _functions(path: Path, names: set[str]) -> ast.Module:
    tree = ast.parse(path.read_text())
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert {f.name for f in found} == names, f"{path}: no {sorted(names - {f.name for f in found})}"
    return ast.Module(body=found, type_ignores=[])


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    source = os.environ.get("MDS_MEGATRON_DS_SRC")
    assert source, f"set MDS_MEGATRON_DS_SRC to a checkout of deepspeedai/Megatron-DeepSpeed at {MEGATRON_DS_COMMIT}"
    root = Path(source)
    data = root / "megatron" / "data"
    assert (data / "helpers.cpp").is_file(), f"{root} holds no megatron/data/helpers.cpp"
    if (root / ".git").exists():
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert head.strip() == MEGATRON_DS_COMMIT, f"{root} is at {head.strip()}, not the pinned {MEGATRON_DS_COMMIT}"

    # helpers.cpp, compiled as upstream's megatron/data/Makefile does
    import pybind11  # the test extra installs it
    build = tmp_path_factory.mktemp("megatron_helpers")
    target = build / ("helpers" + sysconfig.get_config_var("EXT_SUFFIX"))
    includes = [f"-I{sysconfig.get_paths()['include']}", f"-I{pybind11.get_include()}"]
    result = subprocess.run([os.environ.get("CXX", "c++"), "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC",
                             *includes, str(data / "helpers.cpp"), "-o", str(target)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    import importlib.util

    spec = importlib.util.spec_from_file_location("helpers", target)
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)

    # `from megatron.data import helpers` inside _build_index_mappings finds the compiled module
    megatron, megatron_data = types.ModuleType("megatron"), types.ModuleType("megatron.data")
    megatron.data, megatron_data.helpers = megatron_data, helpers
    saved = {name: sys.modules.get(name) for name in ("megatron", "megatron.data", "megatron.data.helpers")}
    sys.modules.update({"megatron": megatron, "megatron.data": megatron_data, "megatron.data.helpers": helpers})

    args = types.SimpleNamespace(train_data_exact_num_epochs=None, train_desc_path=None, train_doc_idx_path=None,
                                 train_sample_idx_path=None, train_shuffle_idx_path=None)
    one_rank = types.SimpleNamespace(
        all_reduce=lambda *a, **k: None, get_world_size=lambda group=None: 1)
    namespace = {
        "np": np, "os": os, "time": __import__("time"), "hashlib": __import__("hashlib"), "math": math,
        "get_args": lambda: args, "is_rank_0": lambda: True, "print_rank_0": lambda *a, **k: None,
        "torch": types.SimpleNamespace(distributed=one_rank),
        "get_accelerator": lambda: types.SimpleNamespace(LongTensor=lambda values: np.array(values, np.int64)),
        "mpu": types.SimpleNamespace(get_data_parallel_group=lambda: None,
                                     get_pipeline_model_parallel_group=lambda: None,
                                     get_tensor_model_parallel_group=lambda: None,
                                     get_sequence_parallel_group=lambda: None),
    }
    exec(compile(_functions(data / "gpt_dataset.py", {"_build_index_mappings", "_num_tokens", "_num_epochs",
                                                      "_build_doc_idx", "_build_shuffle_idx"}),
                 str(data / "gpt_dataset.py"), "exec"), namespace)
    exec(compile(_functions(data / "dataset_utils.py", {"get_train_valid_test_split_",
                                                        "get_datasets_weights_and_num_samples"}),
                 str(data / "dataset_utils.py"), "exec"), namespace)
    namespace["helpers"] = helpers
    namespace["cache"] = str(tmp_path_factory.mktemp("megatron_index_cache"))
    yield namespace
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def corpus(path, num_docs=80, seed=0):
    """Documents of 0..59 tokens, some empty (the first too: Megatron's sample_idx starts at (0, 0) anyway)."""
    sizes = np.random.default_rng(seed).integers(0, 60, num_docs)
    sizes[[0, 5, 9]] = 0
    with IndexedDatasetWriter(str(path), np.int32) as w:
        for n in sizes:
            w.add_document(np.arange(n) + 1)
    return str(path)


def upstream_split(up, prefix, split, name, num_samples):
    """Upstream's (doc_idx, sample_idx, shuffle_idx) of one split of one dataset, or None."""
    sizes = IndexedDataset(prefix).sizes
    assert sizes.dtype == np.int32
    bounds = up["get_train_valid_test_split_"](split, len(sizes))
    s = ("train", "valid", "test").index(name)
    if bounds[s + 1] <= bounds[s]:
        return None
    documents = np.arange(bounds[s], bounds[s + 1], dtype=np.int32)
    doc_idx, sample_idx, shuffle_idx, _, _ = up["_build_index_mappings"](
        name, prefix, documents, np.asarray(sizes), split, num_samples, SEQ, SEED, data_cache_path=up["cache"])
    return np.asarray(doc_idx), np.asarray(sample_idx), np.asarray(shuffle_idx)


def assert_same_arrays(ours, theirs, what):
    for name, a, b in zip(("doc_idx", "sample_idx", "shuffle_idx"), (ours.doc_idx, ours.sample_idx, ours.shuffle_idx),
                          theirs):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, f"{what} {name}: shape {a.shape}, upstream {b.shape}"
        assert np.array_equal(a.astype(np.int64), b.astype(np.int64)), \
            f"{what} {name}: first difference at {np.flatnonzero(a.astype(np.int64) != b.astype(np.int64))[:1]}"


def train_samples(prefix, split, epochs, separate_last):
    """A train sample count whose last of `epochs` epochs is (or is not) shuffled apart by Megatron's rule."""
    sizes = IndexedDataset(prefix).sizes
    lo, hi = split_bounds(split, len(sizes))[0]
    tokens = int(sizes[lo:hi].sum())
    from_earlier = ((epochs - 1) * tokens - 1) // SEQ
    per_epoch = (tokens - 1) // SEQ
    n = from_earlier + (1 if separate_last else int(0.9 * per_epoch))
    assert megatron_epochs(tokens, SEQ, n) == (epochs, separate_last)
    return n


@pytest.mark.parametrize("case", ["one_epoch", "three_epochs", "three_epochs_last_apart"])
def test_single_dataset_arrays_equal_upstream(upstream, tmp_path, case):
    prefix, split = corpus(tmp_path / "c"), "80,15,5"
    train = {"one_epoch": 20, "three_epochs": train_samples(prefix, split, 3, False),
             "three_epochs_last_apart": train_samples(prefix, split, 3, True)}[case]
    counts = (train, 40, 7)  # valid and test: several epochs of their few documents
    ours = build_gpt_datasets([prefix], split, SEQ, SEED, counts, cache_dir=str(tmp_path / "ours"))
    for name, ds, n in zip(("train", "valid", "test"), ours, counts):
        theirs = upstream_split(upstream, prefix, split, name, n)
        assert (ds is None) == (theirs is None), name
        if ds is not None:
            assert_same_arrays(ds, theirs, f"{case} {name}")


@pytest.mark.parametrize("weights", [["1.0"], ["0.2", "0.3", "0.5"]])
def test_blended_datasets_equal_upstream(upstream, tmp_path, weights):
    prefixes = [corpus(tmp_path / f"c{k}", num_docs=60 + 20 * k, seed=k) for k in range(len(weights))]
    data_path = [item for pair in zip(weights, prefixes) for item in pair]
    split, counts = "969, 30, 1", (500, 60, 9)
    ours = build_gpt_datasets(data_path, split, SEQ, SEED, counts, cache_dir=str(tmp_path / "ours"))
    names, normalised, per_dataset = upstream["get_datasets_weights_and_num_samples"](data_path, list(counts))
    assert names == prefixes
    for s, name in enumerate(("train", "valid", "test")):
        blend = ours[s]
        parts = [upstream_split(upstream, p, split, name, per_dataset[d][s]) for d, p in enumerate(prefixes)]
        if all(part is None for part in parts):  # the split is empty everywhere: no blend, as upstream
            assert blend is None, name
            continue
        size = sum(per_dataset[d][s] for d in range(len(prefixes)))
        w = np.array(normalised, dtype=np.float64)
        w /= np.sum(w)  # BlendableDataset normalises once more
        index, sample = np.zeros(size, np.uint8), np.zeros(size, np.int64)
        upstream["helpers"].build_blending_indices(index, sample, w, len(prefixes), size, False)
        assert len(blend) == counts[s]
        assert np.array_equal(np.asarray(blend.dataset_index, np.int64), index[:counts[s]].astype(np.int64)), name
        assert np.array_equal(np.asarray(blend.dataset_sample_index), sample[:counts[s]]), name
        for d, (part, theirs) in enumerate(zip(blend.datasets, parts)):
            assert part.num_samples == per_dataset[d][s]
            assert_same_arrays(part, theirs, f"{name} dataset {d}")


def test_blending_rule_equals_upstream_helper(upstream):
    """40 weight sets of 1-39 datasets: megatron_blend_indices against helpers.build_blending_indices."""
    from megatron_ds.data.gpt_dataset import megatron_blend_indices

    rng = np.random.default_rng(0)
    for trial in range(40):
        n = int(rng.integers(1, 9)) if trial < 30 else int(rng.integers(9, 40))  # two code paths
        weights = rng.random(n) if trial % 2 else np.round(rng.random(n) * 4) + 1  # ties too
        w = np.asarray(weights, np.float64) / np.sum(weights)
        size = 20000
        index, sample = np.zeros(size, np.uint8), np.zeros(size, np.int64)
        upstream["helpers"].build_blending_indices(index, sample, w, n, size, False)
        ours_index, ours_sample = megatron_blend_indices(weights, size)
        assert np.array_equal(ours_index.astype(np.int64), index.astype(np.int64)), weights
        assert np.array_equal(ours_sample, sample), weights


def test_blending_rule_equals_upstream_helper_hard_weights(upstream):
    """Tiny weights, ties, near-ties a few ulps apart, a zero weight, millions of samples: megatron_blend_indices
    (numpy segments checked against each other) against helpers.build_blending_indices."""
    from megatron_ds.data.gpt_dataset import megatron_blend_indices

    rng = np.random.default_rng(1)
    cases = [([0.2, 0.3, 0.5], 5_000_000), ([0.5, 0.5 - 1e-6, 1e-6], 3_000_000)]
    for trial in range(30):
        n = int(rng.integers(2, 11))
        kind = trial % 5
        if kind == 0:
            w = rng.random(n) ** 6
        elif kind == 1:
            w = rng.random(n)
            w[rng.integers(n)] = 10 ** rng.uniform(-12, -3)
        elif kind == 2:
            w = np.round(rng.random(n) * 4) + 1
        elif kind == 3:
            w = np.full(n, rng.random())
            for d in range(1, n):
                w[d] = np.nextafter(w[d - 1], 2.0) if rng.random() < 0.7 else w[d - 1]
        else:
            w = rng.random(n)
            w[rng.integers(n)] = 0.0
        cases.append((w, int(rng.integers(1, 1_500_000))))
    for weights, size in cases:
        w = np.asarray(weights, np.float64) / np.sum(weights)
        index, sample = np.zeros(size, np.uint8), np.zeros(size, np.int64)
        upstream["helpers"].build_blending_indices(index, sample, w, len(w), size, False)
        ours_index, ours_sample = megatron_blend_indices(weights, size)
        assert np.array_equal(ours_index.astype(np.int64), index.astype(np.int64)), (list(weights), size)
        assert np.array_equal(ours_sample, sample), (list(weights), size)
