"""GPT pretraining samples over Megatron indexed datasets: splits, epochs, shuffling, blending.

A sample is ``seq_length + 1`` consecutive tokens of the shuffled document stream (inputs and
shifted labels), running across document boundaries. Three index arrays describe a split:

- doc_idx: the split's documents for as many epochs as the requested number of samples needs;
- sample_idx[i] = (position in doc_idx, token offset) of the first token of sample i; sample i
  ends on the first token of sample i + 1;
- shuffle_idx: the order in which samples are served.

Two orders (--data-order). ``megatron`` (default) builds Megatron-DeepSpeed's arrays, equal element for
element (tests/data/test_megatron_order.py): all epochs' documents in one shuffle (the last epoch apart
when short), sample_idx over every sample of those epochs, shuffle_idx from two shuffled ranges, all from
one RandomState(seed); blends by its greedy rule. ``mds`` is the order mds used before: a fresh
permutation per epoch, exactly num_samples samples, blending by due times (sample k of dataset d due at
step (k + 1/2)/w_d, one stable argsort).

Megatron builds sample_idx with a compiled loop; here it is ``np.cumsum`` + ``np.searchsorted``,
a billion-token corpus takes about half a second. Its blending index (another compiled loop, a greedy rule
that is sequential) is run on segments of the steps side by side with numpy, each segment checked against
the end of the one before (``_greedy_blend``): ten million samples of three datasets in about 0.2 s.
The arrays are saved under a name hashed from every input that affects them (the order too) and
memory-mapped on reuse. One process builds while the others wait (rank 0 then a barrier under
torch.distributed, a file lock otherwise).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import sys

import numpy as np

from megatron_ds.data.indexed import IndexedDataset, index_path

SPLIT_NAMES = ("train", "valid", "test")
INDEX_FORMAT = 1  # bump when the arrays' meaning changes, so old caches are not reused
DATA_ORDERS = ("megatron", "mds")  # --data-order; the cache names and descriptions carry it


class DataConfigError(ValueError):
    """A bad --data-path / --split / sample request; the message names the flag."""


def parse_data_path(data_path: list[str]) -> list[tuple[float, str]]:
    """Megatron's list form: ``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]`` -> [(weight, prefix)]."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    if len(data_path) == 1:
        return [(1.0, data_path[0])]
    if not data_path or len(data_path) % 2:
        raise DataConfigError(f"--data-path: expected one prefix or weight/prefix pairs, got {data_path}")
    pairs = []
    for weight, prefix in zip(data_path[::2], data_path[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise DataConfigError(f"--data-path: {weight!r} is not a weight (expected 'w1 prefix1 w2 prefix2 ...')")
        if not math.isfinite(w) or w < 0:
            raise DataConfigError(f"--data-path: weight {weight} of {prefix} must be >= 0")
        pairs.append((w, prefix))
    total = 0.0
    for w, _ in pairs:  # summed in order, as Megatron does (sum() compensates rounding since Python 3.12)
        total += w
    if total <= 0:
        raise DataConfigError(f"--data-path: weights sum to {total}, need a positive sum")
    return [(w / total, p) for w, p in pairs]


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``969/30/1``) -> normalized train/valid/test fractions."""
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise DataConfigError(f"--split: {split!r} must be up to three numbers such as 969,30,1")
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
        raise DataConfigError(f"--split: {split!r} must be up to three non-negative numbers with a positive sum")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def split_bounds(split: str, num_documents: int, order: str = "megatron") -> list[tuple[int, int]]:
    """Document ranges [start, end) of train, valid and test.

    megatron: each part's share rounded on its own, the rounding excess taken off every boundary after the
    first (Megatron's get_train_valid_test_split_); mds: the cumulative boundaries rounded, the last one exact.
    """
    fractions = parse_split(split)
    if order == "megatron":
        edges = [0]
        for f in fractions:
            edges.append(edges[-1] + int(round(f * float(num_documents))))
        excess = edges[-1] - num_documents
        edges = [0] + [e - excess for e in edges[1:]]
    else:
        cum = np.cumsum([0.0] + fractions)
        edges = [int(round(c * num_documents)) for c in cum]
        edges[-1] = num_documents
    return [(edges[i], edges[i + 1]) for i in range(3)]


def _sample_starts(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, count: int) -> np.ndarray:
    """sample_idx rows 0..count: (position in doc_idx, offset) of token k * seq_length of the doc_idx stream.

    The row names the document holding that token, so empty documents are skipped (searchsorted, side right).
    """
    starts = np.zeros(len(doc_idx) + 1, np.int64)  # token position where each doc_idx entry starts
    np.cumsum(sizes[doc_idx], dtype=np.int64, out=starts[1:])
    positions = np.arange(count + 1, dtype=np.int64) * seq_length
    entry = np.searchsorted(starts, positions, side="right") - 1
    return np.stack([entry, positions - starts[entry]], axis=1)


def build_sample_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int,
                         seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """--data-order mds: (doc_idx, sample_idx, shuffle_idx), one fresh permutation per epoch; vectorised."""
    doc_sizes = sizes[documents].astype(np.int64)
    tokens_per_epoch = int(doc_sizes.sum())
    if tokens_per_epoch <= 0:
        raise DataConfigError("--data-path: the split's documents hold no tokens")
    needed = num_samples * seq_length + 1  # the last sample's label token included
    num_epochs = -(-needed // tokens_per_epoch)
    rng = np.random.RandomState(seed % 2**32)
    doc_idx = np.concatenate([documents[rng.permutation(len(documents))] for _ in range(num_epochs)])
    index_dtype = np.int32 if len(doc_idx) < 2**31 else np.int64
    doc_idx = doc_idx.astype(index_dtype)
    sample_idx = _sample_starts(sizes, doc_idx, seq_length, num_samples)
    shuffle_idx = rng.permutation(num_samples).astype(np.int64)
    return doc_idx, sample_idx, shuffle_idx


def megatron_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> tuple[int, bool]:
    """(epochs, separate_last_epoch) as Megatron-DeepSpeed's _build_index_mappings decides them.

    Epochs: the fewest whole passes holding num_samples samples (the last label token included). The last
    epoch is shuffled on its own when it would contribute fewer than 80% of an epoch's samples.
    """
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    if num_epochs == 1:
        return 1, False
    from_earlier = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_epochs, (num_samples - from_earlier) < int(0.80 * per_epoch)


def build_megatron_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int,
                           seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """--data-order megatron: Megatron-DeepSpeed's (doc_idx, sample_idx, shuffle_idx), equal element for element.

    One RandomState(seed) drawn in Megatron's order: doc_idx = all epochs' documents in one shuffle (or, with
    a separate last epoch, the first epochs' shuffle followed by the last epoch's); sample_idx covers every
    sample of those epochs, (E * tokens - 1) // seq_length of them, its first row (0, 0); shuffle_idx
    = a shuffled range of the first epochs' samples then a shuffled range of the rest (one range when the
    last epoch is not separate). Samples 0..num_samples-1 are served; sample_idx is vectorised here where
    Megatron compiles a loop (helpers.cpp build_sample_idx).
    """
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch <= 0:
        raise DataConfigError("--data-path: the split's documents hold no tokens")
    num_epochs, separate_last = megatron_epochs(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed % 2**32)
    documents = np.asarray(documents).astype(np.int32 if len(sizes) < 2**31 else np.int64)

    def shuffled_epochs(count):
        doc_idx = np.tile(documents, count)
        rng.shuffle(doc_idx)
        return doc_idx

    if separate_last:
        doc_idx = np.concatenate([shuffled_epochs(num_epochs - 1), shuffled_epochs(1)])
    else:
        doc_idx = shuffled_epochs(num_epochs)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = _sample_starts(sizes, doc_idx, seq_length, total)
    sample_idx[0] = 0  # Megatron starts at (0, 0) even when the first document is empty
    first = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate_last else total
    shuffle_idx = np.arange(total, dtype=np.int64)
    rng.shuffle(shuffle_idx[:first])
    if first < total:
        rng.shuffle(shuffle_idx[first:])
    return doc_idx, sample_idx, shuffle_idx


def _distributed():
    """torch.distributed when it is initialized with more than one rank, else None."""
    dist = sys.modules.get("torch.distributed")  # not imported: cannot be initialized (and torch is slow to import)
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


class _IndexCache:
    """Arrays saved as ``<dir>/<stem>_<hash>_<name>.npy``, built once under a lock, then memory-mapped."""

    def __init__(self, cache_dir: str, stem: str, description: dict, names: tuple[str, ...]):
        digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:24]
        self.cache_dir, self.description, self.digest = cache_dir, description, digest
        self.base = os.path.join(cache_dir, f"{stem}_{digest}")
        self.paths = {n: f"{self.base}_{n}.npy" for n in names}
        self.built = False

    def _complete(self) -> bool:
        return all(os.path.isfile(p) for p in self.paths.values())

    def _load_or_build(self, build) -> dict[str, np.ndarray]:
        if not self._complete():
            try:
                os.makedirs(self.cache_dir, exist_ok=True)
                lock = open(self.base + ".lock", "w")
            except OSError as e:
                raise DataConfigError(f"--data-cache-path: cannot write index cache in {self.cache_dir} ({e}); "
                                      f"point --data-cache-path at a writable directory") from e
            with lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not self._complete():
                    for name, array in build().items():
                        tmp = f"{self.paths[name]}.tmp.{os.getpid()}.npy"
                        np.save(tmp, array)
                        os.replace(tmp, self.paths[name])
                    with open(self.base + ".json", "w") as f:
                        json.dump(self.description, f, indent=1, sort_keys=True)
                    self.built = True
        # Plain ndarray views of the maps: np.memmap's subclass hooks cost more than the reads themselves.
        return {n: np.load(p, mmap_mode="r").view(np.ndarray) for n, p in self.paths.items()}

    def get(self, build) -> dict[str, np.ndarray]:
        dist = _distributed()
        if dist is None:
            return self._load_or_build(build)
        # Rank 0 builds while the others wait; then it tells them whether it worked (a failure on rank 0
        # must not leave the others waiting forever), and they load (or build, if the cache directory is
        # not shared between nodes).
        if dist.get_rank() == 0:
            try:
                arrays = self._load_or_build(build)
            except Exception as e:
                dist.broadcast_object_list([f"{type(e).__name__}: {e}"], src=0)
                raise
            dist.broadcast_object_list([None], src=0)
            return arrays
        status = [None]
        dist.broadcast_object_list(status, src=0)
        if status[0] is not None:
            raise DataConfigError(f"rank 0 could not build the sample index {self.base}: {status[0]}")
        return self._load_or_build(build)


def _default_cache_dir(prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens over documents [start, end) of one indexed dataset."""

    def __init__(self, indexed: IndexedDataset, name: str, documents: tuple[int, int], split: str,
                 seq_length: int, seed: int, num_samples: int, cache_dir: str | None = None,
                 order: str = "megatron"):
        self.indexed, self.name, self.seq_length, self.num_samples = indexed, name, seq_length, num_samples
        start, end = documents
        stat = os.stat(index_path(indexed.prefix))
        description = {
            "class": "GPTDataset", "format": INDEX_FORMAT, "prefix": os.path.abspath(indexed.prefix),
            "idx_bytes": stat.st_size, "idx_mtime_ns": stat.st_mtime_ns, "split": split, "split_name": name,
            "documents": [start, end], "seq_length": seq_length, "seed": seed, "num_samples": num_samples,
            "order": order,
        }
        stem = f"{os.path.basename(indexed.prefix)}_{name}_{order}"
        self.cache = _IndexCache(cache_dir or _default_cache_dir(indexed.prefix), stem, description,
                                 ("doc_idx", "sample_idx", "shuffle_idx"))

        def build():
            indexed.validate()
            build_indices = build_megatron_indices if order == "megatron" else build_sample_indices
            doc_idx, sample_idx, shuffle_idx = build_indices(
                indexed.sizes, np.arange(start, end, dtype=np.int64), seq_length, num_samples, seed)
            return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}

        arrays = self.cache.get(build)
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]

    @property
    def built(self) -> bool:
        """Whether this process built the index files (False: loaded from the cache)."""
        return self.cache.built

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        # Megatron's order indexes every sample of its whole epochs (a blend may read a few past num_samples)
        if not 0 <= i < len(self.shuffle_idx):
            raise IndexError(f"sample {i} out of range ({len(self.shuffle_idx)} {self.name} samples)")
        j = int(self.shuffle_idx[i])
        (first, offset), (last, last_offset) = self.sample_idx[j], self.sample_idx[j + 1]
        first, offset, last, last_offset = int(first), int(offset), int(last), int(last_offset)
        if first == last:
            tokens = self.indexed.get(int(self.doc_idx[first]), offset, last_offset - offset + 1)
        else:
            parts = [self.indexed.get(int(self.doc_idx[first]), offset)]
            parts += [self.indexed.get(int(d)) for d in self.doc_idx[first + 1:last]]
            parts.append(self.indexed.get(int(self.doc_idx[last]), 0, last_offset + 1))
            tokens = np.concatenate(parts)
        return tokens.astype(np.int64)


def blend_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) of ``size`` steps interleaving datasets by weight."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    due, owner, first = [], [], [0]
    for d, wd in enumerate(w):
        count = int(math.ceil(wd * size)) + 1 if wd > 0 else 0
        due.append((np.arange(count) + 0.5) / wd if count else np.zeros(0))
        owner.append(np.full(count, d, np.int64))
        first.append(first[-1] + count)
    due_all, owner_all = np.concatenate(due), np.concatenate(owner)
    order = np.argsort(due_all, kind="stable")[:size]  # ties go to the earlier dataset
    dataset_index = owner_all[order].astype(np.int16)
    dataset_sample_index = order - np.asarray(first[:-1], np.int64)[dataset_index]
    return dataset_index, dataset_sample_index.astype(np.int64)


def megatron_blend_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """--data-order megatron: Megatron's build_blending_indices (helpers.cpp), equal element for element.

    Step by step, with s = max(step, 1), the dataset with the largest w_d * s - count_d serves (the first on
    ties); weights normalised as Megatron's BlendableDataset does. The rule is sequential; ``_greedy_blend``
    runs it on many segments of the steps at once: about 0.1 s for ten million samples of three datasets
    (a plain loop: 3-4 s), more where tiny weights keep segments from agreeing (at worst about the loop's time).
    """
    w = np.asarray(weights, dtype=np.float64)
    w = w / np.sum(w)
    dataset_index = _greedy_blend(w, size)
    return dataset_index, _sample_numbers(dataset_index)


def _greedy_blend(w: np.ndarray, size: int, segment: int | None = None, warmup: int = 64,
                  rounds: int = 16) -> np.ndarray:
    """Megatron's greedy blending choice for steps 0..size-1 (int16), by segments run side by side.

    Why it is exact. The choice at a step depends only on the step and the counts so far, so a run started from
    the true counts at some step continues the true sequence. Each step here does what helpers.cpp does, in
    float64 and in the same order: the product w_d * s rounded, then the count subtracted (an integer, held
    exactly below 2**53) and rounded, datasets compared in order with a strict > (the first maximum wins),
    the C++ compiled without fused multiply-adds (x86-64's default, as upstream builds it). Step 0 is
    Megatron's (s = 1, zero counts: the first largest weight). Steps 1.. are cut into segments of ``segment``
    steps, run side by side: one numpy operation serves every segment. Segment 0 starts from the true counts;
    every other from an estimate of its counts ``warmup`` steps before its start. Segment j is kept only when
    the counts it started with equal those segment j - 1 ended with: by induction from segment 0, the kept
    segments are the true sequence, whatever the estimates were. A segment not kept runs again from its
    predecessor's end: side by side while at least 32 are left (``rounds`` such passes at most; each settles
    at least the first of them), else one by one in a plain loop. The estimates decide the time taken, never
    the result. They are seldom off for long: the greedy forgets where it started, a run begun from wrong
    counts joins the true one within a few steps (within about 1/w_d steps where a tiny weight w_d is off),
    so most segments are kept at once.
    """
    n, out = len(w), np.empty(size, np.int16)
    if size == 0:
        return out
    out[0] = first = int(np.argmax(w))  # s = 1, zero counts: the first largest weight
    rest = size - 1
    if rest == 0:
        return out
    length = segment or max(64, math.isqrt(rest) // 4)
    warmup = min(warmup, length)
    m = -(-rest // length)
    starts = 1 + length * np.arange(m, dtype=np.int64)
    picks = np.empty((length, m), np.int16)
    begin, end = np.zeros((n, m)), np.empty((n, m))  # counts at each segment's first step and after its last
    begin[first, 0] = 1
    picks[:, :1], _, end[:, :1] = _greedy_segments(w, starts[:1], begin[:, :1], length)
    if m > 1:
        estimate = _greedy_estimate(w, starts[1:] - warmup, warmup)
        picks[:, 1:], begin[:, 1:], end[:, 1:] = _greedy_segments(w, starts[1:] - warmup, estimate, length + warmup,
                                                                  warmup)

    def unsettled(lo: int) -> np.ndarray:  # segments from lo on whose start differs from their predecessor's end
        return np.flatnonzero(np.any(begin[:, lo:] != end[:, lo - 1:-1], axis=0)) + lo

    redo, passes = unsettled(1), 0
    while len(redo):
        j = int(redo[0])  # segments before j are exact, so is the end of segment j - 1
        if passes < rounds and len(redo) >= 32:  # all together, each from its predecessor's end
            passes += 1
            begin[:, redo] = end[:, redo - 1]
            picks[:, redo], _, end[:, redo] = _greedy_segments(w, starts[redo], begin[:, redo], length)
            redo = unsettled(j)
            continue
        while j < m and not np.array_equal(begin[:, j], end[:, j - 1]):  # one by one from the first, in a loop
            begin[:, j] = end[:, j - 1]
            picks[:, j], end[:, j] = _greedy_loop(w, int(starts[j]), begin[:, j], length)
            j += 1
        redo = unsettled(j) if j < m else redo[:0]
    out[1:] = picks.T.reshape(-1)[:rest]
    return out


def _greedy_segments(w: np.ndarray, starts: np.ndarray, counts: np.ndarray, steps: int,
                     keep_from: int = 0) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Megatron's greedy rule for ``steps`` steps from each of ``starts`` (all >= 1, so s = step), side by side.

    counts: (datasets, segments), the counts at the starts. Returns the choices of steps keep_from..
    (steps - keep_from, segments), the counts at step keep_from and those after the last step.
    """
    counts = np.array(counts, dtype=np.float64, order="C")  # a copy: updated below through its flat view
    n, m = counts.shape
    first_step = starts.astype(np.float64)
    picks = np.empty((steps - keep_from, m), np.int16)
    s, error, best_error = np.empty(m), np.empty(m), np.empty(m)
    best, larger = np.empty(m, np.int16), np.empty(m, bool)
    flat, column = counts.reshape(-1), np.arange(m, dtype=np.int64)
    weights, kept = [float(x) for x in w], None
    for k in range(steps):
        if k == keep_from:
            kept = counts.copy()
        np.add(first_step, k, out=s)  # exact: steps are integers below 2**53
        np.multiply(s, weights[0], out=best_error)
        best_error -= counts[0]
        best.fill(0)
        for d in range(1, n):
            np.multiply(s, weights[d], out=error)
            error -= counts[d]
            np.greater(error, best_error, out=larger)  # strict: the first maximum keeps the step
            np.maximum(best_error, error, out=best_error)
            np.copyto(best, d, where=larger)
        if k >= keep_from:
            picks[k - keep_from] = best
        flat[best.astype(np.int64) * m + column] += 1
    return picks, kept, counts


def _greedy_loop(w: np.ndarray, start: int, counts: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The same rule for one segment in a plain loop (start >= 1): its choices and the counts after it."""
    weights, taken, picks = [float(x) for x in w], [int(c) for c in counts], []
    n = len(weights)
    for t in range(start, start + steps):
        s = float(t)
        best, best_error = 0, weights[0] * s - taken[0]
        for d in range(1, n):
            e = weights[d] * s - taken[d]
            if e > best_error:
                best, best_error = d, e
        picks.append(best)
        taken[best] += 1
    return np.array(picks, np.int16), np.array(taken, np.float64)


def _greedy_estimate(w: np.ndarray, steps: np.ndarray, warmup: int) -> np.ndarray:
    """Counts near the greedy's at each of ``steps``, summing to the step: floor(w_d * step) - 1 (at least 0),
    the rest handed out by the greedy rule among the datasets that shed one sample too many within about
    ``warmup`` steps. Too few of a light dataset is soon made up; one too many could stand for 1/w_d steps."""
    t = steps.astype(np.float64)
    counts = np.maximum(np.floor(np.multiply.outer(w, t)) - 1, 0)
    heavy = np.flatnonzero(w >= min(1.0 / max(warmup, 1), w.max()))
    short = steps - counts.sum(0).astype(np.int64)
    while (short > 0).any():
        d = heavy[np.argmax(np.multiply.outer(w[heavy], t) - counts[heavy], axis=0)]
        columns = np.flatnonzero(short > 0)
        counts[d[columns], columns] += 1
        short[columns] -= 1
    return counts


class BlendedDataset:
    """Samples drawn from several GPTDatasets by weight (deterministic, no randomness involved)."""

    def __init__(self, datasets: list[GPTDataset | None], weights: list[float], size: int, cache_dir: str,
                 description: dict, dataset_index: np.ndarray | None = None, order: str = "megatron"):
        self.datasets, self.weights, self.size = datasets, weights, size
        self.cache = _IndexCache(cache_dir, f"blend_{description['split_name']}_{order}", description,
                                 ("dataset_index", "dataset_sample_index"))

        def build():
            if dataset_index is not None:
                return {"dataset_index": dataset_index, "dataset_sample_index": _sample_numbers(dataset_index)}
            index, sample = (megatron_blend_indices if order == "megatron" else blend_indices)(weights, size)
            return {"dataset_index": index, "dataset_sample_index": sample}

        arrays = self.cache.get(build)
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        used = np.bincount(self.dataset_index, minlength=len(datasets))
        for part, count in zip(datasets, used.tolist()):
            if count and (part is None or count > len(part.shuffle_idx)):
                raise DataConfigError(f"--data-path: the {description['split_name']} blend takes {count} samples of a "
                                      f"dataset that has {len(part.shuffle_idx) if part else 0}")

    @property
    def built(self) -> bool:
        return self.cache.built

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} out of range ({self.size} blended samples)")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def _sample_numbers(dataset_index: np.ndarray) -> np.ndarray:
    """Each dataset's samples in order: the k-th step naming dataset d serves its sample k."""
    index = np.asarray(dataset_index)
    datasets = int(index.max()) + 1 if len(index) else 0
    if datasets <= 16:  # a pass per dataset: faster than the sort below for a few datasets
        numbers = np.empty(len(index), np.int64)
        for d in range(datasets):
            taken = index == d
            numbers[taken] = np.arange(np.count_nonzero(taken), dtype=np.int64)
        return numbers
    index = index.astype(np.int64)
    counts = np.bincount(index)
    order = np.argsort(index, kind="stable")
    numbers = np.empty(len(index), np.int64)
    numbers[order] = np.arange(len(index), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return numbers


def build_gpt_datasets(data_path: list[str], split: str, seq_length: int, seed: int,
                       num_samples: tuple[int, int, int], cache_dir: str | None = None, order: str = "megatron"):
    """(train, valid, test) datasets; None where a split has no documents or no samples are asked.

    order (--data-order): "megatron" serves Megatron-DeepSpeed's samples in its order (its split boundaries,
    doc_idx / sample_idx / shuffle_idx, blending, and 1.005 x weight x samples asked of each blended
    dataset); "mds" the order of mds before it (kept so runs and caches made with it continue unchanged).
    """
    if order not in DATA_ORDERS:
        raise DataConfigError(f"--data-order: {order!r} is not one of {', '.join(DATA_ORDERS)}")
    if seq_length < 1:
        raise DataConfigError(f"--seq-length: must be at least 1, got {seq_length}")
    pairs = parse_data_path(data_path)
    # Megatron blends a weighted list even of one dataset ("1.0 a": 0.5% more samples asked of it)
    weighted = len(data_path.split() if isinstance(data_path, str) else data_path) > 1
    parse_split(split)
    opened: dict[str, IndexedDataset] = {}
    for _, prefix in pairs:
        if prefix not in opened:
            try:
                opened[prefix] = IndexedDataset(prefix)
            except FileNotFoundError as e:
                raise DataConfigError(f"--data-path: {e}") from e
    result = []
    for s, name in enumerate(SPLIT_NAMES):
        wanted = int(num_samples[s])
        if wanted <= 0:
            result.append(None)
            continue
        if len(pairs) == 1 and not (order == "megatron" and weighted):
            ds = opened[pairs[0][1]]
            start, end = split_bounds(split, len(ds), order)[s]  # a "document" here is one stored sequence
            result.append(GPTDataset(ds, name, (start, end), split, seq_length, seed, wanted, cache_dir, order)
                          if end > start else None)
            continue
        bounds = [split_bounds(split, len(opened[prefix]), order)[s] for _, prefix in pairs]
        if all(end <= start for start, end in bounds):
            result.append(None)  # the split is empty everywhere, as for a single dataset
            continue
        weights = [w for w, _ in pairs]
        if order == "megatron":  # each dataset asked for 0.5% more than its share; the blend is built (and cached) below
            index, counts = None, [int(math.ceil(wanted * w * 1.005)) for w in weights]
        else:
            index = blend_indices(weights, wanted)[0]
            counts = np.bincount(index, minlength=len(pairs))
        parts, descriptions = [], []
        for (w, prefix), count, (start, end) in zip(pairs, counts, bounds):
            ds = opened[prefix]
            if count and end <= start:
                raise DataConfigError(f"--split: {split} leaves {prefix} no {name} documents, but --data-path gives "
                                      f"it weight {w:.3g}")
            part = (GPTDataset(ds, name, (start, end), split, seq_length, seed, int(count), cache_dir, order)
                    if count else None)
            parts.append(part)
            descriptions.append(part.cache.digest if part else None)
        description = {"class": "BlendedDataset", "format": INDEX_FORMAT, "split_name": name, "weights": weights,
                       "size": wanted, "parts": descriptions, "order": order}
        blend_dir = cache_dir or _default_cache_dir(pairs[0][1])
        result.append(BlendedDataset(parts, weights, wanted, blend_dir, description, index, order))
    return tuple(result)
