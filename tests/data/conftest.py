import json

import pytest

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def tokenize(text):\n    return [ord(c) for c in text]  # naïve\n",
    "Ünïcödé, emoji 🚀 and tabs\tand  double  spaces.\n\n",
    "Megatron writes indexed datasets; DeepSpeed trains the model.",
]


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory):
    """A tiny GPT-2-style byte-level BPE (vocab.json + merges.txt) trained here with `tokenizers`."""
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("gpt2bpe")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS * 20, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save_model(str(out))
    return str(out / "vocab.json"), str(out / "merges.txt")


@pytest.fixture(scope="session")
def hf_tokenizer_json(tmp_path_factory):
    """A tokenizer.json (BPE, whitespace pre-tokenizer, </s> and <pad> specials) trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("hftok")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<pad>", "</s>"],
                                                            show_progress=False))
    path = out / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def write_jsonl(path, docs, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({key: doc}) + "\n")
    return str(path)
