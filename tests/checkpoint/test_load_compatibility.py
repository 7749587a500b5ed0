"""The check before a load compares the model each side really has, through `entrypoint train --load`.

The flags alone leave the vocabulary (tokenizer files, padding), the KV heads, the FFN size and the
biases to defaults and files; two runs whose flags look alike can build different models. Each case
trains nothing: exit 2, a message naming every difference, the checkpoint untouched, nothing saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt_helpers import run, train_argv

from megatron_ds.checkpoint import layout as paths

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory, demo_corpus) -> Path:
    """Two iterations of the default GPT, saved."""
    cwd = tmp_path_factory.mktemp("saved")
    run(train_argv(demo_corpus, 1, ["--save", "ckpt", "--eval-iters", "0"], iters=2), cwd)
    return cwd / "ckpt"


def _snapshot(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*")}


def _vocab_copy(demo_corpus, dest: Path, edit) -> tuple[str, str]:
    dest.mkdir(parents=True, exist_ok=True)
    vocab = json.loads(Path(demo_corpus.vocab_file).read_text())
    edit(vocab)
    (dest / "vocab.json").write_text(json.dumps(vocab))
    (dest / "merges.txt").write_text(Path(demo_corpus.merge_file).read_text())
    return str(dest / "vocab.json"), str(dest / "merges.txt")


def _refused(saved: Path, demo_corpus, tmp_path: Path, flags: list[str], corpus=None) -> str:
    before = _snapshot(saved)
    argv = train_argv(corpus or demo_corpus, 1, ["--load", str(saved), "--save", "out", "--eval-iters", "0", *flags],
                      iters=3)
    result = run(argv, tmp_path, code=None)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert _snapshot(saved) == before  # the checkpoint is untouched
    assert paths.list_checkpoints(str(tmp_path / "out")) == []  # and nothing was saved
    return result.stderr


def test_saved_metadata_records_the_resolved_model(saved):
    model = json.loads((saved / "iter_0000002" / "mds_checkpoint.json").read_text())["model"]
    assert model["vocab_size"] == 4096 and model["padded_vocab_size"] == 4096
    assert (model["num_key_value_heads"], model["ffn_hidden_size"], model["add_bias_linear"]) == (4, 256, True)
    assert len(model["tokenizer_sha256"]) == 64


class _Corpus:
    def __init__(self, demo_corpus, vocab_file: str, merge_file: str):
        self.prefix, self.vocab_file, self.merge_file = demo_corpus.prefix, vocab_file, merge_file


def test_other_vocabulary_size_is_refused(saved, demo_corpus, tmp_path):
    """More tokens in the vocabulary file: the flags are identical, the embedding is not."""
    def add_tokens(vocab):
        for i in range(200):
            vocab[f"extra{i}"] = len(vocab)

    corpus = _Corpus(demo_corpus, *_vocab_copy(demo_corpus, tmp_path / "tok", add_tokens))
    stderr = _refused(saved, demo_corpus, tmp_path, [], corpus=corpus)
    assert "vocabulary: checkpoint 4096 tokens, this run 4296" in stderr


def test_same_size_other_tokenizer_is_refused(saved, demo_corpus, tmp_path):
    """Two ids swapped: every size agrees, the token ids mean other text. --finetune does not skip it."""
    def swap(vocab):
        names = sorted(vocab, key=vocab.get)
        a, b = names[300], names[301]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    corpus = _Corpus(demo_corpus, *_vocab_copy(demo_corpus, tmp_path / "tok", swap))
    stderr = _refused(saved, demo_corpus, tmp_path, ["--finetune"], corpus=corpus)
    assert "vocabulary: the tokenizer files differ in content (both 4096 tokens" in stderr


def test_resolved_shape_differences_are_each_named(saved, demo_corpus, tmp_path):
    stderr = _refused(saved, demo_corpus, tmp_path, ["--num-key-value-heads", "2", "--disable-bias-linear",
                                                     "--ffn-hidden-size", "128",
                                                     "--untie-embeddings-and-output-weights"])
    assert "--num-key-value-heads: checkpoint 4, this run 2" in stderr
    assert "--disable-bias-linear (add_bias_linear): checkpoint True, this run False" in stderr
    assert "--ffn-hidden-size: checkpoint 256, this run 128" in stderr
    assert "--untie-embeddings-and-output-weights: checkpoint False, this run True" in stderr
