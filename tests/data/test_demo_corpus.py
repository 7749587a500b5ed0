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
