"""Benchmark building the GPT sample indices (doc_idx, sample_idx, shuffle_idx; blending index), and the scan
that refuses token ids outside the vocabulary before training (data/token_range.py).

    python bench/bench_index.py [--documents 1000000] [--tokens 1e9] [--seq-length 2048]

A synthetic corpus of --documents documents and about --tokens tokens exists only as its .idx (written
by megatron_ds.data.indexed.write_index) and a sparse .bin of the right size (truncate: no 2 GB written).
Times, in a fresh cache directory: build_gpt_datasets for one prefix (train/valid/test of --split, train
asking for one epoch of samples), the same again from the cache, and a two-prefix weighted blend.
Target (issue 2): the single-prefix build in at most 10 s on the 2-core CI machines.
The token-range scan gets a real corpus of the same size (uint16 ids below GPT-2's 50257): timed with the .bin
out of the page cache (posix_fadvise DONTNEED after an fsync: read from disk), again from the page cache, and
the cached lookup every later start does.
Writes bench/results/<name>.json with the command, machine, load average and date.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.bench_preprocess import cpu_model
from bench.common import REPO, environment, write_record
from megatron_ds.data.gpt_dataset import build_gpt_datasets
from megatron_ds.data.indexed import write_index
from megatron_ds.data.token_range import token_range


def synthetic_corpus(prefix: str, documents: int, tokens: float, seed: int) -> np.ndarray:
    mean = tokens / documents
    sizes = np.random.default_rng(seed).integers(1, int(2 * mean), documents).astype(np.int32)
    write_index(prefix + ".idx", sizes, np.uint16)
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(sizes.sum(dtype=np.int64)) * 2)  # sparse: the index build never reads token data
    return sizes


def real_corpus(prefix: str, documents: int, tokens: int, dtype: np.dtype, vocab: int = 50257) -> None:
    """``tokens`` random ids below ``vocab`` in ``documents`` documents, written in 64 M-token pieces."""
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.integers(1, tokens, documents - 1))
    write_index(prefix + ".idx", np.diff(np.concatenate(([0], cuts, [tokens]))).astype(np.int32), dtype)
    with open(prefix + ".bin", "wb") as f:
        for start in range(0, tokens, 1 << 26):
            f.write(rng.integers(0, vocab, min(1 << 26, tokens - start), dtype=dtype).tobytes())
        f.flush()
        os.fsync(f.fileno())


def drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def token_range_times(work_dir: Path, documents: int, tokens: int) -> dict:
    """The token-range scan of a real corpus: from disk, from the page cache, and the cached lookup."""
    prefix = str(work_dir / "real")
    _, write_s = timed(lambda: real_corpus(prefix, documents, tokens, np.dtype(np.uint16)))
    for path in (prefix + ".bin", prefix + ".idx"):
        drop_from_page_cache(path)
    (cold, _), cold_s = timed(lambda: token_range(prefix, str(work_dir / "range-cold")))
    (warm, _), warm_s = timed(lambda: token_range(prefix, str(work_dir / "range-warm")))  # a fresh cache: a scan
    (cached, _), cached_s = timed(lambda: token_range(prefix, str(work_dir / "range-warm")))
    assert cold == warm == cached and cold.high < 50257 and cold.tokens == tokens, (cold, warm, cached)
    return {"token_range_bin_gb": round(tokens * 2 / 1e9, 3), "token_range_corpus_write_s": round(write_s, 2),
            "token_range_scan_from_disk_s": round(cold_s, 3), "token_range_scan_from_page_cache_s": round(warm_s, 3),
            "token_range_cached_lookup_s": round(cached_s, 5)}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_index", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=1_000_000)
    p.add_argument("--tokens", type=float, default=1e9)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--split", default="969,30,1")
    p.add_argument("--work-dir", type=Path, default=REPO / "data" / "bench-index")
    p.add_argument("--name", default="index_cpu")
    args = p.parse_args(argv)
    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)

    prefixes = [str(args.work_dir / name) for name in ("a", "b")]
    sizes = [synthetic_corpus(prefix, args.documents, args.tokens, seed) for seed, prefix in enumerate(prefixes)]
    total = int(sizes[0].sum(dtype=np.int64))
    train_tokens = int(sizes[0][: int(round(args.documents * 969 / 1000))].sum(dtype=np.int64))
    num_samples = (train_tokens // args.seq_length - 1, 10_000, 1_000)
    load = os.getloadavg()

    def single(cache):
        return build_gpt_datasets([prefixes[0]], args.split, args.seq_length, 1234, num_samples,
                                  cache_dir=str(args.work_dir / cache))

    (train, _, _), cold = timed(lambda: single("cache"))
    assert train.built
    (train2, _, _), warm = timed(lambda: single("cache"))
    assert not train2.built
    blend, blend_s = timed(lambda: build_gpt_datasets(["0.3", prefixes[0], "0.7", prefixes[1]], args.split,
                                                      args.seq_length, 1234, num_samples,
                                                      cache_dir=str(args.work_dir / "cache-blend")))
    shares = np.bincount(np.asarray(blend[0].dataset_index), minlength=2) / len(blend[0])
    scan = token_range_times(args.work_dir, args.documents, total)
    result = {
        "kind": "index", "name": args.name, "command": " ".join([sys.executable, *sys.argv]),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count()}, **environment(),
        "corpus": {"documents": args.documents, "tokens": total, "seq_length": args.seq_length, "split": args.split,
                   "num_samples": num_samples, "epochs": len(train.doc_idx) // round(args.documents * 969 / 1000)},
        "build_s": round(cold, 3), "cached_open_s": round(warm, 4),
        "blend_two_prefixes_build_s": round(blend_s, 3), "blend_shares": shares.round(5).tolist(),
        "loadavg_before": load, "loadavg_after": os.getloadavg(), "target_build_s": 10.0,
        "meets_target": cold <= 10.0, **scan,
    }
    path = write_record(result, REPO / "bench" / "results", args.name)
    print(f"{args.documents:,} documents, {total:,} tokens, {num_samples[0]:,} train samples of {args.seq_length}: "
          f"build {cold:.2f} s, cached open {warm * 1000:.1f} ms, "
          f"2-prefix blend build {blend_s:.2f} s (shares {shares.round(4).tolist()}); token-range scan "
          f"{scan['token_range_scan_from_disk_s']:.2f} s from disk, {scan['token_range_scan_from_page_cache_s']:.2f} s "
          f"from the page cache, cached {scan['token_range_cached_lookup_s'] * 1000:.2f} ms; load {load[0]:.1f}; "
          f"wrote {path}")
    shutil.rmtree(args.work_dir, ignore_errors=True)
    return 0 if cold <= 10.0 else 1


if __name__ == "__main__":
    sys.exit(main())
