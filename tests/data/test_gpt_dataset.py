import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from megatron_ds.data.gpt_dataset import (DataConfigError, blend_indices, build_gpt_datasets, parse_data_path,
                                          split_bounds)
from megatron_ds.data.indexed import IndexedDatasetWriter
from megatron_ds.runtime.rendezvous import hosted_store

SEQ = 16


def numbered_corpus(path, num_docs=60, seed=0, first_token=0):
    """Documents whose tokens are their global positions, so every token says where it came from."""
    sizes = np.random.default_rng(seed).integers(1, 40, num_docs)
    sizes[7] = 0  # an empty document must be skipped over
    prefix = str(path)
    with IndexedDatasetWriter(prefix, np.int32) as w:
        start = first_token
        for n in sizes:
            w.add_document(np.arange(start, start + n))
            start += n
    return prefix, sizes


def unshuffled(ds):
    """Samples in sample_idx order (undoing the shuffle)."""
    order = np.argsort(np.asarray(ds.shuffle_idx))
    return [ds[int(i)] for i in order]


@pytest.mark.parametrize("order", ["megatron", "mds"])
@pytest.mark.parametrize("num_samples", [20, 170])  # less than one epoch, and several epochs
def test_every_token_of_the_split_in_order(tmp_path, num_samples, order):
    prefix, sizes = numbered_corpus(tmp_path / "c")
    train, valid, test = build_gpt_datasets([prefix], "80,15,5", SEQ, 1234, (num_samples, 7, 0),
                                            cache_dir=str(tmp_path / "cache"), order=order)
    assert test is None and len(train) == num_samples and len(valid) == 7
    starts = np.concatenate(([0], np.cumsum(sizes)))
    lo, hi = split_bounds("80,15,5", len(sizes), order)[0]
    assert (lo, hi) == (0, 48)
    doc_idx = np.asarray(train.doc_idx)
    epochs = len(doc_idx) // (hi - lo)
    assert len(doc_idx) == epochs * (hi - lo) and (epochs > 1) == (num_samples == 170)
    if order == "mds":  # each epoch is a permutation of the split's documents
        for e in range(epochs):
            assert sorted(doc_idx[e * (hi - lo):(e + 1) * (hi - lo)].tolist()) == list(range(lo, hi))
    else:  # Megatron shuffles the epochs together (the last one apart when it is short): each document E times
        assert np.bincount(doc_idx, minlength=hi).tolist() == [0] * lo + [epochs] * (hi - lo)
    stream = np.concatenate([np.arange(starts[d], starts[d + 1]) for d in doc_idx])
    samples = unshuffled(train)
    for j, sample in enumerate(samples):
        assert sample.dtype == np.int64 and sample.shape == (SEQ + 1,)
        assert np.array_equal(sample, stream[j * SEQ: j * SEQ + SEQ + 1])
    # nothing outside the split's token range is ever read, in train or valid
    assert all(starts[lo] <= s.min() and s.max() < starts[hi] for s in samples)
    vlo, vhi = split_bounds("80,15,5", len(sizes), order)[1]
    assert all(starts[vlo] <= valid[i].min() and valid[i].max() < starts[vhi] for i in range(len(valid)))
    # mds: exactly the samples asked for; Megatron: every sample of the whole epochs, the first ones served
    available = num_samples if order == "mds" else (epochs * int(sizes[lo:hi].sum()) - 1) // SEQ
    assert sorted(np.asarray(train.shuffle_idx).tolist()) == list(range(available))


def test_seed_changes_order_and_is_reproducible(tmp_path):
    prefix, _ = numbered_corpus(tmp_path / "c")
    a = build_gpt_datasets([prefix], "1", SEQ, 1, (30, 0, 0), cache_dir=str(tmp_path / "x"))[0]
    b = build_gpt_datasets([prefix], "1", SEQ, 1, (30, 0, 0), cache_dir=str(tmp_path / "y"))[0]
    c = build_gpt_datasets([prefix], "1", SEQ, 2, (30, 0, 0), cache_dir=str(tmp_path / "y"))[0]
    assert all(np.array_equal(a[i], b[i]) for i in range(30))
    assert not all(np.array_equal(a[i], c[i]) for i in range(30))


def test_cache_reused_and_keyed_on_every_parameter(tmp_path):
    prefix, _ = numbered_corpus(tmp_path / "c")
    cache = str(tmp_path / "cache")
    first = build_gpt_datasets([prefix], "90,10", SEQ, 5, (40, 4, 0), cache_dir=cache)
    assert first[0].built and first[1].built
    files = sorted(os.listdir(cache))
    mtimes = {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in files}
    again = build_gpt_datasets([prefix], "90,10", SEQ, 5, (40, 4, 0), cache_dir=cache)
    assert not again[0].built and not again[1].built
    assert {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in files} == mtimes
    assert all(np.array_equal(first[0][i], again[0][i]) for i in range(40))
    for change in [dict(seq=SEQ + 1), dict(seed=6), dict(n=41), dict(split="80,20")]:
        ds = build_gpt_datasets([prefix], change.get("split", "90,10"), change.get("seq", SEQ), change.get("seed", 5),
                                (change.get("n", 40), 0, 0), cache_dir=cache)[0]
        assert ds.built, change
    default = build_gpt_datasets([prefix], "1", SEQ, 5, (3, 0, 0))[0]  # no cache dir: next to the data
    assert default.cache.base.startswith(str(tmp_path / "index-cache"))


def test_blending_ratios_within_one_percent(tmp_path):
    parts = [numbered_corpus(tmp_path / f"c{k}", seed=k, first_token=10**6 * k)[0] for k in range(3)]
    n = 3000
    train, _, _ = build_gpt_datasets(["0.2", parts[0], "0.3", parts[1], "0.5", parts[2]], "1", SEQ, 3, (n, 0, 0),
                                     cache_dir=str(tmp_path / "cache"))
    index = np.asarray(train.dataset_index)
    for prefix_len in (100, 1000, n):
        shares = np.bincount(index[:prefix_len], minlength=3) / prefix_len
        assert np.allclose(shares, [0.2, 0.3, 0.5], atol=0.01), (prefix_len, shares)
    for i in range(0, n, 97):  # each sample comes from the dataset the index names
        assert int(train[i][0]) // 10**6 == index[i]
    for d in range(3):  # each component's samples used once each, in order
        assert np.array_equal(np.asarray(train.dataset_sample_index)[index == d], np.arange((index == d).sum()))
    again = build_gpt_datasets(["0.2", parts[0], "0.3", parts[1], "0.5", parts[2]], "1", SEQ, 3, (n, 0, 0),
                               cache_dir=str(tmp_path / "cache"))[0]
    assert not again.built


def test_blend_indices_large_is_exact():
    index, sample = blend_indices([1, 2, 7], 10**6)
    assert np.bincount(index).tolist() == [100000, 200000, 700000]
    assert sample.max() == 699999


def test_config_errors_name_the_flag(tmp_path):
    prefix, _ = numbered_corpus(tmp_path / "c")
    with pytest.raises(DataConfigError, match="--data-path: expected one prefix or weight/prefix pairs"):
        parse_data_path(["0.5", prefix, "0.5"])
    with pytest.raises(DataConfigError, match="--data-path: 'a' is not a weight"):
        parse_data_path(["a", prefix])
    with pytest.raises(DataConfigError, match="--split"):
        build_gpt_datasets([prefix], "90,x", SEQ, 1, (1, 0, 0), cache_dir=str(tmp_path))
    with pytest.raises(DataConfigError, match=r"--data-path: .*missing\.idx: no such file"):
        build_gpt_datasets([str(tmp_path / "missing")], "1", SEQ, 1, (1, 0, 0))
    assert parse_data_path(["0.3", "a", "0.9", "b"]) == [(0.25, "a"), (0.75, "b")]


BUILD = textwrap.dedent("""
    import os, sys
    from megatron_ds.data.gpt_dataset import build_gpt_datasets
    if sys.argv[3] == "gloo":
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=int(sys.argv[4]), world_size=2)  # env://: the test's store
    ds = build_gpt_datasets([sys.argv[1]], "1", 8, 1, (200000, 0, 0), cache_dir=sys.argv[2])[0]
    print("BUILT" if ds.built else "LOADED", int(ds[123].sum()))
    if sys.argv[3] == "gloo":  # a build that fails on rank 0 fails every rank instead of hanging them
        try:
            build_gpt_datasets([sys.argv[1] + "_empty"], "1", 8, 1, (10, 0, 0), cache_dir=sys.argv[2])
        except ValueError as e:
            print("FAILED:", e)
        dist.destroy_process_group()  # gloo's threads must be joined before the interpreter exits
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lock", "gloo"])
def test_two_processes_only_one_builds(tmp_path, mode):
    prefix, _ = numbered_corpus(tmp_path / "c", num_docs=3000)
    with IndexedDatasetWriter(prefix + "_empty", np.int32) as w:  # documents without tokens
        w.add_document([])
        w.add_document([])
    cache = str(tmp_path / "cache")
    with hosted_store() as store:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", **store.rank_env)
        procs = [subprocess.Popen([sys.executable, "-c", BUILD, prefix, cache, mode, str(rank)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    results = sorted(o[0].split()[0] for o in outs)
    assert results == ["BUILT", "LOADED"]
    assert outs[0][0].split()[1] == outs[1][0].split()[1]
    if mode == "gloo":
        assert outs[0][0].startswith("BUILT")  # rank 0 is the builder
        assert "FAILED: --data-path: the split's documents hold no tokens" in outs[0][0]
        assert "FAILED: rank 0 could not build the sample index" in outs[1][0] and "hold no tokens" in outs[1][0]


def test_orders_have_their_own_caches_and_the_flag(tmp_path):
    """--data-order mds keeps the earlier order; each order caches under its own names, never the other's."""
    from megatron_ds.arguments.flags import build_parser

    prefix, _ = numbered_corpus(tmp_path / "c")
    cache = str(tmp_path / "cache")
    megatron = build_gpt_datasets([prefix], "1", SEQ, 7, (50, 0, 0), cache_dir=cache)[0]
    mds = build_gpt_datasets([prefix], "1", SEQ, 7, (50, 0, 0), cache_dir=cache, order="mds")[0]
    assert megatron.built and mds.built
    assert "_megatron_" in os.path.basename(megatron.cache.base) and "_mds_" in os.path.basename(mds.cache.base)
    assert not all(np.array_equal(megatron[i], mds[i]) for i in range(50))
    with pytest.raises(DataConfigError, match="--data-order: 'other'"):
        build_gpt_datasets([prefix], "1", SEQ, 7, (50, 0, 0), cache_dir=cache, order="other")
    parser = build_parser()
    assert parser.parse_args([]).data_order == "megatron"
    assert parser.parse_args(["--data-order", "mds"]).data_order == "mds"


def test_sample_counts_as_megatron_asks_them():
    """train_val_test_num_samples: --train-samples when given (megatron order), evaluation every interval and
    at the end, test once."""
    from megatron_ds.training.data import num_samples
    from tests.training.sections import sections

    iters = dict(train_iters=100, train_samples=None, global_batch_size=8, eval_interval=30, eval_iters=2,
                 data_order="megatron")
    assert num_samples(sections(**iters)) == (800, (100 // 30 + 1) * 2 * 8, 16)
    samples = {**iters, "train_samples": 805, "train_iters": 805 // 8}
    assert num_samples(sections(**samples))[0] == 805
    assert num_samples(sections(**{**samples, "data_order": "mds"}))[0] == 800
