"""Bad data is refused before the first step: token ids outside the padded vocabulary, and .bin/.idx pairs that do
not agree, exit 2 from `entrypoint train`'s validation with one line naming the dataset (no rank starts, no
traceback); the token range behind it is scanned once and cached (megatron_ds/data/token_range.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_ds.data.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from megatron_ds.data.token_range import TokenRange, cache_file, scan, token_range

ENTRYPOINT = os.path.join(os.path.dirname(sys.executable), "entrypoint")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def dataset(prefix, documents, dtype=np.uint16) -> str:
    with IndexedDatasetWriter(str(prefix), dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    return str(prefix)


def train(tmp_path, prefix: str, *extra: str) -> subprocess.CompletedProcess:
    """`entrypoint train --dry-run` on a NullTokenizer of 100 ids (vocabulary 101 with its EOD, padded to 128)."""
    argv = [ENTRYPOINT, "train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--data-path",
            prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--dry-run", *extra]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def refused(result: subprocess.CompletedProcess) -> str:
    """The one error line of a refusal (exit 2, no traceback)."""
    assert result.returncode == 2, f"{result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("entrypoint train: error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


# -- the scan and its cache ---------------------------------------------------------------------------------


def test_scan_finds_min_and_max_across_chunks_and_checks_the_index(tmp_path):
    docs = [np.arange(10), np.array([7, -3, 5]), np.array([70000])]
    ds_prefix = dataset(tmp_path / "signed", docs, np.int32)
    assert scan(IndexedDataset(ds_prefix), chunk=4) == TokenRange(-3, 70000, 14)
    empty = dataset(tmp_path / "empty", [])
    assert scan(IndexedDataset(empty)) == TokenRange(0, -1, 0)


def test_the_range_is_cached_and_scanned_again_when_the_data_changes(tmp_path):
    prefix = dataset(tmp_path / "corpus", [np.array([1, 2, 3]), np.array([40])])
    found, note = token_range(prefix)
    assert found == TokenRange(0, 40, 4) and note is None
    path = cache_file(prefix, None)
    assert os.path.dirname(path) == str(tmp_path / "index-cache")
    record = json.loads(open(path).read())
    record["range"]["high"] = 12345  # what a cache hit would return: proves the second call reads it
    with open(path, "w") as f:
        json.dump(record, f)
    assert token_range(prefix)[0].high == 12345
    dataset(tmp_path / "corpus", [np.array([1, 2, 3]), np.array([41])])  # same size, new contents and mtime
    assert token_range(prefix)[0].high == 41
    custom = tmp_path / "elsewhere"
    assert token_range(prefix, str(custom))[0].high == 41 and os.listdir(custom)


def test_an_unwritable_cache_is_a_note_not_an_error(tmp_path):
    prefix = dataset(tmp_path / "corpus", [np.array([5, 6])])
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would go")
    found, note = token_range(prefix, str(blocked))
    assert found.high == 6 and "could not be cached" in note and "--data-cache-path" in note


def test_a_bad_index_entry_is_found_by_the_scan(tmp_path):
    """Opening checks the ends of the index; the scan checks every entry (a middle pointer that lies)."""
    prefix = dataset(tmp_path / "corpus", [np.array([1, 2]), np.array([3]), np.array([4])])
    raw = bytearray(open(prefix + ".idx", "rb").read())
    at = 34 + 4 * 3 + 8  # pointers[1], after the header and three int32 sizes
    assert int.from_bytes(raw[at:at + 8], "little") == 4
    raw[at:at + 8] = (2).to_bytes(8, "little")
    open(prefix + ".idx", "wb").write(bytes(raw))
    with pytest.raises(IndexedDatasetError, match="pointers not consistent with sizes at sequence 1"):
        token_range(prefix)


# -- refused by `entrypoint train` --------------------------------------------------------------------------


def test_an_id_past_the_padded_vocabulary_exits_2_naming_dataset_id_and_vocabulary(tmp_path):
    prefix = dataset(tmp_path / "corpus", [np.arange(50), np.array([3, 200, 9])])
    line = refused(train(tmp_path, prefix))
    assert line == (f"entrypoint train: error: --data-path: {prefix}: token ids must lie in [0, 128) and the largest "
                    "is 200: the vocabulary is 128 (NullTokenizer's 101, padded to a multiple of "
                    "--make-vocab-size-divisible-by 128 x TP 1); tokenize the data with this tokenizer "
                    "(`entrypoint preprocess`) or give the tokenizer it was made with"), line


def test_a_negative_id_exits_2(tmp_path):
    prefix = dataset(tmp_path / "corpus", [np.array([4, -1, 5])], np.int32)
    assert "token ids must lie in [0, 128) and the smallest is -1" in refused(train(tmp_path, prefix))


def test_padding_is_megatrons_divisible_by_times_tp(tmp_path):
    """Ids in [vocabulary, padded) have embedding rows: 200 fits TP 2's 256 rows, not TP 1's 128."""
    prefix = dataset(tmp_path / "corpus", [np.arange(60), np.array([200])])
    two = train(tmp_path, prefix, "--tensor-model-parallel-size", "2", "--nproc-per-node", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "nothing started (--dry-run)" in two.stdout
    smaller = refused(train(tmp_path, prefix, "--make-vocab-size-divisible-by", "64", "--tensor-model-parallel-size",
                            "2", "--nproc-per-node", "2"))
    assert "must lie in [0, 128)" in smaller and "multiple of --make-vocab-size-divisible-by 64 x TP 2" in smaller


def test_a_truncated_bin_exits_2_at_validation(tmp_path):
    prefix = dataset(tmp_path / "corpus", [np.arange(40), np.arange(30)])
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(100)
    line = refused(train(tmp_path, prefix))
    assert f"--data-path: {prefix}.bin: size 100 bytes does not match the index {prefix}.idx" in line, line
    assert line.endswith("rebuild it (`entrypoint preprocess`) or give the right --data-path"), line


def test_a_bin_with_another_corpus_index_exits_2(tmp_path):
    prefix = dataset(tmp_path / "corpus", [np.arange(40)])
    other = dataset(tmp_path / "other", [np.arange(10), np.arange(20)])
    os.replace(other + ".idx", prefix + ".idx")
    line = refused(train(tmp_path, prefix))
    assert f"{prefix}.bin: size 80 bytes does not match the index {prefix}.idx, which needs" in line, line


def test_a_later_start_reads_the_cached_range(tmp_path):
    """Good data passes; the next start takes the range from the cache, not the .bin (a cache edited to say 999
    is refused, naming 999)."""
    prefix = dataset(tmp_path / "corpus", [np.arange(100)])
    assert train(tmp_path, prefix).returncode == 0
    path = cache_file(prefix, None)
    record = json.loads(open(path).read())
    assert record["range"] == {"low": 0, "high": 99, "tokens": 100}
    record["range"]["high"] = 999
    with open(path, "w") as f:
        json.dump(record, f)
    assert "and the largest is 999" in refused(train(tmp_path, prefix))
