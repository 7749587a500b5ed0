"""Tokenizers for preprocessing and training, all on the Rust `tokenizers` library.

- GPT2BPETokenizer: GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file``
  (merges.txt); ``<|endoftext|>`` ends a document. Text is encoded as GPT-2 did, so an
  ``<|endoftext|>`` *inside* the text is ordinary text, never the EOD id.
- HFTokenizer: any ``tokenizer.json`` (``--tokenizer-model``), encoded with its own special tokens.
- NullTokenizer: text is space-separated ids (``--vocab-size``); EOD is ``vocab_size``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HFTokenizer", "NullTokenizer")
EOD_TEXT = "<|endoftext|>"
# End-of-document candidates for a bare tokenizer.json, in order of preference.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class TokenizerError(ValueError):
    """A bad tokenizer configuration; ``flag`` names the option at fault."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


class Tokenizer:
    """The interface the pipeline uses: ids in, ids out, and the end-of-document id."""

    vocab_size: int  # unpadded
    eod: int

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


class _RustTokenizer(Tokenizer):
    def __init__(self, tokenizer, add_special_tokens: bool):
        self._tok = tokenizer
        self._add_special = add_special_tokens
        # encode_batch_fast (tokenizers >= 0.21) skips offset tracking we never use.
        self._batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self._add_special).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._batch(list(texts), add_special_tokens=self._add_special)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _require_file(flag: str, path: str | None, tokenizer_type: str) -> str:
    if not path:
        raise TokenizerError(flag, f"required by --tokenizer-type {tokenizer_type}")
    if not os.path.isfile(path):
        raise TokenizerError(flag, f"{path}: no such file")
    return path


class GPT2BPETokenizer(_RustTokenizer):
    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers

        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the Rust error says what is wrong, not which file
            raise TokenizerError("--vocab-file/--merge-file", f"cannot load {vocab_file} + {merge_file}: {e}") from e
        tok = RustTokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        super().__init__(tok, add_special_tokens=False)
        eod = tok.token_to_id(EOD_TEXT)
        if eod is None:
            raise TokenizerError("--vocab-file", f"{vocab_file} has no {EOD_TEXT} token (the end-of-document id)")
        self.eod = eod


class HFTokenizer(_RustTokenizer):
    def __init__(self, tokenizer_model: str):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            tok = RustTokenizer.from_file(tokenizer_model)
        except Exception as e:
            raise TokenizerError("--tokenizer-model", f"cannot load {tokenizer_model}: {e}") from e
        super().__init__(tok, add_special_tokens=True)
        self.eod = self._find_eod(tokenizer_model)

    def _find_eod(self, path: str) -> int:
        """The EOS token named by a tokenizer_config.json next to the file, else a well-known name."""
        config = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
        names: list[str] = []
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.append(eos)
        for name in (*names, *_EOS_NAMES):
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        raise TokenizerError("--tokenizer-model", f"{path}: no end-of-document token found (looked for "
                             f"eos_token in {config} and for {', '.join(_EOS_NAMES)})")


class NullTokenizer(Tokenizer):
    """Text is already ids separated by spaces; the EOD id is one past the given vocabulary."""

    def __init__(self, vocab_size: int):
        if vocab_size is None or vocab_size < 1:
            raise TokenizerError("--vocab-size", f"must be a positive integer for NullTokenizer, got {vocab_size}")
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(tokenizer_type: str, *, vocab_file: str | None = None, merge_file: str | None = None,
                    tokenizer_model: str | None = None, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer named by ``--tokenizer-type``; missing or unreadable files raise TokenizerError."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_require_file("--vocab-file", vocab_file, tokenizer_type),
                                _require_file("--merge-file", merge_file, tokenizer_type))
    if tokenizer_type == "HFTokenizer":
        return HFTokenizer(_require_file("--tokenizer-model", tokenizer_model, tokenizer_type))
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise TokenizerError("--tokenizer-type", f"unknown type {tokenizer_type!r}, expected one of {', '.join(TOKENIZER_TYPES)}")
