"""SentencePiece tokenizers: `sentencepiece`'s own ids, and the special tokens of Megatron-DeepSpeed's classes.

The models are trained here on text the test writes; ``llama_like`` has LLaMA-2's settings (BPE, byte fallback,
digits split, no normalization, <unk>=0 <s>=1 </s>=2, no pad)."""

import random

import numpy as np
import pytest
import sentencepiece
from conftest import TEXTS, write_jsonl

from megatron_ds.data.indexed import IndexedDataset
from megatron_ds.data.preprocess import TokenizerSpec, build_parser, main, preprocess
from megatron_ds.data.tokenizers import (TOKENIZER_FLAGS, TOKENIZER_TYPES, TokenizerError, build_tokenizer,
                                         check_tokenizer_flags)

SP_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
SAMPLES = [
    "Hello world, hello Megatron!",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "trailing spaces   ",
    "digits 1234567890 and 3.14159, 2^64 = 18446744073709551616",
    "naïve café — 日本語 🚀 Ünïcödé ﬁ ① \u3000 full-width ＡＢＣ",
    "combining e\u0301 and \r\n windows line ends",
    "\n starts with a newline",
    "",
    " ",
]


def varied_texts(seed=0, n=200):
    """Random text of words, digits, whitespace runs and characters the models never saw."""
    rng = random.Random(seed)
    pieces = ["the", "quick", "Megatron", "fox", " ", "  ", "\t", "\n", "\r\n", "0", "42", "2024", "3.5", ".", ",",
              "—", "é", "日本", "🚀", "ﬁ", "\u00a0", "\u200b", "Ω", "ß", "ğ", "\U0001f9ea", "'s", "<", ">", "/"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 30))) for _ in range(n)]


def train(tmp_path_factory, name, **options):
    """A SentencePiece model trained on TEXTS and SAMPLES, written here; returns its path."""
    out = tmp_path_factory.mktemp(name)
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join((TEXTS + SAMPLES) * 20), encoding="utf-8")
    prefix = str(out / "tokenizer")
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=prefix, hard_vocab_limit=False,
                                             minloglevel=2, **options)
    return prefix + ".model"


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory):
    return train(tmp_path_factory, "llama_like", model_type="bpe", vocab_size=400, byte_fallback=True,
                 split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
                 character_coverage=0.99995)


@pytest.fixture(scope="module")
def unigram_with_pad(tmp_path_factory):
    """Default (NFKC) normalization, a pad piece of its own and <SEP> among its pieces."""
    return train(tmp_path_factory, "unigram_pad", model_type="unigram", vocab_size=200, pad_id=3,
                 user_defined_symbols=["<SEP>"])


def reference(path):
    return sentencepiece.SentencePieceProcessor(model_file=path)


@pytest.mark.parametrize("model", ["llama_like", "unigram_with_pad"])
def test_ids_equal_sentencepiece(model, request):
    path = request.getfixturevalue(model)
    sp = reference(path)
    texts = SAMPLES + varied_texts()
    expected = [sp.encode(t) for t in texts]
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=path)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=path)
    general = build_tokenizer("SentencePieceTokenizer", tokenizer_model=path)
    for text, ids in zip(texts, expected):
        assert gpt.tokenize(text) == ids
        assert llama.tokenize(text) == [sp.bos_id(), *ids]
        if not any(s in text for s in general.special_tokens):
            assert general.tokenize(text) == ids
    assert gpt.tokenize_batch(texts) == expected
    assert llama.tokenize_batch(texts) == [[sp.bos_id(), *ids] for ids in expected]
    assert general.tokenize_batch(texts) == [general.tokenize(t) for t in texts]
    assert any(len(sp.id_to_piece(i).lstrip("\u2581")) > 2 for ids in expected for i in ids)  # learned words


def test_special_ids_and_vocab_size_as_upstream_llama_like(llama_like):
    sp = reference(llama_like)
    n = sp.get_piece_size()
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)  # LLaMA-2's
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=llama_like)
    assert (gpt.vocab_size, gpt.eod, gpt.bos, gpt.eos, gpt.pad) == (n, 2, 1, 2, -1)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=llama_like)
    assert (llama.vocab_size, llama.eod, llama.bos, llama.eos, llama.pad) == (n, 2, 1, 2, -1)
    # Upstream appends <CLS> <SEP> <EOD> <MASK>, then <PAD> (the model has no pad); <s> and </s> are the model's.
    general = build_tokenizer("SentencePieceTokenizer", tokenizer_model=llama_like)
    assert (general.cls, general.sep, general.eod, general.mask, general.pad) == (n, n + 1, n + 2, n + 3, n + 4)
    assert (general.bos, general.eos, general.vocab_size) == (1, 2, n + 5)
    assert general.special_tokens == {"<CLS>": n, "<SEP>": n + 1, "<EOD>": n + 2, "<MASK>": n + 3, "<PAD>": n + 4,
                                      "<s>": 1, "</s>": 2}


def test_special_ids_and_vocab_size_as_upstream_existing_pieces(unigram_with_pad):
    sp = reference(unigram_with_pad)
    n, sep = sp.get_piece_size(), sp.piece_to_id("<SEP>")
    assert sp.pad_id() == 3 and sep not in (0, sp.unk_id())
    general = build_tokenizer("SentencePieceTokenizer", tokenizer_model=unigram_with_pad)
    # The model's <SEP> and pad piece keep their ids; only <CLS>, <EOD>, <MASK> are appended, in that order.
    assert (general.cls, general.sep, general.eod, general.mask) == (n, sep, n + 1, n + 2)
    assert (general.pad, general.bos, general.eos, general.vocab_size) == (3, 1, 2, n + 3)
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=unigram_with_pad)
    assert (gpt.vocab_size, gpt.eod, gpt.bos, gpt.pad) == (n, 2, 1, 3)


def test_model_without_bos_gets_appended_bos_token(tmp_path_factory):
    path = train(tmp_path_factory, "no_bos", model_type="bpe", vocab_size=300, bos_id=-1, eos_id=1)
    n = reference(path).get_piece_size()
    general = build_tokenizer("SentencePieceTokenizer", tokenizer_model=path)
    assert (general.pad, general.bos, general.eos, general.vocab_size) == (n + 4, n + 5, 1, n + 6)
    assert list(general.special_tokens)[4:] == ["<PAD>", "<BOS>", "</s>"]
    assert build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=path).bos == -1
    with pytest.raises(TokenizerError, match=r"--tokenizer-model: .*has no BOS piece.*Llama2Tokenizer"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=path)


def upstream_split(text, specials):
    """Upstream's rule, written plainly: the special token found earliest in the rest of the text comes next
    (the first in order where two start at one place); the text before it is encoded on its own."""
    parts = []
    while True:
        found = [(text.find(s), i, s) for i, s in enumerate(specials) if s in text]
        if not found:
            return parts + [text]
        at, _, special = min(found)
        parts += [text[:at], special]
        text = text[at + len(special):]


def test_general_tokenizer_maps_special_tokens_in_text(llama_like):
    sp = reference(llama_like)
    general = build_tokenizer("SentencePieceTokenizer", tokenizer_model=llama_like)
    s = general.special_tokens
    text = "Hello<EOD>world</s><s> x <CLS><SEP>\n<MASK>"
    assert general.tokenize(text) == [*sp.encode("Hello"), s["<EOD>"], *sp.encode("world"), 2, 1, *sp.encode(" x "),
                                      s["<CLS>"], s["<SEP>"], *sp.encode("\n"), s["<MASK>"]]
    rng = random.Random(1)
    texts = ["".join(rng.choice([*varied_texts(2, 5), *s, "<EO", "D>", "<"]) for _ in range(12)) for _ in range(200)]
    for text in texts:
        parts = upstream_split(text, list(s))
        expected = [i for k, p in enumerate(parts) for i in (sp.encode(p) if k % 2 == 0 else [s[p]])]
        assert general.tokenize(text) == expected
    assert general.tokenize_batch(texts) == [general.tokenize(t) for t in texts]
    # GPTSentencePieceTokenizer and Llama2Tokenizer read them as plain text, as `sentencepiece` does.
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=llama_like)
    assert gpt.tokenize(text) == sp.encode(text) and 2 not in gpt.tokenize("a</s>b")


def test_detokenize_round_trip(llama_like, unigram_with_pad):
    texts = SAMPLES + varied_texts(3)
    for kind in SP_TYPES:
        tok = build_tokenizer(kind, tokenizer_model=llama_like)
        for text in texts:  # no normalization and byte fallback: every text comes back as it was
            assert tok.detokenize(tok.tokenize(text)) == text
        assert tok.detokenize(np.array(tok.tokenize(texts[0]), dtype=np.uint16)) == texts[0]  # ids read from .bin
    general = build_tokenizer("SentencePieceTokenizer", tokenizer_model=llama_like)
    # Upstream's rendering of special tokens: each stands alone between spaces.
    assert general.detokenize(general.tokenize("a<EOD>b</s>")) == "a <EOD> b </s> "
    sp = reference(unigram_with_pad)  # NFKC: the model's own decoding, which normalizes
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=unigram_with_pad)
    for text in texts:
        assert tok.detokenize(tok.tokenize(text)) == sp.decode(sp.encode(text))


def read_bytes(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


@pytest.mark.parametrize("kind", SP_TYPES)
def test_preprocess_one_and_two_workers_identical_and_decodes(kind, llama_like, tmp_path):
    docs = SAMPLES + varied_texts(4, 150) + ["with <EOD> and </s> inside"]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    spec = TokenizerSpec(kind, tokenizer_model=llama_like)
    one = preprocess(src, str(tmp_path / "w1"), spec, append_eod=True, workers=1, chunk_bytes=400, progress=False)
    two = preprocess(src, str(tmp_path / "w2"), spec, append_eod=True, workers=2, chunk_bytes=400, progress=False)
    assert one.documents == two.documents == len(docs) and one.tokens == two.tokens
    assert read_bytes(str(tmp_path / "w1_text_document")) == read_bytes(str(tmp_path / "w2_text_document"))
    tok = build_tokenizer(kind, tokenizer_model=llama_like)
    sp = reference(llama_like)
    ds = IndexedDataset(str(tmp_path / "w2_text_document"))
    ds.validate()
    assert ds.dtype is np.uint16 and len(ds) == len(docs)
    for i, doc in enumerate(docs):
        ids = ds[i].tolist()
        assert ids == tok.tokenize(doc) + [tok.eod]
        if kind == "SentencePieceTokenizer":
            assert ids[-1] == sp.get_piece_size() + 2  # <EOD>
            if "<" not in doc:
                assert tok.detokenize(ids[:-1]) == doc
        else:
            assert ids[-1] == 2 and (ids[0] == 1) == (kind == "Llama2Tokenizer")  # </s>; <s> first for Llama2
            assert tok.detokenize(ids) == doc  # <s> and </s> decode to nothing


def test_preprocess_cli(llama_like, tmp_path, capsys):
    docs = SAMPLES + varied_texts(5, 50)
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    assert main(["--input", src, "--output-prefix", str(tmp_path / "cli"), "--tokenizer-type", "Llama2Tokenizer",
                 "--tokenizer-model", llama_like, "--append-eod", "--workers", "2", "--no-progress"]) == 0
    assert f"{len(docs)} documents" in capsys.readouterr().out
    preprocess(src, str(tmp_path / "fn"), TokenizerSpec("Llama2Tokenizer", tokenizer_model=llama_like),
               append_eod=True, progress=False)
    assert read_bytes(str(tmp_path / "cli_text_document")) == read_bytes(str(tmp_path / "fn_text_document"))
    assert main(["--input", src, "--output-prefix", str(tmp_path / "x"), "--tokenizer-type",
                 "GPTSentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "none.model")]) == 2
    assert "--tokenizer-model: " in capsys.readouterr().err
    choices = next(a.choices for a in build_parser()._actions if a.dest == "tokenizer_type")
    assert set(SP_TYPES) <= set(choices) and list(choices) == list(TOKENIZER_TYPES)


@pytest.mark.parametrize("kind", SP_TYPES)
def test_missing_or_invalid_model_file(kind, tmp_path, tmp_path_factory):
    with pytest.raises(TokenizerError, match=f"--tokenizer-model: required by --tokenizer-type {kind}"):
        build_tokenizer(kind)
    with pytest.raises(TokenizerError, match=r"--tokenizer-model: .*nope\.model: no such file"):
        build_tokenizer(kind, tokenizer_model=str(tmp_path / "nope.model"))
    with pytest.raises(TokenizerError, match=r"--tokenizer-model: .*: a directory, not a file"):
        build_tokenizer(kind, tokenizer_model=str(tmp_path))
    bad = tmp_path / "tokenizer.model"
    bad.write_text("this is not a SentencePiece model\n")
    with pytest.raises(TokenizerError, match=r"--tokenizer-model: cannot load .*tokenizer\.model as a SentencePiece"):
        build_tokenizer(kind, tokenizer_model=str(bad))


def test_model_without_eos_is_refused_where_eos_is_eod(tmp_path_factory):
    path = train(tmp_path_factory, "no_eos", model_type="bpe", vocab_size=300, eos_id=-1)
    for kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        with pytest.raises(TokenizerError, match=f"--tokenizer-model: .*has no EOS piece.*{kind} ends documents"):
            build_tokenizer(kind, tokenizer_model=path)
    general = build_tokenizer("SentencePieceTokenizer", tokenizer_model=path)  # its EOD is <EOD>; EOS is <EOS>
    n = reference(path).get_piece_size()
    assert (general.eod, general.eos, general.vocab_size) == (n + 2, n + 5, n + 6)


def test_flag_table_drives_the_checks(tmp_path):
    assert set(SP_TYPES) <= set(TOKENIZER_FLAGS) and all(TOKENIZER_FLAGS[k] == ("--tokenizer-model",) for k in SP_TYPES)
    existing = str(tmp_path / "file")
    open(existing, "w").close()
    given = {"vocab_file": existing, "merge_file": existing, "tokenizer_model": existing, "vocab_size": 10}
    for kind, flags in TOKENIZER_FLAGS.items():
        check_tokenizer_flags(kind, **given)
        for flag in flags:
            dest = flag[2:].replace("-", "_")
            with pytest.raises(TokenizerError, match=f"^{flag}: required by --tokenizer-type {kind}$") as e:
                check_tokenizer_flags(kind, **{**given, dest: None})
            assert e.value.flag == flag and e.value.message == f"required by --tokenizer-type {kind}"
    with pytest.raises(TokenizerError, match="--tokenizer-type: unknown type 'Llama3Tokenizer'"):
        check_tokenizer_flags("Llama3Tokenizer")
