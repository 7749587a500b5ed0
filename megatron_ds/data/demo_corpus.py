"""The embedded demo corpus: the standard library's own .py sources, no download.

``prepare(dest)`` collects them deterministically (a seeded shuffle of all of them, then a size
cap, so train and validation splits are both drawn from across the whole library), trains a small
byte-level BPE on them with `tokenizers`, saves it in GPT-2's vocab.json + merges.txt form and
runs our own preprocess with ``--append-eod``. A manifest keyed by a hash of the corpus and the
recipe makes a second call instant; a lock makes concurrent callers build it once.

    python -m megatron_ds.data.demo_corpus [--dest data/demo]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import random
import sys
import sysconfig
from dataclasses import asdict, dataclass

# Part of the cache key: changing any of these rebuilds a cached corpus.
RECIPE = {"format": 2, "order": "shuffled", "seed": 1234, "cap_bytes": 4_000_000, "max_document_bytes": 250_000,
          "vocab_size": 4096, "min_frequency": 2}
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib"}
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class DemoCorpus:
    prefix: str
    vocab_file: str
    merge_file: str
    vocab_size: int
    num_documents: int
    num_tokens: int


def collect_sources(cap_bytes: int = RECIPE["cap_bytes"]) -> list[tuple[str, str]]:
    """(relative path, text) of stdlib .py files in a fixed shuffled order until cap_bytes of text.

    Sorted paths would stop the corpus in encodings/ and make the last documents (the validation
    split) a handful of codec tables; a seeded shuffle of every path spreads both splits over the
    whole library, the same on every run with the same Python. Documents over max_document_bytes
    (pydoc_data/topics.py: 750 KB of prose) are left out so that no single file dominates.
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        paths += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    paths.sort()  # os.walk's order is the file system's
    random.Random(RECIPE["seed"]).shuffle(paths)
    docs, total = [], 0
    for rel in paths:
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or len(text.encode("utf-8")) > RECIPE["max_document_bytes"]:
            continue
        docs.append((rel, text))
        total += len(text.encode("utf-8"))
        if total >= cap_bytes:
            break
    return docs


def _key(docs: list[tuple[str, str]]) -> str:
    h = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode())
    for rel, text in docs:
        h.update(rel.encode() + b"\0" + text.encode("utf-8") + b"\0")
    return h.hexdigest()[:16]


def _load(dest: str, key: str) -> DemoCorpus | None:
    try:
        with open(os.path.join(dest, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if manifest.get("key") != key:
        return None
    corpus = DemoCorpus(**manifest["corpus"])
    files = (corpus.prefix + ".bin", corpus.prefix + ".idx", corpus.vocab_file, corpus.merge_file)
    return corpus if all(os.path.isfile(p) for p in files) else None


def train_bpe(texts: list[str], dest: str, vocab_size: int = RECIPE["vocab_size"]) -> tuple[str, str]:
    """A byte-level BPE (GPT-2's recipe) saved as dest/vocab.json + dest/merges.txt; deterministic."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=RECIPE["min_frequency"],
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(dest)
    return os.path.join(dest, "vocab.json"), os.path.join(dest, "merges.txt")


def _build(dest: str, docs: list[tuple[str, str]], key: str) -> DemoCorpus:
    from megatron_ds.data.preprocess import TokenizerSpec, preprocess

    jsonl = os.path.join(dest, "stdlib.jsonl")
    with open(jsonl + ".tmp", "w", encoding="utf-8") as f:
        for rel, text in docs:
            f.write(json.dumps({"text": text, "path": rel}) + "\n")
    os.replace(jsonl + ".tmp", jsonl)

    vocab_file, merge_file = train_bpe([text for _, text in docs], dest)

    spec = TokenizerSpec("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    result = preprocess(jsonl, os.path.join(dest, "stdlib"), spec, append_eod=True,
                        workers=min(2, os.cpu_count() or 1), progress=False)
    corpus = DemoCorpus(prefix=result.outputs["text"], vocab_file=vocab_file, merge_file=merge_file,
                        vocab_size=spec.build().vocab_size, num_documents=result.documents,
                        num_tokens=result.tokens["text"])
    with open(os.path.join(dest, MANIFEST + ".tmp"), "w", encoding="utf-8") as f:
        json.dump({"key": key, "recipe": RECIPE, "corpus": asdict(corpus)}, f, indent=1)
    os.replace(os.path.join(dest, MANIFEST + ".tmp"), os.path.join(dest, MANIFEST))
    return corpus


def prepare(dest: str = "data/demo") -> DemoCorpus:
    """The demo corpus in ``dest``, built on first use (seconds) and reused while the stdlib is unchanged."""
    dest = os.path.abspath(dest)
    os.makedirs(dest, exist_ok=True)
    docs = collect_sources()
    key = _key(docs)
    corpus = _load(dest, key)
    if corpus is not None:
        return corpus
    with open(os.path.join(dest, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        try:
            return _load(dest, key) or _build(dest, docs, key)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_ds.data.demo_corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", default="data/demo", help="directory to prepare it in (default: data/demo)")
    args = p.parse_args(argv)
    corpus = prepare(args.dest)
    for name, value in asdict(corpus).items():
        print(f"{name:14s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
