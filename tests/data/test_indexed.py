import os
import struct
import time

import numpy as np
import pytest

from megatron_ds.data.indexed import (DTYPES, MAGIC, IndexedDataset, IndexedDatasetError, IndexedDatasetWriter,
                                      best_dtype)


def hand_built(prefix):
    """The format description spelled out with struct: uint16 sequences [1,2,3] [4] [5,6] in documents
    {0,1} and {2}."""
    idx = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, 3, 3)
    idx += struct.pack("<3i", 3, 1, 2)  # sizes
    idx += struct.pack("<3q", 0, 6, 8)  # byte pointers
    idx += struct.pack("<3q", 0, 2, 3)  # doc_idx
    assert len(idx) == 34 + 12 * 3 + 8 * 3
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)
    with open(prefix + ".bin", "wb") as f:
        f.write(struct.pack("<6H", 1, 2, 3, 4, 5, 6))
    return idx


def write(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document(doc)


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = np.dtype(DTYPES[code])
    rng = np.random.default_rng(code)
    lo, hi = (np.iinfo(dtype).min, np.iinfo(dtype).max) if dtype.kind in "iu" else (-1e6, 1e6)
    docs = [rng.uniform(lo, hi, size=n).astype(dtype) for n in (5, 0, 1, 17, 3)]
    prefix = str(tmp_path / "rt")
    write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    ds.validate()
    assert ds.dtype == dtype.type and len(ds) == 5 and ds.num_documents == 5
    assert ds.sizes.tolist() == [5, 0, 1, 17, 3]
    assert ds.doc_idx.tolist() == [0, 1, 2, 3, 4, 5]
    for got, want in zip((ds[i] for i in range(5)), docs):
        assert got.dtype == dtype and np.array_equal(got, want)
    assert np.array_equal(ds.get(3, 2, 4), docs[3][2:6])
    assert os.path.getsize(prefix + ".idx") == 34 + 12 * 5 + 8 * 6
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == MAGIC and struct.unpack("<QB", f.read(9)) == (1, code)


def test_hand_built_index_loads(tmp_path):
    prefix = str(tmp_path / "hand")
    hand_built(prefix)
    ds = IndexedDataset(prefix)
    ds.validate()
    assert ds.dtype is np.uint16 and len(ds) == 3 and ds.num_documents == 2
    assert [ds[i].tolist() for i in range(3)] == [[1, 2, 3], [4], [5, 6]]
    assert ds.sizes.dtype == np.int32 and ds.pointers.tolist() == [0, 6, 8] and ds.doc_idx.tolist() == [0, 2, 3]
    assert ds.get(0, offset=1, length=2).tolist() == [2, 3] and ds.get(2, offset=1).tolist() == [6]
    assert ds[-1].tolist() == [5, 6]
    with pytest.raises(IndexError):
        ds[3]


def test_writer_bytes_equal_hand_built(tmp_path):
    want_idx = hand_built(str(tmp_path / "hand"))
    prefix = str(tmp_path / "ours")
    w = IndexedDatasetWriter(prefix, np.uint16)
    w.add_item([1, 2, 3])
    w.add_item([4])
    w.end_document()
    w.add_document([5, 6])
    w.finalize()
    assert open(prefix + ".idx", "rb").read() == want_idx
    assert open(prefix + ".bin", "rb").read() == open(str(tmp_path / "hand.bin"), "rb").read()
    assert sorted(os.listdir(tmp_path)) == ["hand.bin", "hand.idx", "ours.bin", "ours.idx"]  # no temporaries left


def test_add_documents_equals_add_document(tmp_path):
    docs = [[3, 1, 4], [1], [5, 9, 2, 6]]
    write(str(tmp_path / "a"), docs, np.uint16)
    w = IndexedDatasetWriter(str(tmp_path / "b"), np.uint16)
    w.add_documents(np.concatenate(docs), [3, 1, 4])
    w.finalize()
    for ext in (".idx", ".bin"):
        assert open(tmp_path / f"a{ext}", "rb").read() == open(tmp_path / f"b{ext}", "rb").read()


def test_writer_aborts_on_exception(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "x"), np.int32) as w:
            w.add_document([1, 2])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_best_dtype_is_megatrons_rule():
    assert best_dtype(50257) is np.uint16 and best_dtype(65499) is np.uint16
    assert best_dtype(65500) is np.int32 and best_dtype(128256) is np.int32 and best_dtype(None) is np.int32


def corrupt(tmp_path, edit_idx=None, edit_bin=None):
    prefix = str(tmp_path / "bad")
    idx = bytearray(hand_built(prefix))
    if edit_idx:
        idx = edit_idx(idx)
        with open(prefix + ".idx", "wb") as f:
            f.write(idx)
    if edit_bin:
        with open(prefix + ".bin", "ab") as f:
            f.write(edit_bin)
    return prefix


def patch(offset, fmt, value):
    def edit(idx):
        struct.pack_into(fmt, idx, offset, value)
        return idx
    return edit


@pytest.mark.parametrize("name, edit_idx, edit_bin, problem", [
    ("wrong magic", patch(0, "<9s", b"NOTMMIDX\x00"), None, "wrong magic"),
    ("version 2", patch(9, "<Q", 2), None, "unsupported version 2"),
    ("dtype code 9", patch(17, "<B", 9), None, "unknown dtype code 9"),
    ("shorter than header", lambda idx: idx[:20], None, "truncated index"),
    ("truncated body", lambda idx: idx[:-5], None, "truncated index"),
    ("trailing bytes", lambda idx: idx + b"\0", None, "trailing bytes"),
    ("bin too long", None, b"\0\0", "does not match the index"),
    ("first pointer", patch(34 + 12, "<q", 2), None, "pointers not consistent with sizes"),
    ("last pointer", patch(34 + 12 + 16, "<q", 10), None, "does not match the index"),
    ("doc_idx end", patch(34 + 36 + 16, "<q", 2), None, "doc_idx must start at 0 and end at N"),
])
def test_malformed_files_are_named_errors(tmp_path, name, edit_idx, edit_bin, problem):
    prefix = corrupt(tmp_path, edit_idx, edit_bin)
    with pytest.raises(IndexedDatasetError) as err:
        IndexedDataset(prefix)
    assert problem in str(err.value)
    assert str(tmp_path / "bad.") in str(err.value)  # names the file


def test_inconsistent_middle_pointer_caught_on_read_and_validate(tmp_path):
    prefix = str(tmp_path / "mid")
    write(prefix, [[1, 2, 3], [4, 5], [6], [7, 8]], np.uint16)
    with open(prefix + ".idx", "r+b") as f:  # pointer of sequence 1: 6 -> 4
        f.seek(34 + 4 * 4 + 8)
        f.write(struct.pack("<q", 4))
    ds = IndexedDataset(prefix)  # O(1) open checks only the ends
    with pytest.raises(IndexedDatasetError, match=r"mid\.idx: pointers not consistent with sizes at sequence 0"):
        ds[0]
    with pytest.raises(IndexedDatasetError, match=r"mid\.idx: pointers not consistent with sizes at sequence 1"):
        ds.validate()
    assert ds[2].tolist() == [6]  # untouched entries still read


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.idx"):
        IndexedDataset(str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match=r"give the prefix, without \.bin/\.idx"):
        IndexedDataset(str(tmp_path / "nothing.bin"))


def test_huge_sparse_corpus_opens_in_milliseconds(tmp_path):
    """100 GB of uint16 tokens (a sparse .bin) with 50 sequences of 1e9 tokens: open + read is O(1)."""
    prefix = str(tmp_path / "huge")
    n, size = 50, 10**9
    sizes = np.full(n, size, np.int32)
    pointers = np.arange(n, dtype=np.int64) * size * 2
    with open(prefix + ".idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", MAGIC, 1, 8, n, n + 1) + sizes.tobytes() + pointers.tobytes()
                + np.arange(n + 1, dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(n * size * 2)
        f.seek(n * size * 2 - 2)
        f.write(struct.pack("<H", 7))
    start = time.perf_counter()
    ds = IndexedDataset(prefix)
    last = ds.get(n - 1, offset=size - 3)
    elapsed = time.perf_counter() - start
    assert last.tolist() == [0, 0, 7]
    assert elapsed < 0.5, f"opening a 100 GB corpus took {elapsed:.3f} s"
