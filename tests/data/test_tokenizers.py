import json
import os

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
