"""The model a run really builds, resolved from its flags and its tokenizer, and how two of them differ.

The parsed flags leave much open (no --num-key-value-heads means "= heads", no --ffn-hidden-size
means 4h or the SwiGLU rule, the vocabulary comes from the tokenizer files and is padded for TP), so
comparing flags misses real differences. ``model_shape`` resolves them the way the training run does
(GPTConfig's defaults, the tokenizer, Megatron's padding); the checkpoint records it and a load
compares the recorded values with the running job's.
"""

from __future__ import annotations

import hashlib
import os
from argparse import Namespace

from megatron_ds.model.config import weight_flags

# field -> how a user changes it (named in the mismatch message): GPTConfig's fields that shape the weights
SHAPE_FLAGS = weight_flags()
_TOKENIZER_FLAGS = "--tokenizer-type/--vocab-file/--merge-file/--tokenizer-model/--vocab-size"


def _fingerprint(args: Namespace) -> str | None:
    """sha256 of the tokenizer's files (vocab, merges, model): same size but other files is another tokenizer."""
    digest = hashlib.sha256()
    found = False
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        path = getattr(args, name, None)
        if path and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if path and os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(f.read())
            found = True
    return digest.hexdigest() if found else None


def tokenizer_vocab_size(args: Namespace) -> int | None:
    """The tokenizer's vocabulary size (before padding), or None when it cannot be rebuilt here."""
    from megatron_ds.data.tokenizers import build_tokenizer

    try:
        return int(build_tokenizer(args.tokenizer_type, vocab_file=getattr(args, "vocab_file", None),
                                   merge_file=getattr(args, "merge_file", None),
                                   tokenizer_model=getattr(args, "tokenizer_model", None),
                                   vocab_size=getattr(args, "vocab_size", None)).vocab_size)
    except Exception:  # files moved since training, a tokenizer this image lacks
        return None


def gpt_config(args: Namespace, padded_vocab_size: int):
    """The GPTConfig whose weights these flags fix: training's (settings.model_config), the flags a Namespace
    lacks or leaves None taking the parser's defaults (a stored or a test's Namespace)."""
    from megatron_ds.arguments import settings_from_stored
    from megatron_ds.arguments.settings import model_config

    given = {name: value for name, value in vars(args).items() if value is not None}
    return model_config(settings_from_stored(given), padded_vocab_size)


def padded_vocab_size(vocab_size: int, args: Namespace) -> int:
    from megatron_ds.model.config import pad_vocab_size

    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    return pad_vocab_size(vocab_size, getattr(args, "make_vocab_size_divisible_by", None) or 128, tp)


def model_shape(args: Namespace, vocab_size: int | None = None) -> dict | None:
    """The resolved architecture of the model these flags build; None when the flags do not describe a
    GPTModel (a test's own model, or a Namespace without the model flags). ``vocab_size`` stands in for
    the tokenizer's (an imported model whose tokenizer the user names later)."""
    needed = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
    if any(getattr(args, name, None) is None for name in needed):
        return None
    if vocab_size is None:
        if getattr(args, "tokenizer_type", None) is None:
            return None
        vocab_size = tokenizer_vocab_size(args)
    padded = None if vocab_size is None else padded_vocab_size(vocab_size, args)
    config = gpt_config(args, padded or 1)
    shape = {name: getattr(config, name) for name in SHAPE_FLAGS}
    if config.position_embedding_type != "learned_absolute":
        shape["max_position_embeddings"] = None  # sizes no weight with rope
    shape.update(vocab_size=vocab_size, padded_vocab_size=padded,
                 tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", None) or 1,
                 tokenizer_sha256=_fingerprint(args) if getattr(args, "tokenizer_type", None) else None)
    return shape


def differences(saved: dict, ours: dict) -> list[str]:
    """One line per value in which the checkpoint's model and this run's differ."""
    problems = []
    for name, flag in SHAPE_FLAGS.items():
        if name in saved and saved[name] != ours.get(name):
            named = "" if flag == "--" + name.replace("_", "-") else f" ({name})"
            problems.append(f"{flag}{named}: checkpoint {saved[name]!r}, this run {ours.get(name)!r}")
    if None not in (saved.get("vocab_size"), ours.get("vocab_size")):
        if saved["vocab_size"] != ours["vocab_size"]:
            problems.append(f"vocabulary: checkpoint {saved['vocab_size']} tokens, this run {ours['vocab_size']} "
                            f"({_TOKENIZER_FLAGS} name another tokenizer)")
        elif None not in (saved.get("tokenizer_sha256"), ours.get("tokenizer_sha256")) and \
                saved["tokenizer_sha256"] != ours["tokenizer_sha256"]:
            problems.append(f"vocabulary: the tokenizer files differ in content (both {ours['vocab_size']} tokens; "
                            f"{_TOKENIZER_FLAGS} name another tokenizer)")
        elif saved.get("tensor_model_parallel_size") == ours.get("tensor_model_parallel_size") and \
                saved.get("padded_vocab_size") != ours.get("padded_vocab_size"):
            problems.append(f"padded vocabulary: checkpoint {saved.get('padded_vocab_size')} rows, this run "
                            f"{ours.get('padded_vocab_size')} (--make-vocab-size-divisible-by)")
    return problems
