"""Megatron's memory-mapped indexed dataset (``MMIDIDX`` version 1), byte-exact.

``<prefix>.bin`` holds the token ids of every sequence back to back, no header.
``<prefix>.idx`` is little-endian, unpadded::

    magic b"MMIDIDX\\x00\\x00" | uint64 version=1 | uint8 dtype code | uint64 N | uint64 D
    int32 sizes[N] | int64 pointers[N] (byte offset of each sequence in .bin) | int64 doc_idx[D]

so the file is exactly 34 + 12 N + 8 D bytes. Both files are memory-mapped: opening a 100 GB
corpus reads 34 bytes and a few index entries, and costs page cache only for what is touched.
"""

from __future__ import annotations

import os
import struct
from array import array

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N sequences, D = documents + 1
assert HEADER.size == 34

DTYPES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODES = {np.dtype(t): code for code, t in DTYPES.items()}


class IndexedDatasetError(ValueError):
    """A malformed .idx/.bin pair; the message names the file and what is wrong with it."""


def best_dtype(vocab_size: int | None) -> type:
    """Megatron's rule: uint16 when the vocabulary has fewer than 65500 entries, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def index_path(prefix: str) -> str:
    return f"{prefix}.idx"


def data_path(prefix: str) -> str:
    return f"{prefix}.bin"


def exists(prefix: str) -> bool:
    return os.path.isfile(index_path(prefix)) and os.path.isfile(data_path(prefix))


class IndexedDataset:
    """Read-only view of ``<prefix>.{idx,bin}``; ``ds[i]`` is sequence i as a numpy array.

    Opening is O(1): the header, both file sizes and the first/last index entries are checked.
    Each read checks the pointers of the sequence it reads; ``validate()`` checks every entry
    (O(N), in bounded chunks) and is what index builders call.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_file, bin_file = index_path(prefix), data_path(prefix)
        for path in (idx_file, bin_file):
            if not os.path.isfile(path):
                hint = " (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
                raise FileNotFoundError(f"{path}: no such file (indexed dataset prefix {prefix!r}){hint}")
        self._idx_file, self._bin_file = idx_file, bin_file
        idx_size = os.path.getsize(idx_file)
        if idx_size < HEADER.size:
            raise IndexedDatasetError(
                f"{idx_file}: truncated index: {idx_size} bytes, shorter than the {HEADER.size}-byte header")
        with open(idx_file, "rb") as f:
            magic, version, code, n, d = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise IndexedDatasetError(
                f"{idx_file}: wrong magic {magic!r}, expected {MAGIC!r} (not a Megatron mmap indexed dataset)")
        if version != VERSION:
            raise IndexedDatasetError(f"{idx_file}: unsupported version {version}, only version {VERSION} is supported")
        if code not in DTYPES:
            raise IndexedDatasetError(
                f"{idx_file}: unknown dtype code {code}, expected one of {sorted(DTYPES)}")
        expected = HEADER.size + 12 * n + 8 * d
        if idx_size != expected:
            problem = "truncated index" if idx_size < expected else "trailing bytes in index"
            raise IndexedDatasetError(
                f"{idx_file}: {problem}: {idx_size} bytes, but the header (N={n} sequences, D={d} doc_idx "
                f"entries) implies 34 + 12*N + 8*D = {expected}")
        if d < 1:
            raise IndexedDatasetError(f"{idx_file}: doc_idx has {d} entries, needs at least 1 (the leading 0)")
        self.dtype = DTYPES[code]
        self._itemsize = np.dtype(self.dtype).itemsize
        buf = self._idx = np.memmap(idx_file, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(buf, np.int32, n, HEADER.size)
        self.pointers = np.frombuffer(buf, np.int64, n, HEADER.size + 4 * n)
        self.doc_idx = np.frombuffer(buf, np.int64, d, HEADER.size + 12 * n)

        self._bin_size = os.path.getsize(bin_file)
        expected_bin = int(self.pointers[-1]) + int(self.sizes[-1]) * self._itemsize if n else 0
        if n and (self.pointers[0] != 0 or self.sizes[0] < 0 or self.sizes[-1] < 0):
            raise IndexedDatasetError(
                f"{idx_file}: pointers not consistent with sizes: pointers[0]={self.pointers[0]} (must be 0), "
                f"sizes[0]={self.sizes[0]}, sizes[-1]={self.sizes[-1]}")
        if self._bin_size != expected_bin:
            raise IndexedDatasetError(
                f"{bin_file}: size {self._bin_size} bytes does not match the index {idx_file}, which needs "
                f"pointers[-1] + sizes[-1] * {self._itemsize} = {expected_bin} bytes")
        if self.doc_idx[0] != 0 or self.doc_idx[-1] != n:
            raise IndexedDatasetError(
                f"{idx_file}: doc_idx must start at 0 and end at N={n}, got {self.doc_idx[0]} .. {self.doc_idx[-1]}")
        # An empty .bin cannot be memory-mapped; nothing can be read from it either.
        self._bin = np.memmap(bin_file, mode="r", dtype=np.uint8) if self._bin_size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``i`` (a view into the mapped .bin)."""
        n = len(self.sizes)
        if not -n <= i < n:
            raise IndexError(f"{self.prefix}: sequence {i} out of range (N={n})")
        i %= n
        size, pointer = int(self.sizes[i]), int(self.pointers[i])
        end = pointer + size * self._itemsize
        if size < 0 or pointer < 0 or end > self._bin_size or (i + 1 < n and int(self.pointers[i + 1]) != end):
            raise IndexedDatasetError(
                f"{self._idx_file}: pointers not consistent with sizes at sequence {i}: pointer {pointer}, "
                f"size {size}, next pointer {int(self.pointers[i + 1]) if i + 1 < n else '-'}")
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) outside sequence {i} of size {size}")
        start = pointer + offset * self._itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    def validate(self, chunk: int = 1 << 22) -> None:
        """Check every index entry: sizes >= 0, pointers = running sum of sizes, doc_idx nondecreasing."""
        n, idx_file = len(self.sizes), self._idx_file
        expected_next = 0
        for lo in range(0, n, chunk):
            sizes = self.sizes[lo:lo + chunk].astype(np.int64)
            pointers = self.pointers[lo:lo + chunk]
            if (sizes < 0).any():
                bad = lo + int(np.argmax(sizes < 0))
                raise IndexedDatasetError(f"{idx_file}: negative size {self.sizes[bad]} at sequence {bad}")
            expected = expected_next + np.concatenate(([0], np.cumsum(sizes[:-1] * self._itemsize)))
            if not np.array_equal(expected, pointers):
                bad = lo + int(np.argmax(expected != pointers))
                raise IndexedDatasetError(
                    f"{idx_file}: pointers not consistent with sizes at sequence {bad}: pointer "
                    f"{self.pointers[bad]}, expected {expected[bad - lo]} (previous pointer + size * {self._itemsize})")
            expected_next = int(expected[-1] + sizes[-1] * self._itemsize)
        for lo in range(0, len(self.doc_idx), chunk):
            part = self.doc_idx[max(lo - 1, 0):lo + chunk]
            if (np.diff(part) < 0).any():
                raise IndexedDatasetError(f"{idx_file}: doc_idx is not nondecreasing near entry {lo}")


def write_index(path: str, sizes, dtype, doc_idx=None) -> None:
    """Write an .idx for sequences of ``sizes`` tokens stored back to back (pointers follow from sizes);
    ``doc_idx`` defaults to one document per sequence."""
    sizes = np.asarray(sizes, dtype=np.int32)
    dtype = np.dtype(dtype)
    doc_idx = np.arange(len(sizes) + 1, dtype=np.int64) if doc_idx is None else np.asarray(doc_idx, np.int64)
    pointers = np.zeros(len(sizes), np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, CODES[dtype], len(sizes), len(doc_idx)))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_idx.astype("<i8").tobytes())


class IndexedDatasetWriter:
    """Streams sequences to ``<prefix>.bin`` and writes ``<prefix>.idx`` at ``finalize()``.

    Both files are written under temporary names and renamed at the end (the old .idx is removed
    first, the new .idx renamed last), so an interrupted run never leaves a pair that looks valid.
    Used as a context manager, an exception removes the temporary files.
    """

    def __init__(self, prefix: str, dtype: type = np.int32):
        if np.dtype(dtype) not in CODES:
            raise ValueError(f"dtype {np.dtype(dtype)} has no indexed-dataset code; use one of "
                             f"{sorted(str(np.dtype(t)) for t in DTYPES.values())}")
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        parent = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(parent, exist_ok=True)
        suffix = f".tmp.{os.getpid()}"
        self._tmp_bin, self._tmp_idx = data_path(prefix) + suffix, index_path(prefix) + suffix
        self._bin = open(self._tmp_bin, "wb")
        self._sizes = array("i")
        self._doc_idx = array("q", [0])
        self.num_tokens = 0
        self._done = False

    def add_item(self, tokens) -> None:
        """Append one sequence (a sentence, or a whole document)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(arr.size)
        self.num_tokens += arr.size

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens) -> None:
        """Append one document stored as a single sequence (what GPT pretraining data uses)."""
        self.add_item(tokens)
        self.end_document()

    def add_documents(self, flat_tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many single-sequence documents at once: their tokens back to back and their lengths."""
        flat = np.asarray(flat_tokens, dtype=self.dtype)
        self._bin.write(flat.tobytes(order="C"))
        first = len(self._sizes)
        self._sizes.extend(np.asarray(lengths, dtype=np.int32).tolist())
        self._doc_idx.extend(range(first + 1, len(self._sizes) + 1))
        self.num_tokens += flat.size

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        self._bin.close()
        sizes = np.frombuffer(self._sizes, np.int32) if len(self._sizes) else np.zeros(0, np.int32)
        doc_idx = np.frombuffer(self._doc_idx, np.int64)
        if doc_idx[-1] != len(sizes):  # sequences added after the last end_document() close a document
            doc_idx = np.append(doc_idx, len(sizes))
        write_index(self._tmp_idx, sizes, self.dtype, doc_idx)
        for path in (self._tmp_bin, self._tmp_idx):
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
        final_idx = index_path(self.prefix)
        if os.path.lexists(final_idx):
            os.remove(final_idx)
        os.replace(self._tmp_bin, data_path(self.prefix))
        os.replace(self._tmp_idx, final_idx)
        self._done = True

    def abort(self) -> None:
        """Drop the temporary files (the final names are never touched)."""
        if not self._bin.closed:
            self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()
