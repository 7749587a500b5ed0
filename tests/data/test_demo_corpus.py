import json
import os
import subprocess
import sys
import time

import numpy as np

from megatron_ds.data.demo_corpus import collect_sources, prepare
from megatron_ds.data.indexed import IndexedDataset
from megatron_ds.data.tokenizers import build_tokenizer


def test_demo_corpus_is_a_valid_eod_terminated_dataset(demo_corpus):
    ds = IndexedDataset(demo_corpus.prefix)
    ds.validate()
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=demo_corpus.vocab_file, merge_file=demo_corpus.merge_file)
    assert tok.vocab_size == demo_corpus.vocab_size == 4096 and ds.dtype is np.uint16
    assert len(ds) == demo_corpus.num_documents > 100 and int(ds.sizes.sum()) == demo_corpus.num_tokens
    assert all(ds[i][-1] == tok.eod for i in range(0, len(ds), 10))
    with open(os.path.join(os.path.dirname(demo_corpus.prefix), "stdlib.jsonl"), encoding="utf-8") as f:
        first = json.loads(f.readline())
    assert tok.detokenize(ds[0][:-1].tolist()) == first["text"]
    assert first["path"] == collect_sources()[0][0]


def _package(path: str) -> str:
    return path.split("/")[0] if "/" in path else "<top-level modules>"


def test_the_validation_documents_come_from_across_the_library(demo_corpus):
    """The demo's validation split (the last documents) must look like its training split: several parts
    of the library, not one package (sorted paths once made it five encodings/ codec tables)."""
    from megatron_ds.data.gpt_dataset import split_bounds
    from megatron_ds.demo import SPLIT

    paths = [path for path, _ in collect_sources()]
    assert len(paths) == demo_corpus.num_documents
    start, end = split_bounds(SPLIT, len(paths))[1]
    valid = paths[start:end]
    assert len(valid) >= 5, valid
    assert len({_package(p) for p in valid}) >= 4, valid
    assert sum(p.startswith("encodings/") for p in valid) <= len(valid) // 2, valid
    packages = {_package(p) for p in paths}
    assert len(packages) >= 30, sorted(packages)  # the training split spans the library too
    assert paths != sorted(paths)


SOURCES = "import json; from megatron_ds.data.demo_corpus import collect_sources; " \
          "print(json.dumps([path for path, _ in collect_sources()]))"


def test_the_document_order_is_the_same_in_every_process(tmp_path):
    orders = [subprocess.run([sys.executable, "-c", SOURCES], check=True, timeout=120, capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert orders[0] == orders[1] and json.loads(orders[0])[0] == collect_sources()[0][0]


def test_second_prepare_is_instant_and_identical(demo_corpus):
    start = time.perf_counter()
    again = prepare(os.path.dirname(demo_corpus.prefix))
    assert time.perf_counter() - start < 2.0
    assert again == demo_corpus


TRAIN = """
import sys
from megatron_ds.data.demo_corpus import collect_sources, train_bpe
train_bpe([t for _, t in collect_sources(300_000)], sys.argv[1], vocab_size=1000)
"""


def test_bpe_training_is_deterministic_across_processes(tmp_path):
    outs = [tmp_path / "a", tmp_path / "b"]
    for out, hashseed in zip(outs, ("1", "2")):
        out.mkdir()
        subprocess.run([sys.executable, "-c", TRAIN, str(out)], check=True, timeout=120,
                       env={**os.environ, "PYTHONHASHSEED": hashseed})
    for name in ("vocab.json", "merges.txt"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
