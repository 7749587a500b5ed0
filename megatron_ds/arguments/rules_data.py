"""The data rule: every --data-path dataset opens (its .bin and .idx agree) and holds only token ids the model can
embed, 0 <= id < the padded vocabulary. An id past the embedding is otherwise an IndexError on the CPU, a
device-side assert on a GPU, deep inside the first step of every rank.

The CLI runs it after validate, in the launcher (or the lone process, or rank 0) before any rank or process group
starts. The token range is scanned once per dataset and cached (data/token_range.py): a later start costs a stat
and a small read per dataset, and the tokenizer load that gives the vocabulary.
"""

from __future__ import annotations

from megatron_ds.arguments.flags import ConfigError
from megatron_ds.arguments.settings import Settings

REBUILD = "rebuild it (`entrypoint preprocess`) or give the right --data-path"


def data_within_vocabulary(settings: Settings) -> list[str]:
    """ConfigError naming the dataset for a .bin/.idx pair that does not open or whose index is inconsistent, or
    for a token id outside [0, padded vocabulary): the tokenizer's size padded as Megatron pads it
    (--make-vocab-size-divisible-by x TP). Returns notes for the log (a token range that could not be cached)."""
    from megatron_ds.data.gpt_dataset import DataConfigError, parse_data_path
    from megatron_ds.data.indexed import IndexedDatasetError
    from megatron_ds.data.token_range import token_range
    from megatron_ds.data.tokenizers import TokenizerError, build_tokenizer
    from megatron_ds.model.config import pad_vocab_size

    data, model, tp = settings.data, settings.model, settings.layout.tensor_model_parallel_size
    if not data.data_path:  # a dry run needs no data: nothing to scan
        return []
    try:
        prefixes = [prefix for _, prefix in parse_data_path(list(data.data_path))]
    except DataConfigError as err:
        raise ConfigError(None, str(err)) from None
    try:
        tokenizer = build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file, merge_file=data.merge_file,
                                    tokenizer_model=data.tokenizer_model, vocab_size=model.vocab_size)
    except TokenizerError as err:
        raise ConfigError(err.flag, err.message) from None
    divisible_by = model.make_vocab_size_divisible_by
    padded = pad_vocab_size(tokenizer.vocab_size, divisible_by, tp)
    notes = []
    for prefix in prefixes:
        try:
            found, note = token_range(prefix, data.data_cache_path)
        except (IndexedDatasetError, OSError) as err:
            raise ConfigError("--data-path", f"{err}; {REBUILD}") from None
        if note:
            notes.append(note)
        if found.low < 0 or found.high >= padded:
            bad = f"the smallest is {found.low}" if found.low < 0 else f"the largest is {found.high}"
            raise ConfigError("--data-path", (
                f"{prefix}: token ids must lie in [0, {padded}) and {bad}: the vocabulary is {padded} "
                f"({data.tokenizer_type}'s {tokenizer.vocab_size}, padded to a multiple of "
                f"--make-vocab-size-divisible-by {divisible_by} x TP {tp}); tokenize the data with this tokenizer "
                "(`entrypoint preprocess`) or give the tokenizer it was made with"))
    return notes
