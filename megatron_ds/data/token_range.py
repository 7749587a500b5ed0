"""The smallest and largest token id in an indexed dataset, found once and cached, so that training can refuse a
corpus its vocabulary cannot embed before any rank starts (an id past the embedding is an IndexError on the CPU
and a device-side assert on a GPU, deep inside the first step).

The scan reads the whole ``.bin`` through a memory map in chunks small enough to stay in the CPU's cache (numpy's
vectorised min and max); since it reads everything anyway, it also checks every index entry
(IndexedDataset.validate). Its result is a small JSON file in the index cache directory (``index-cache/`` beside
the data, or --data-cache-path), keyed by the ``.bin``'s and ``.idx``'s size and modification time: a changed
file is scanned again, an unchanged one costs one stat and one read.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass

import numpy as np

from megatron_ds.data.indexed import IndexedDataset, data_path, index_path

CHUNK = 1 << 20  # tokens per read: 1-4 MB, within a core's cache for the second pass (max after min)


@dataclass(frozen=True)
class TokenRange:
    """min and max token id (0 and -1 for an empty dataset) and the number of tokens."""

    low: int
    high: int
    tokens: int


def scan(ds: IndexedDataset, chunk: int = CHUNK) -> TokenRange:
    """Every index entry checked, then the min and max over every token of the .bin (IndexedDatasetError on a bad
    index)."""
    ds.validate()
    bin_file = data_path(ds.prefix)
    tokens = np.memmap(bin_file, dtype=ds.dtype, mode="r") if os.path.getsize(bin_file) else np.zeros(0, ds.dtype)
    signed = np.dtype(ds.dtype).kind != "u"  # unsigned ids cannot be negative: one pass, not two
    low, high = 0, -1
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        high = max(high, int(part.max()))
        if signed:
            low = min(low, int(part.min()))
    return TokenRange(low, high, len(tokens))


def _key(prefix: str) -> dict:
    """What the cached result depends on: both files' paths, sizes and modification times."""
    key = {}
    for kind, path in (("bin", data_path(prefix)), ("idx", index_path(prefix))):
        st = os.stat(path)
        key[kind] = {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return key


def cache_file(prefix: str, cache_dir: str | None) -> str:
    """<cache_dir or the data's index-cache/>/<name>_<hash of the path>_token_range.json."""
    absolute = os.path.abspath(prefix)
    directory = cache_dir or os.path.join(os.path.dirname(absolute), "index-cache")
    digest = hashlib.sha256(absolute.encode()).hexdigest()[:12]
    return os.path.join(directory, f"{os.path.basename(absolute)}_{digest}_token_range.json")


def token_range(prefix: str, cache_dir: str | None = None) -> tuple[TokenRange, str | None]:
    """(the dataset's token range, None or a note that it could not be cached); opening the dataset raises
    IndexedDatasetError for a truncated or mismatched .bin/.idx pair, the scan for a bad index entry."""
    ds = IndexedDataset(prefix)
    path, key = cache_file(prefix, cache_dir), _key(prefix)
    try:
        with open(path) as f:
            cached = json.load(f)
        if cached.get("key") == key:
            return TokenRange(**cached["range"]), None
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, unreadable or from another format: scan
    found = scan(ds)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".tmp.")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from the other users of a shared corpus
        with os.fdopen(fd, "w") as f:  # a name of its own: ranks on several nodes may scan at once
            json.dump({"key": key, "range": asdict(found)}, f)
        os.replace(tmp, path)
    except OSError as err:
        return found, (f"note: the token range of {prefix} could not be cached in {os.path.dirname(path)} ({err}); "
                       "every start scans the data again: give --data-cache-path a writable directory")
    return found, None
