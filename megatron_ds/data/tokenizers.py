"""Tokenizers for preprocessing and training, on the Rust `tokenizers` library (and `tiktoken` for speed) and
`sentencepiece`.

- GPT2BPETokenizer: GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file``
  (merges.txt); ``<|endoftext|>`` ends a document. Text is encoded as GPT-2 did, so an
  ``<|endoftext|>`` *inside* the text is ordinary text, never the EOD id. Encoding runs on `tiktoken`
  (about 4x faster than `tokenizers` here, the same ids) where it is installed and the files allow it.
- HFTokenizer: any ``tokenizer.json`` (``--tokenizer-model``), encoded with its own special tokens.
- NullTokenizer: text is space-separated ids (``--vocab-size``); EOD is ``vocab_size``.
- SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: a SentencePiece ``tokenizer.model``
  (``--tokenizer-model``, e.g. LLaMA-2's), with the ids, special tokens and vocabulary size of Megatron-DeepSpeed's
  classes of these names (Llama2Tokenizer: ALCF's fork); see each class.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Sequence

import numpy as np

# The flags each --tokenizer-type needs, for argument checks anywhere (check_tokenizer_flags reads it).
TOKENIZER_FLAGS: dict[str, tuple[str, ...]] = {
    "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
    "HFTokenizer": ("--tokenizer-model",),
    "NullTokenizer": ("--vocab-size",),
    "SentencePieceTokenizer": ("--tokenizer-model",),
    "GPTSentencePieceTokenizer": ("--tokenizer-model",),
    "Llama2Tokenizer": ("--tokenizer-model",),
}
FILE_FLAGS = frozenset({"--vocab-file", "--merge-file", "--tokenizer-model"})  # each names a file that must exist
TOKENIZER_TYPES = tuple(TOKENIZER_FLAGS)
EOD_TEXT = "<|endoftext|>"
# End-of-document candidates for a bare tokenizer.json, in order of preference.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
# GPT-2's pre-tokenizer: the pattern of the `tokenizers` ByteLevel pre-tokenizer (use_regex=True).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(ValueError):
    """A bad tokenizer configuration; ``flag`` names the option at fault."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


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
        self._merge_file = merge_file

    @functools.cached_property
    def _fast(self) -> Callable[[str], list[int]] | None:
        """tiktoken's encoder where it gives the same ids; built on first use (the preprocess parent never encodes)."""
        return _tiktoken_encoder(self._tok.get_vocab(with_added_tokens=False), self._merge_file)

    @property
    def backend(self) -> str:
        return "tokenizers" if self._fast is None else "tiktoken"

    def tokenize(self, text: str) -> list[int]:
        if self._fast is None:
            return super().tokenize(text)
        if not text.isascii():
            _check_encodable(text)
        return self._fast(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is None:
            return super().tokenize_batch(texts)
        return [self.tokenize(t) for t in texts]  # one thread: each preprocess worker has a core of its own


def _check_encodable(text: str) -> None:
    """`tokenizers` refuses text with a lone surrogate (not valid Unicode); tiktoken would replace it with U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text has a lone surrogate {text[e.start]!r} at {e.start}: not valid Unicode text") from e


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in vocab.json/merges.txt."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


# Code points whose class (letter, number, space, other) depends on the Unicode version of a regex engine: letters
# and numbers new in Unicode 12.0 to 16.0, and a few old ones. tiktoken 0.6 (Unicode 15) splits text unlike
# `tokenizers` 0.23 (Unicode 16) on hundreds of code points; these find such a pair of versions.
_VERSIONED = "\u1c89\ua7cb\U00010d40\U0002ebf0\U00011f04\U0001e030\u0870\U0001e290\u08be\U00010e80" \
             "\U0001fbf0\U0001e100\u00a0\u3000\u0660\u00b2\u180e\u200b\x85\ufeff"


@functools.lru_cache(maxsize=None)
def _same_pre_tokenizer(tiktoken) -> bool:
    """Whether tiktoken's regex engine and `tokenizers`' put the _VERSIONED code points in the same classes
    (`a`+c is one piece iff c is a letter, `1`+c iff a number, `!`+c iff other): the same Unicode tables."""
    from tokenizers import pre_tokenizers

    hf = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = [prefix + c for prefix in "a1!" for c in _VERSIONED]
    ranks = {bytes([b]): b for b in range(256)} | {t.encode(): 256 + i for i, t in enumerate(texts)}
    probe = tiktoken.Encoding("megatron_ds_probe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    return all((len(probe.encode_ordinary(t)) == 1) == (len(hf.pre_tokenize_str(t)) == 1) for t in texts)


def _tiktoken_encoder(vocab: dict[str, int], merge_file: str) -> Callable[[str], list[int]] | None:
    """A tiktoken encoder giving the ids `tokenizers` gives on these files, or None (not installed, or files it
    cannot mirror exactly).

    Both split text with GPT2_PATTERN, in the same pieces where their regex engines have the same Unicode tables
    (checked here on code points new in recent versions; tests/data check every code point) and apply the
    lowest-ranked merge first, leftmost on ties. `tokenizers` ranks the *pairs* listed in merges.txt; tiktoken ranks the *token* a pair
    would make. The two agree when each merge makes a token no other merge makes (checked here) and tokens rank
    in merge order, as BPE training writes them. tiktoken's ranks are our ids where the merges' ids rise in merge
    order (GPT-2's files, and vocabularies trained with `tokenizers`); otherwise ranks are merge positions and a
    table maps them to our ids.
    """
    try:
        import tiktoken
    except ImportError:
        return None
    alphabet = _byte_alphabet()
    with open(merge_file, encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [line.removesuffix("\r") for line in lines if line and not line.startswith("#version")]
    try:
        base = {bytes([b]): vocab[char] for char, b in alphabet.items()}
        made = [(bytes(alphabet[c] for c in a + b), vocab[a + b]) for a, b in (m.split(" ") for m in merges)]
    except (KeyError, ValueError):  # a byte without a token, a character outside the byte alphabet
        return None
    if len({token for token, _ in made}) != len(made) or any(token in base for token, _ in made):
        return None  # two merges make the same token: tiktoken cannot rank both
    ids = [token_id for _, token_id in made]
    if all(a < b for a, b in zip(ids, ids[1:])) and len(set(ids) | set(base.values())) == len(ids) + len(base):
        ranks, table = base | dict(made), None
    else:
        ranks = {token: rank for rank, token in enumerate([*base, *(token for token, _ in made)])}
        table = np.array([*base.values(), *ids], dtype=np.int64)  # rank -> our id
    if not _same_pre_tokenizer(tiktoken):
        return None
    encoding = tiktoken.Encoding("megatron_ds_gpt2_bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                 special_tokens={})
    if table is None:
        return encoding.encode_ordinary
    return lambda text: table[np.array(encoding.encode_ordinary(text), dtype=np.int64)].tolist()


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


class _SentencePiece(Tokenizer):
    """A SentencePiece model file; ids are `sentencepiece`'s own."""

    def __init__(self, model_file: str):
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as e:  # RuntimeError: not a serialized ModelProto
            raise TokenizerError("--tokenizer-model", f"cannot load {model_file} as a SentencePiece model: {e}") from e
        self.vocab_size = self._sp.get_piece_size()

    def _model_special(self, kind: str) -> int:
        """The model's own bos/eos/pad id, or -1 where it has none (as `sentencepiece` says)."""
        token_id = getattr(self._sp, f"{kind}_id")()
        return token_id if 0 <= token_id < self._sp.get_piece_size() else -1

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # One thread: each preprocess worker has a core of its own.
        return self._sp.encode(texts, out_type=int, num_threads=1) if texts else []

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._encode(list(texts))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class GPTSentencePieceTokenizer(_SentencePiece):
    """The model's vocabulary as it is: EOD is the model's EOS (LLaMA-2: ``</s>`` = 2), BOS and pad are the
    model's (-1 where it has none, as upstream); text is plain text, ``</s>`` in it included."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self.bos, self.eos, self.pad = (self._model_special(k) for k in ("bos", "eos", "pad"))
        if self.eos < 0:
            raise TokenizerError("--tokenizer-model", f"{model_file} has no EOS piece (eos_id -1); "
                                 f"{type(self).__name__} ends documents with it")
        self.eod = self.eos


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """ALCF Megatron-DeepSpeed's Llama2Tokenizer: GPTSentencePieceTokenizer's ids and EOD, but every text
    begins with the model's BOS (LLaMA-2: ``<s>`` = 1), so each preprocessed document starts with it."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self.bos < 0:
            raise TokenizerError("--tokenizer-model", f"{model_file} has no BOS piece (bos_id -1); "
                                 "Llama2Tokenizer starts every text with it")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *super().tokenize(text)]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in super().tokenize_batch(texts)]


class SentencePieceTokenizer(_SentencePiece):
    """Megatron's general SentencePiece tokenizer: the model's pieces, then the special tokens <CLS>, <SEP>,
    <EOD>, <MASK> and the model's pad, BOS and EOS pieces (<PAD>, <BOS>, <EOS> where it has none), each
    appended after the model's pieces unless the model has it; vocab_size counts them (LLaMA-2: 32005, EOD
    32002). A special token written in the text is that token's id; the text between is encoded on its own."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        sp = self._sp
        vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        names = ["<CLS>", "<SEP>", "<EOD>", "<MASK>"]
        for kind, fallback in (("pad", "<PAD>"), ("bos", "<BOS>"), ("eos", "<EOS>")):
            token_id = self._model_special(kind)
            names.append(sp.id_to_piece(token_id) if token_id >= 0 else fallback)
        self.special_tokens: dict[str, int] = {}  # text -> id, in matching priority
        for name in names:
            if name not in vocab:
                vocab[name] = len(vocab)
            self.special_tokens.setdefault(name, vocab[name])
        self.cls, self.sep, self.eod, self.mask, self.pad, self.bos, self.eos = (vocab[n] for n in names)
        self.vocab_size = len(vocab)
        self._special_names = {token_id: name for name, token_id in self.special_tokens.items()}
        # Leftmost special token first; where two start at one place, the earlier in `names` (as upstream).
        self._special_re = re.compile("(" + "|".join(re.escape(n) for n in self.special_tokens) + ")")

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # Each text splits into [text, special, text, ..., text]; all the text parts are encoded in one batch.
        splits = [self._special_re.split(t) for t in texts]
        encoded = iter(self._encode([part for parts in splits for part in parts[::2]]))
        out = []
        for parts in splits:
            ids = list(next(encoded))
            for special in parts[1::2]:  # each is followed by a text part, maybe empty
                ids.append(self.special_tokens[special])
                ids.extend(next(encoded))
            out.append(ids)
        return out

    def detokenize(self, ids: Sequence[int]) -> str:
        """Upstream's text: the model's decoding between special tokens, each special as `` <NAME> ``."""
        ids = [int(i) for i in ids]
        text, start = [], 0
        for i, token_id in enumerate(ids):
            if token_id in self._special_names:
                text.append(f"{self._sp.decode(ids[start:i])} {self._special_names[token_id]} ")
                start = i + 1
        text.append(self._sp.decode(ids[start:]))
        return "".join(text)


_SENTENCEPIECE = {"SentencePieceTokenizer": SentencePieceTokenizer,
                  "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer, "Llama2Tokenizer": Llama2Tokenizer}


def check_tokenizer_flags(tokenizer_type: str | None, *, vocab_file: str | None = None,
                          merge_file: str | None = None, tokenizer_model: str | None = None,
                          vocab_size: int | None = None) -> None:
    """TokenizerError naming the flag at fault: an unknown type, a flag TOKENIZER_FLAGS requires that is not
    given, or a file flag naming no file. Takes build_tokenizer's arguments."""
    if tokenizer_type not in TOKENIZER_FLAGS:
        raise TokenizerError("--tokenizer-type", f"unknown type {tokenizer_type!r}, expected one of "
                                                 f"{', '.join(TOKENIZER_TYPES)}")
    values = {"--vocab-file": vocab_file, "--merge-file": merge_file,
              "--tokenizer-model": tokenizer_model and model_file(tokenizer_type, tokenizer_model),
              "--vocab-size": vocab_size}
    for flag in TOKENIZER_FLAGS[tokenizer_type]:
        value = values[flag]
        if value is None or value == "":
            raise TokenizerError(flag, f"required by --tokenizer-type {tokenizer_type}")
        if flag in FILE_FLAGS and not os.path.isfile(value):
            why = "a directory, not a file" if os.path.isdir(value) else "no such file"
            raise TokenizerError(flag, f"{value}: {why}")


def model_file(tokenizer_type: str, tokenizer_model: str) -> str:
    """The file --tokenizer-model names: HFTokenizer also takes a model directory (its tokenizer.json)."""
    if tokenizer_type == "HFTokenizer" and os.path.isdir(tokenizer_model):
        return os.path.join(tokenizer_model, "tokenizer.json")
    return tokenizer_model


def build_tokenizer(tokenizer_type: str, *, vocab_file: str | None = None, merge_file: str | None = None,
                    tokenizer_model: str | None = None, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer named by ``--tokenizer-type``; missing or unreadable files raise TokenizerError."""
    check_tokenizer_flags(tokenizer_type, vocab_file=vocab_file, merge_file=merge_file,
                          tokenizer_model=tokenizer_model, vocab_size=vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HFTokenizer":
        return HFTokenizer(model_file(tokenizer_type, tokenizer_model))
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    return _SENTENCEPIECE[tokenizer_type](tokenizer_model)
