import json
import os
import sys

import pytest
from tokenizers import ByteLevelBPETokenizer, Tokenizer

from megatron_ds.data.tokenizers import TokenizerError, build_tokenizer

SAMPLES = [
    "Hello world, hello Megatron!",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "naïve café — 日本語 🚀",
    "text with <|endoftext|> inside is plain text",
    "",
]


def test_gpt2_bpe_ids_equal_tokenizers_library(gpt2_files):
    vocab, merges = gpt2_files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    ref = ByteLevelBPETokenizer.from_file(vocab, merges)
    for text in SAMPLES:
        ids = ours.tokenize(text)
        assert ids == ref.encode(text).ids
        assert ours.detokenize(ids) == text
    assert ours.tokenize_batch(SAMPLES) == [ref.encode(t).ids for t in SAMPLES]
    assert ours.eod == json.load(open(vocab))["<|endoftext|>"]
    assert ours.eod not in ours.tokenize(SAMPLES[3])  # in-text marker is not the EOD id (as GPT-2 did)
    assert ours.vocab_size == len(json.load(open(vocab)))


def test_hf_tokenizer_ids_equal_tokenizers_library(hf_tokenizer_json, tmp_path):
    ours = build_tokenizer("HFTokenizer", tokenizer_model=hf_tokenizer_json)
    ref = Tokenizer.from_file(hf_tokenizer_json)
    for text in SAMPLES:
        assert ours.tokenize(text) == ref.encode(text).ids
    assert ours.tokenize_batch(SAMPLES) == [e.ids for e in ref.encode_batch(SAMPLES)]
    assert ours.eod == ref.token_to_id("</s>") and ours.vocab_size == ref.get_vocab_size()
    # a tokenizer_config.json next to the file names the EOS token
    copy = tmp_path / "tokenizer.json"
    copy.write_text(open(hf_tokenizer_json).read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert build_tokenizer("HFTokenizer", tokenizer_model=str(copy)).eod == ref.token_to_id("<pad>")


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert tok.tokenize("5 17  999") == [5, 17, 999]
    assert tok.eod == 1000 and tok.vocab_size == 1001
    assert tok.detokenize([1, 2]) == "1 2"


def test_errors_name_the_flag(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    with pytest.raises(TokenizerError, match="--vocab-file: required by --tokenizer-type GPT2BPETokenizer"):
        build_tokenizer("GPT2BPETokenizer", merge_file=merges)
    with pytest.raises(TokenizerError, match=r"--merge-file: .*nope\.txt: no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=str(tmp_path / "nope.txt"))
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(json.dumps({k: v for k, v in json.load(open(vocab)).items() if k != "<|endoftext|>"}))
    with pytest.raises(TokenizerError, match=r"--vocab-file: .*has no <\|endoftext\|> token"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(no_eod), merge_file=merges)
    with pytest.raises(TokenizerError, match="--tokenizer-model"):
        build_tokenizer("HFTokenizer", tokenizer_model=vocab)  # not a tokenizer.json
    with pytest.raises(TokenizerError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(TokenizerError, match="--tokenizer-type: unknown type 'SentencePiece'"):
        build_tokenizer("SentencePiece")
    assert os.path.isfile(vocab)


# --- GPT2BPETokenizer on tiktoken: the same ids as the `tokenizers` library -------------------------------------

def varied_texts(seed=0, n=400):
    """Random text mixing every kind of character the pre-tokenizer tells apart, from all Unicode planes."""
    import random

    rng = random.Random(seed)
    pieces = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "''", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n",
              " \n ", "\u00a0", "\u3000", "\u2028", "\x0b", "\x0c", "\x85", "0", "42", "٣", "Ⅻ", "½", "a", "Zürich",
              "naïve", "日本語", "한국어", "Ελληνικά", "кириллица", "עברית", "العربية", "हिन्दी", "🚀", "👩‍👩‍👧",
              "🇺🇳", "e\u0301", "ﬁ", "\u200b", "\ufeff", "<|endoftext|>", "!", "...", "$", "€", "__init__", "x=1;",
              "\x00", "\x7f", "\U0001d400", "\U00020000", "\U000e0001", "\U0010fffd"]
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 60)):
            if rng.random() < 0.8:
                parts.append(rng.choice(pieces))
            else:
                c = rng.randint(0, 0x10FFFF)
                parts.append(chr(c) if not 0xD800 <= c <= 0xDFFF else "\ufffd")
        texts.append("".join(parts))
    return texts


def stdlib_texts(limit=1_500_000):
    import sysconfig
    from pathlib import Path

    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(texts[-1])
        if size >= limit:
            break
    return texts


@pytest.fixture(scope="module")
def trained_bpe(tmp_path_factory):
    """A 4000-token byte-level BPE trained on stdlib sources and varied Unicode text, as demo_corpus trains one."""
    out = tmp_path_factory.mktemp("bpe4k")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(stdlib_texts(600_000) + varied_texts(seed=1), vocab_size=4000, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(out))
    return str(out / "vocab.json"), str(out / "merges.txt")


def assert_same_ids(vocab, merges, texts, backend="tiktoken"):
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert ours.backend == backend
    ref = ByteLevelBPETokenizer.from_file(vocab, merges)
    expected = [e.ids for e in ref.encode_batch(texts)]
    assert ours.tokenize_batch(texts) == expected
    assert [ours.tokenize(t) for t in texts[:50]] == expected[:50]
    assert sum(map(len, expected)) > len(texts)  # real merges happened
    return ours


def test_tiktoken_ids_equal_tokenizers_library(trained_bpe, gpt2_files):
    texts = varied_texts() + stdlib_texts() + SAMPLES + ["<|endoftext|>", "a<|endoftext|>b", " " * 50, "\r\n" * 9,
                                                         "1234567890" * 20, "🚀" * 30, "x  \n\t y \t"]
    for vocab, merges in (trained_bpe, gpt2_files):
        ours = assert_same_ids(vocab, merges, texts)
        eod = json.load(open(vocab))["<|endoftext|>"]
        assert eod not in ours.tokenize("a<|endoftext|>b")  # the in-text marker stays ordinary text
        assert ours.detokenize(ours.tokenize(texts[0])) == texts[0]


def test_tiktoken_ids_equal_with_ids_out_of_merge_order(trained_bpe, tmp_path):
    """Ids need not follow merge order (tiktoken ranks then are merge positions, mapped to our ids)."""
    import random

    vocab, merges = trained_bpe
    tokens = list(json.load(open(vocab)))
    random.Random(0).shuffle(tokens)
    shuffled = tmp_path / "vocab.json"
    shuffled.write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    assert_same_ids(str(shuffled), merges, varied_texts(seed=2, n=200) + stdlib_texts(300_000))


def test_falls_back_to_tokenizers_when_tiktoken_cannot_mirror(trained_bpe, tmp_path, monkeypatch):
    vocab, merges = trained_bpe
    lines = open(merges, encoding="utf-8").read().splitlines()
    merged = {a + b: (a, b) for a, b in (m.split(" ") for m in lines[1:])}
    # a second merge making a token an earlier merge makes: tiktoken cannot rank both
    token = next(t for t, (a, b) in merged.items() if len(b) > 1 and a + b[:-1] in merged)
    a, b = merged[token]
    (tmp_path / "merges.txt").write_text("\n".join(lines + [f"{a + b[:-1]} {b[-1]}"]) + "\n", encoding="utf-8")
    texts = varied_texts(seed=3, n=100) + [token * 3]
    assert_same_ids(vocab, str(tmp_path / "merges.txt"), texts, backend="tokenizers")
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # not installed
    assert_same_ids(vocab, merges, texts, backend="tokenizers")


def test_lone_surrogate_is_refused_by_both_backends(trained_bpe, monkeypatch):
    text = json.loads('"ok \\ud800 bad"')
    with pytest.raises(ValueError, match="lone surrogate"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=trained_bpe[0], merge_file=trained_bpe[1]).tokenize(text)
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(TypeError):
        build_tokenizer("GPT2BPETokenizer", vocab_file=trained_bpe[0], merge_file=trained_bpe[1]).tokenize(text)


def test_tiktoken_splits_text_like_the_bytelevel_pre_tokenizer():
    """Both regex engines put each code point in the same class (letter, number, space, other): `a`+c is one piece
    iff c is a letter, `1`+c iff a number, tab+c iff a space, `!`+c iff other; for every code point."""
    import tiktoken
    from tokenizers import pre_tokenizers

    from megatron_ds.data.tokenizers import GPT2_PATTERN

    hf = pre_tokenizers.ByteLevel(add_prefix_space=False)
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    differ = []
    for lo in range(0, len(points), 0x8000):
        block = points[lo:lo + 0x8000]
        for prefix in ("a", "1", "\t", "!"):
            ranks = {bytes([b]): b for b in range(256)}
            ranks.update({(prefix + chr(c)).encode(): 256 + i for i, c in enumerate(block)})
            enc = tiktoken.Encoding("probe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
            for c in block:  # one token: the whole text was one piece
                text = prefix + chr(c)
                if (len(enc.encode_ordinary(text)) == 1) != (len(hf.pre_tokenize_str(text)) == 1):
                    differ.append((prefix, hex(c)))
    assert not differ
    assert len(points) == 0x110000 - 0x800
