"""megatron_blend_indices (--data-order megatron) against Megatron's greedy blending rule, written out here as a
plain loop: helpers.cpp's build_blending_indices step for step (its float64 products and differences, its strict >
over the datasets in order). tests/data/test_megatron_order.py compares with the compiled helpers.cpp itself."""

import numpy as np
import pytest

import megatron_ds.data.gpt_dataset as gpt_dataset
from megatron_ds.data.gpt_dataset import _greedy_blend, _sample_numbers, megatron_blend_indices


def greedy_rule(weights, size):
    """helpers.cpp build_blending_indices, one step at a time (weights normalised as BlendableDataset does)."""
    w = np.asarray(weights, dtype=np.float64)
    w = (w / np.sum(w)).tolist()
    current = [0] * len(w)
    index, sample = [], []
    for i in range(size):
        s = max(float(i), 1.0)
        best, best_error = 0, w[0] * s - float(current[0])
        for d in range(1, len(w)):
            error = w[d] * s - float(current[d])
            if error > best_error:
                best, best_error = d, error
        index.append(best)
        sample.append(current[best])
        current[best] += 1
    return np.array(index, np.int64), np.array(sample, np.int64)


def weight_sets(seed, count):
    """Random weight vectors of 2-10 datasets: plain, very small, one tiny, ties, near-ties (a few ulps), a zero."""
    rng = np.random.default_rng(seed)
    for trial in range(count):
        n = int(rng.integers(2, 11))
        kind = trial % 8
        if kind == 0:
            w = rng.random(n)
        elif kind == 1:
            w = rng.random(n) ** 6  # down to ~1e-12 once normalised
        elif kind == 2:
            w = rng.random(n)
            w[rng.integers(n)] = 10 ** rng.uniform(-12, -3)
        elif kind == 3:
            w = np.round(rng.random(n) * 4) + 1  # exact ties between datasets
        elif kind == 4:
            w = np.ones(n)
        elif kind == 5:  # near-ties: neighbours a few ulps apart
            w = np.full(n, rng.random())
            for d in range(1, n):
                w[d] = w[d - 1]
                for _ in range(int(rng.integers(0, 3))):
                    w[d] = np.nextafter(w[d], 2.0)
        elif kind == 6:
            w = np.round(rng.random(n), 1) + 0.1  # decimal weights such as 0.3, 0.7
        else:
            w = rng.random(n)
            w[rng.integers(n)] = 0.0
        yield w


@pytest.mark.parametrize("seed", range(4))
def test_equals_greedy_rule_random_weights(seed):
    rng = np.random.default_rng(100 + seed)
    for weights in weight_sets(seed, 24):
        size = int(rng.integers(1, 40000))
        index, sample = megatron_blend_indices(weights, size)
        want_index, want_sample = greedy_rule(weights, size)
        assert index.dtype == np.int16 and sample.dtype == np.int64
        assert np.array_equal(index.astype(np.int64), want_index), (list(weights), size)
        assert np.array_equal(sample, want_sample), (list(weights), size)


@pytest.mark.parametrize("weights, size", [
    ([0.2, 0.3, 0.5], 3_000_000),
    ([0.5, 0.5 - 1e-6, 1e-6], 2_000_000),  # a tiny weight: one sample every million steps
    (np.random.default_rng(7).random(10) ** 4, 1_000_000),
])
def test_equals_greedy_rule_millions(weights, size):
    index, sample = megatron_blend_indices(weights, size)
    want_index, want_sample = greedy_rule(weights, size)
    assert np.array_equal(index.astype(np.int64), want_index)
    assert np.array_equal(sample, want_sample)


def test_small_sizes_and_one_dataset():
    for weights in ([1.0], [0.25, 0.75], [3, 1, 1]):
        for size in (0, 1, 2, 3, 64, 65, 66, 129, 1000):
            index, sample = megatron_blend_indices(weights, size)
            want_index, want_sample = greedy_rule(weights, size)
            assert np.array_equal(index.astype(np.int64), want_index), (weights, size)
            assert np.array_equal(sample, want_sample), (weights, size)


def test_every_repair_path_is_exact(monkeypatch):
    """Short segments and little or no warm-up: many segments start from a wrong estimate and run again, side by
    side (numpy passes) or one by one (the plain loop). The result must not depend on it."""
    used = {"segments": 0, "loop": 0, "blends": 0}
    segments, loop = gpt_dataset._greedy_segments, gpt_dataset._greedy_loop

    def counted_segments(*args, **kwargs):
        used["segments"] += 1
        return segments(*args, **kwargs)

    def counted_loop(*args):
        used["loop"] += 1
        return loop(*args)

    monkeypatch.setattr(gpt_dataset, "_greedy_segments", counted_segments)
    monkeypatch.setattr(gpt_dataset, "_greedy_loop", counted_loop)
    for weights in weight_sets(11, 16):
        w = np.asarray(weights, np.float64) / np.sum(weights)
        size = 20000
        want = greedy_rule(weights, size)[0]
        for options in ({"segment": 17, "warmup": 3}, {"segment": 50, "warmup": 0, "rounds": 2},
                        {"segment": 40, "warmup": 0, "rounds": 0}, {"segment": 5000, "warmup": 1}):
            got = _greedy_blend(w, size, **options)
            used["blends"] += 1
            assert np.array_equal(got.astype(np.int64), want), (list(weights), options)
    assert used["segments"] > 2 * used["blends"] and used["loop"] > 0, used  # passes beyond the first run, loops


@pytest.mark.parametrize("datasets", [3, 16, 17, 40])
def test_sample_numbers(datasets):
    index = np.random.default_rng(datasets).integers(0, datasets, 5000).astype(np.int16)
    want = np.zeros(len(index), np.int64)
    seen = [0] * datasets
    for i, d in enumerate(index.tolist()):
        want[i], seen[d] = seen[d], seen[d] + 1
    assert np.array_equal(_sample_numbers(index), want)
    assert len(_sample_numbers(np.zeros(0, np.int16))) == 0
