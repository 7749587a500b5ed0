import glob
import gzip
import json
import lzma
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import TEXTS, write_jsonl
from tokenizers import ByteLevelBPETokenizer

import entrypoint
from megatron_ds.data.indexed import IndexedDataset
from megatron_ds.data.preprocess import TokenizerSpec, main, preprocess

DOCS = [t * (i % 5 + 1) for i, t in enumerate(TEXTS * 25)] + ["", "x"]


def gpt2_flags(gpt2_files):
    vocab, merges = gpt2_files
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]


def read_bytes(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def test_end_to_end_ids_and_eod(tmp_path, gpt2_files, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    out = str(tmp_path / "out" / "corpus")
    assert main(["--input", src, "--output-prefix", out, "--append-eod", "--workers", "1",
                 *gpt2_flags(gpt2_files)]) == 0
    assert "wrote" in capsys.readouterr().out
    ref = ByteLevelBPETokenizer.from_file(*gpt2_files)
    eod = ref.token_to_id("<|endoftext|>")
    ds = IndexedDataset(out + "_text_document")
    ds.validate()
    assert ds.dtype is np.uint16 and len(ds) == len(DOCS) and ds.num_documents == len(DOCS)
    for i, text in enumerate(DOCS):
        assert ds[i].tolist() == ref.encode(text).ids + [eod]  # EOD appended and counted in sizes
        assert ds.sizes[i] == len(ref.encode(text).ids) + 1
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus_text_document.bin", "corpus_text_document.idx"]


def test_compressed_inputs_and_multiple_keys(tmp_path, gpt2_files):
    rows = [{"text": d, "title": f"doc {i}"} for i, d in enumerate(DOCS)]
    payload = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "in.jsonl").write_bytes(payload)
    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress(payload))
    (tmp_path / "in.jsonl.xz").write_bytes(lzma.compress(payload))
    for name in ("in.jsonl", "in.jsonl.gz", "in.jsonl.xz"):
        assert main(["--input", str(tmp_path / name), "--output-prefix", str(tmp_path / name.replace(".", "_")),
                     "--json-keys", "text", "title", "--no-progress", *gpt2_flags(gpt2_files)]) == 0
    plain = read_bytes(str(tmp_path / "in_jsonl_text_document"))
    assert read_bytes(str(tmp_path / "in_jsonl_gz_text_document")) == plain
    assert read_bytes(str(tmp_path / "in_jsonl_xz_text_document")) == plain
    titles = IndexedDataset(str(tmp_path / "in_jsonl_xz_title_document"))
    ref = ByteLevelBPETokenizer.from_file(*gpt2_files)
    assert titles[7].tolist() == ref.encode("doc 7").ids  # no --append-eod: no EOD


def test_two_workers_byte_identical_to_one(tmp_path, gpt2_files):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS * 4)
    spec = TokenizerSpec("GPT2BPETokenizer", *gpt2_files)
    one = preprocess(src, str(tmp_path / "w1"), spec, append_eod=True, workers=1, chunk_bytes=500, progress=False)
    two = preprocess(src, str(tmp_path / "w2"), spec, append_eod=True, workers=2, chunk_bytes=500, progress=False)
    assert one.documents == two.documents == len(DOCS) * 4 and one.tokens == two.tokens
    assert read_bytes(str(tmp_path / "w1_text_document")) == read_bytes(str(tmp_path / "w2_text_document"))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stop_request_keeps_nothing_up_to_the_last_moment(tmp_path, gpt2_files, workers):
    """`entrypoint preprocess`'s signal handlers only note the signal; preprocess asks after every chunk and
    once more before renaming. Asked yes after the first chunk, or only at that last check, it leaves nothing."""
    src = write_jsonl(tmp_path / "in.jsonl", DOCS * 4)
    spec = TokenizerSpec("GPT2BPETokenizer", *gpt2_files)
    calls = []

    def count():
        calls.append(1)
        return False

    whole = preprocess(src, str(tmp_path / "whole"), spec, workers=workers, chunk_bytes=500, progress=False,
                       stop_requested=count)
    n_chunks = len(calls) - 1  # one call per chunk, one before renaming
    assert n_chunks > 2 and whole.documents == len(DOCS) * 4
    for stop_at in (1, n_chunks + 1):
        asked = []

        def stop():
            asked.append(1)
            return len(asked) >= stop_at

        prefix = tmp_path / f"stop{stop_at}"
        with pytest.raises(KeyboardInterrupt):
            preprocess(src, str(prefix), spec, workers=workers, chunk_bytes=500, progress=False, stop_requested=stop)
        assert len(asked) == stop_at and not glob.glob(f"{prefix}*"), os.listdir(tmp_path)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "entrypoint", "preprocess", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_two_workers_and_progress_lines(tmp_path, gpt2_files):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    r = run_cli("--input", src, "--output-prefix", str(tmp_path / "cli"), "--workers", "2", "--append-eod",
                "--log-interval", "20", *gpt2_flags(gpt2_files))
    assert r.returncode == 0, r.stderr
    assert re.search(r"preprocess: \d+ documents, [\d.]+ MB, [\d.]+ MB/s, [\d,]+ tokens/s, 100%, ETA 0s", r.stderr)
    spec = TokenizerSpec("GPT2BPETokenizer", *gpt2_files)
    preprocess(src, str(tmp_path / "fn"), spec, append_eod=True, progress=False)
    assert read_bytes(str(tmp_path / "cli_text_document")) == read_bytes(str(tmp_path / "fn_text_document"))


BAD_LINES = [
    (b'{"text": "fine"}\n{"text": "broken"\n', 2, "invalid JSON"),
    (b'{"text": "fine"}\n{"body": "no text key"}\n', 2, "missing key 'text'"),
    (b'{"text": "fine"}\n{"text": 5}\n', 2, "key 'text' is not a string"),
    (b'{"text": "fine"}\n\n{"text": "caf\xe9"}\n', 3, "not valid UTF-8"),
    (b'[1, 2]\n', 1, "expected a JSON object"),
    (b'\xef\xbb\xbf{"text": "a BOM on line 1 is fine"}\n\xef\xbb\xbf{"text": "not on line 2"}\n', 2, "invalid JSON"),
    (b'{"text": "a pair \\ud83d\\ude80 is fine"}\n{"text": "half \\uD83D a pair"}\n', 2,
     "key 'text' has a lone surrogate \\ud83d (half a UTF-16 pair), not valid Unicode"),
]


@pytest.mark.parametrize("payload, line, reason", BAD_LINES)
def test_bad_line_is_error_with_file_and_line(tmp_path, gpt2_files, payload, line, reason):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(payload)
    r = run_cli("--input", str(src), "--output-prefix", str(tmp_path / "o"), *gpt2_flags(gpt2_files))
    assert r.returncode == 2
    assert f"{src}:{line}: {reason}" in r.stderr and "--skip-bad-lines" in r.stderr
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # nothing written, temporaries removed


def test_skip_bad_lines_counts_and_reports(tmp_path, gpt2_files, capsys):
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b"".join(p for p, _, _ in BAD_LINES))
    out = str(tmp_path / "o")
    assert main(["--input", str(src), "--output-prefix", out, "--skip-bad-lines", "--no-progress",
                 *gpt2_flags(gpt2_files)]) == 0
    printed = capsys.readouterr().out
    assert "skipped 8 bad lines" in printed and f"{src}:4: missing key 'text'" in printed
    assert len(IndexedDataset(out + "_text_document")) == 5  # the five good lines (BOMs past line 1 are bad)


@pytest.mark.parametrize("args, message", [
    (["--input", "/no/such.jsonl"], "--input: /no/such.jsonl: no such file"),
    (["--vocab-file", "/no/vocab.json"], "--vocab-file: /no/vocab.json: no such file"),
    (["--dataset-impl", "lazy"], "--dataset-impl: invalid choice"),
    (["--workers", "0"], "--workers: must be at least 1"),
])
def test_usage_errors_exit_2_naming_the_flag(tmp_path, gpt2_files, args, message, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", ["a"])
    argv = ["--input", src, "--output-prefix", str(tmp_path / "o"), *gpt2_flags(gpt2_files)] + args
    with pytest.raises(SystemExit) if "invalid choice" in message else _no_raise():
        assert main(argv) == 2
    assert message in capsys.readouterr().err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_registered_in_entrypoint():
    assert entrypoint.COMMANDS["preprocess"][0] == "megatron_ds.data.preprocess"


def big_input(path):
    doc = " ".join(f"word{i % 977} token{i % 131}" for i in range(2000))
    with open(path, "w") as f:
        for i in range(6000):
            f.write(json.dumps({"text": f"{i} {doc}"}) + "\n")
    return str(path)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=["KILL", "INT", "TERM"])
def test_interrupt_leaves_no_output_pair(tmp_path, gpt2_files, sig):
    src = big_input(tmp_path / "big.jsonl")
    prefix = str(tmp_path / "out")
    proc = subprocess.Popen([sys.executable, "-m", "entrypoint", "preprocess", "--input", src, "--output-prefix",
                             prefix, "--workers", "2", "--append-eod", *gpt2_flags(gpt2_files)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not glob.glob(prefix + "_text_document.bin.tmp.*") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # well into tokenizing
    assert proc.poll() is None, "the input was too small: preprocess finished before the signal"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    final = [prefix + "_text_document.bin", prefix + "_text_document.idx"]
    assert not any(os.path.exists(p) for p in final), (proc.returncode, err[-2000:])
    if sig != signal.SIGKILL:
        assert proc.returncode == 128 + sig and "interrupted; no output written" in err
        assert sorted(os.listdir(tmp_path)) == ["big.jsonl"]  # temporaries removed too
    else:
        assert proc.returncode == -signal.SIGKILL


def test_null_and_hf_tokenizers_and_int32_for_large_vocab(tmp_path, hf_tokenizer_json):
    src = write_jsonl(tmp_path / "ids.jsonl", ["1 2 3", "70000 5"])
    assert main(["--input", src, "--output-prefix", str(tmp_path / "null"), "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", "80000", "--append-eod", "--no-progress"]) == 0
    ds = IndexedDataset(str(tmp_path / "null_text_document"))
    assert ds.dtype is np.int32 and ds[1].tolist() == [70000, 5, 80000]  # vocab >= 65500: int32; EOD = vocab size
    src = write_jsonl(tmp_path / "hf.jsonl", ["The quick brown fox", "Megatron trains"])
    assert main(["--input", src, "--output-prefix", str(tmp_path / "hf"), "--tokenizer-type", "HFTokenizer",
                 "--tokenizer-model", hf_tokenizer_json, "--append-eod", "--no-progress"]) == 0
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(hf_tokenizer_json)
    ds = IndexedDataset(str(tmp_path / "hf_text_document"))
    assert ds.dtype is np.uint16 and ds[0].tolist() == ref.encode("The quick brown fox").ids + [ref.token_to_id("</s>")]


def test_progress_bar_on_a_terminal(tmp_path, gpt2_files):
    """On a TTY the tqdm bar shows bytes, documents, MB/s and tokens/s."""
    import fcntl
    import pty
    import struct
    import termios

    src = write_jsonl(tmp_path / "in.jsonl", DOCS * 40)
    cmd = [sys.executable, "-m", "entrypoint", "preprocess", "--input", src, "--output-prefix", str(tmp_path / "o"),
           *gpt2_flags(gpt2_files)]
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a 160-column terminal
    proc = subprocess.Popen(cmd, stdin=child, stdout=child, stderr=child)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(parent, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(parent)
    screen = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, screen
    assert "preprocess: 100%" in screen and "docs=" in screen and "MB/s" in screen and "tok/s=" in screen
