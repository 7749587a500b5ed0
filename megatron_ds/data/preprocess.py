"""`entrypoint preprocess`: JSON lines -> Megatron indexed datasets, with the flags of Megatron's
tools/preprocess_data.py.

Reading and writing stay in this process; tokenizing runs in ``--workers`` processes, each
encoding whole chunks of lines with the tokenizer's batch encoder. Chunks come back in input order, so
the output does not depend on the number of workers. Outputs are written under temporary
names and renamed at the very end: an interrupted run leaves no ``.bin``/``.idx`` pair.
"""

from __future__ import annotations

import argparse
import bz2
import contextlib
import gzip
import itertools
import json
import lzma
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from megatron_ds.data.indexed import IndexedDatasetWriter, best_dtype
from megatron_ds.data.tokenizers import TOKENIZER_TYPES, TokenizerError, build_tokenizer
from megatron_ds.data.workers import OrderedWorkers, WorkerError

CHUNK_BYTES = 256 * 1024  # text per worker task: large enough to amortise IPC, small enough to balance
_OPENERS = {".gz": lambda raw: gzip.GzipFile(fileobj=raw), ".xz": lzma.LZMAFile, ".bz2": bz2.BZ2File}


class PreprocessError(ValueError):
    """A usage error or a bad input line; the CLI prints it and exits 2."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to build its own tokenizer (tokenizers do not cross process boundaries)."""

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None

    def build(self):
        return build_tokenizer(self.tokenizer_type, vocab_file=self.vocab_file, merge_file=self.merge_file,
                               tokenizer_model=self.tokenizer_model, vocab_size=self.vocab_size)


@dataclass
class PreprocessResult:
    outputs: dict[str, str]  # json key -> output prefix
    documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    text_bytes: int = 0
    seconds: float = 0.0
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)


@dataclass
class _Chunk:
    """One worker task's answer: per key the tokens of its documents back to back, and their lengths."""

    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    bad: list[tuple[int, str]]
    documents: int
    text_bytes: int


class _Encoder:
    def __init__(self, spec: TokenizerSpec, keys: tuple[str, ...], append_eod: bool, tokenizer=None):
        self.tokenizer = tokenizer or spec.build()
        self.keys, self.append_eod = keys, append_eod
        self.dtype = best_dtype(self.tokenizer.vocab_size)

    def encode(self, task: tuple[int, bytes]) -> _Chunk:
        first_line, block = task
        texts: dict[str, list[str]] = {k: [] for k in self.keys}
        bad: list[tuple[int, str]] = []
        nbytes = 0
        for lineno, raw in enumerate(block.split(b"\n"), first_line):
            if not raw.strip():  # blank lines (and the empty piece after the block's last newline)
                continue
            reason = None
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark is not part of the JSON
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
                doc = json.loads(line)
            except UnicodeDecodeError as e:
                reason = f"not valid UTF-8 ({e.reason} at byte {e.start})"
            except json.JSONDecodeError as e:
                reason = f"invalid JSON ({e.msg} at column {e.colno})"
            else:
                if not isinstance(doc, dict):
                    reason = f"expected a JSON object, got {type(doc).__name__}"
                else:
                    missing = [k for k in self.keys if not isinstance(doc.get(k), str)]
                    if missing:
                        k = missing[0]
                        reason = f"missing key {k!r}" if k not in doc else f"key {k!r} is not a string"
                    elif b"\\ud" in raw or b"\\uD" in raw:  # a \u escape may be half a UTF-16 pair
                        reason = _lone_surrogate(doc, self.keys)
            if reason:
                bad.append((lineno, reason))
                continue
            for k in self.keys:
                texts[k].append(doc[k])
            nbytes += len(raw) + 1  # with its newline
        tokens, lengths = {}, {}
        for k in self.keys:
            ids = self.tokenizer.tokenize_batch(texts[k]) if texts[k] else []
            if self.append_eod:
                for seq in ids:
                    seq.append(self.tokenizer.eod)
            lengths[k] = np.fromiter((len(s) for s in ids), np.int32, len(ids))
            tokens[k] = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(lengths[k].sum()))
        return _Chunk(tokens, lengths, bad, len(texts[self.keys[0]]), nbytes)


def _lone_surrogate(doc: dict, keys: tuple[str, ...]) -> str | None:
    """Why the text is not valid Unicode (a \\uD800-\\uDFFF escape without its other half), or None."""
    for k in keys:
        try:
            doc[k].encode("utf-8")
        except UnicodeEncodeError as e:
            half = ord(doc[k][e.start])
            return f"key {k!r} has a lone surrogate \\u{half:04x} (half a UTF-16 pair), not valid Unicode"
    return None


_worker: _Encoder | None = None


def _init_worker(spec: TokenizerSpec, keys: tuple[str, ...], append_eod: bool) -> None:
    global _worker
    _worker = _Encoder(spec, keys, append_eod)


def _encode_in_worker(task: tuple[int, bytes]) -> _Chunk:
    return _worker.encode(task)


def _read_chunks(stream, chunk_bytes: int):
    """(first line number, block of whole lines) of about chunk_bytes each. The workers split the lines:
    the parent only reads and counts newlines, so it stays off the cores the workers need."""
    first = 1
    while True:
        block = stream.read(chunk_bytes)
        if not block:
            return
        if not block.endswith(b"\n"):
            block += stream.readline()  # finish the last line
        yield first, block
        first += block.count(b"\n")


class _Progress:
    """A tqdm bar on a terminal, otherwise one log line every ``log_interval`` documents."""

    def __init__(self, total_bytes: int | None, log_interval: int, enabled: bool):
        self.total, self.log_interval, self.start = total_bytes, log_interval, time.monotonic()
        self.next_log = log_interval
        self.bar = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr)

    def update(self, position: int, docs: int, text_bytes: int, tokens: int) -> None:
        if not self.enabled:
            return
        elapsed = max(time.monotonic() - self.start, 1e-9)
        mbs, tps = text_bytes / 1e6 / elapsed, tokens / elapsed
        if self.bar is not None:
            self.bar.update(position - self.bar.n)
            self.bar.set_postfix_str(f"docs={docs} text={mbs:.2f}MB/s tok/s={tps:,.0f}", refresh=False)
        elif docs >= self.next_log:
            self.next_log = (docs // self.log_interval + 1) * self.log_interval
            eta = ""
            if self.total and position:
                eta = f", {100 * position / self.total:.0f}%, ETA {elapsed * (self.total - position) / position:.0f}s"
            print(f"preprocess: {docs} documents, {text_bytes / 1e6:.1f} MB, {mbs:.2f} MB/s, "
                  f"{tps:,.0f} tokens/s{eta}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def _open_input(path: str):
    """Yields (binary stream of the text, raw file whose tell() is the position in the file on disk)."""
    opener = _OPENERS.get(os.path.splitext(path)[1])
    with open(path, "rb") as raw:
        if opener is None:
            yield raw, raw
        else:
            with opener(raw) as f:
                yield f, raw


@contextlib.contextmanager
def _tokenizers_single_threaded():
    """Each worker is one process on one core: keep the Rust encoder from spawning its own threads."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def preprocess(input: str, output_prefix: str, spec: TokenizerSpec, *, json_keys=("text",),
               append_eod: bool = False, workers: int = 1, log_interval: int = 1000,
               skip_bad_lines: bool = False, progress: bool = True,
               chunk_bytes: int = CHUNK_BYTES, stop_requested=lambda: False) -> PreprocessResult:
    """Tokenize ``input`` (JSON lines, optionally .gz/.xz/.bz2) into ``<output_prefix>_<key>_document``.
    ``stop_requested()`` is asked after every chunk and once more before the outputs get their final names;
    when it says yes, KeyboardInterrupt leaves no output."""
    keys = tuple(json_keys)
    if not os.path.isfile(input):
        raise PreprocessError(f"--input: {input}: no such file")
    if workers < 1:
        raise PreprocessError(f"--workers: must be at least 1, got {workers}")
    if not keys:
        raise PreprocessError("--json-keys: needs at least one key")
    with _tokenizers_single_threaded():
        tokenizer = spec.build()  # fail here, before any worker starts, on a bad tokenizer config
        dtype = best_dtype(tokenizer.vocab_size)
        outputs = {k: f"{output_prefix}_{k}_document" for k in keys}
        result = PreprocessResult(outputs=outputs, tokens=dict.fromkeys(keys, 0))
        total = os.path.getsize(input)
        start = time.monotonic()
        with contextlib.ExitStack() as stack:
            writers = {k: stack.enter_context(IndexedDatasetWriter(p, dtype)) for k, p in outputs.items()}
            lines, raw = stack.enter_context(_open_input(input))
            positions: deque[int] = deque()  # file position after each chunk read, for the progress bar

            def read_tasks():
                for task in _read_chunks(lines, chunk_bytes):
                    positions.append(raw.tell())
                    yield task

            tasks = read_tasks()
            if workers == 1:
                encoder = _Encoder(spec, keys, append_eod, tokenizer)
                chunks = map(encoder.encode, tasks)
            else:
                pool = stack.enter_context(OrderedWorkers(workers, _encode_in_worker, _init_worker,
                                                          (spec, keys, append_eod)))
                chunks = pool.map(tasks)
            bar = _Progress(total, log_interval, progress)
            stack.callback(bar.close)
            for chunk in chunks:
                for lineno, reason in chunk.bad:
                    where = f"{input}:{lineno}: {reason}"
                    if not skip_bad_lines:
                        raise PreprocessError(f"{where} (use --skip-bad-lines to skip such lines)")
                    result.skipped += 1
                    if len(result.skipped_examples) < 5:
                        result.skipped_examples.append(where)
                for k, writer in writers.items():
                    writer.add_documents(chunk.tokens[k], chunk.lengths[k])
                    result.tokens[k] += int(chunk.tokens[k].size)
                result.documents += chunk.documents
                result.text_bytes += chunk.text_bytes
                bar.update(positions.popleft(), result.documents, result.text_bytes, result.tokens[keys[0]])
                if stop_requested():
                    raise KeyboardInterrupt
            if stop_requested():  # the last moment to keep nothing
                raise KeyboardInterrupt
            # Leaving the stack finalizes the writers (renames to the final names) on success only.
        result.seconds = time.monotonic() - start
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="entrypoint preprocess",
        description="Tokenize JSON lines into Megatron indexed datasets <output-prefix>_<key>_document.{bin,idx} "
                    "(the flags of Megatron's tools/preprocess_data.py).")
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="JSON lines file, one document per line; .gz, .xz, .bz2 are read "
                                                  "compressed")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract; one output per key (default: text)")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip lines that are not valid JSON / UTF-8 or lack a key (counted and reported) instead of "
                        "stopping at the first with file:line")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", help="GPT-2 vocab.json (GPT2BPETokenizer)")
    g.add_argument("--merge-file", help="GPT-2 merges.txt (GPT2BPETokenizer)")
    g.add_argument("--tokenizer-model", help="tokenizer.json (HFTokenizer) or a SentencePiece tokenizer.model "
                                             "(SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer)")
    g.add_argument("--vocab-size", type=int, help="vocabulary size (NullTokenizer)")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document "
                                                              "(counted in the sizes)")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="path prefix of the outputs")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="only mmap (Megatron's default)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes (output is the same for any number)")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="documents between progress lines when stderr is not a terminal")
    g.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.log_interval < 1:
        print("entrypoint preprocess: --log-interval: must be at least 1", file=sys.stderr)
        return 2
    spec = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model, args.vocab_size)

    # Ctrl-C and SIGTERM (e.g. a scheduler's) only note the signal; tokenizing stops at the next chunk. Raising
    # from the handler could land in a finalizer, where Python prints the exception and drops it, and the run
    # would go on to publish its output. A second signal stops at once.
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        if len(received) > 1:
            raise KeyboardInterrupt

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = preprocess(args.input, args.output_prefix, spec, json_keys=args.json_keys,
                            append_eod=args.append_eod, workers=args.workers, log_interval=args.log_interval,
                            skip_bad_lines=args.skip_bad_lines, progress=not args.no_progress,
                            stop_requested=lambda: bool(received))
    except (PreprocessError, TokenizerError) as e:
        print(f"entrypoint preprocess: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:
        print(f"entrypoint preprocess: {e}\nno output written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("entrypoint preprocess: interrupted; no output written", file=sys.stderr)
        return 128 + (received[0] if received else signal.SIGINT)
    finally:
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)
    if received:  # it came while the finished outputs were being renamed: they are whole, so they stay
        print(f"entrypoint preprocess: {signal.Signals(received[0]).name} came after tokenizing had finished; "
              "the output is complete", file=sys.stderr)
    rate = result.text_bytes / 1e6 / max(result.seconds, 1e-9)
    for k, prefix in result.outputs.items():
        print(f"wrote {prefix}.{{bin,idx}}: {result.documents} documents, {result.tokens[k]} tokens")
    print(f"{result.text_bytes / 1e6:.1f} MB of text in {result.seconds:.1f} s ({rate:.2f} MB/s, "
          f"{result.tokens[args.json_keys[0]] / max(result.seconds, 1e-9):,.0f} tokens/s, {args.workers} workers)")
    if result.skipped:
        print(f"skipped {result.skipped} bad lines, e.g.:")
        for example in result.skipped_examples:
            print(f"  {example}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
