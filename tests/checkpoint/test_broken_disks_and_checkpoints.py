"""A full or read-only disk during a save, and a broken newest checkpoint at load, through `entrypoint train`.

Failed saves: a 13 MB tmpfs holds two ZeRO-2 checkpoints of the test GPT (5.9 MB each) and refuses the third;
a read-only bind mount refuses every write; a FUSE filesystem (failing_disk.py) answers writes with EIO once
the first save is written. Each ends in exit 74 with one line naming the path, the space needed and free and the
checkpoint `latest` still names, no traceback, no partial directory left; after the full disk the run resumes.
Broken checkpoints: a truncated, corrupt or unnamed newest checkpoint resumes from the newest complete one (the
losses after it bitwise those of the uninterrupted run), or with --no-ckpt-fallback exits 2 naming it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_helpers import metrics, run, train_argv

from megatron_ds.checkpoint.checkpointing import choose
from megatron_ds.checkpoint.metadata import CheckpointError

pytestmark = pytest.mark.slow

SAVE_FAILED = 74


def _mount(*argv: str) -> None:
    result = subprocess.run(["mount", *argv], capture_output=True, text=True)
    assert result.returncode == 0, f"mount {' '.join(argv)} failed (these tests mount as root): {result.stderr}"


@pytest.fixture
def mounts():
    mounted: list[Path] = []

    def mount(*argv: str) -> Path:
        _mount(*argv)
        mounted.append(Path(argv[-1]))
        return mounted[-1]

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


def _one_error_line(result: subprocess.CompletedProcess, start: str) -> str:
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-4000:]
    lines = [line for line in output.splitlines() if start in line]
    assert len(lines) == 1, output[-4000:]
    return lines[0]


def _failed_save_line(result: subprocess.CompletedProcess, ckpt: Path, failed: int, kept: int, error: str) -> str:
    """The one line of a save the disk refused: the error and the path, the space, the checkpoint `latest` still
    names and the way on (exit 74)."""
    line = _one_error_line(result, f"saving iteration {failed} failed")
    assert f"{error} writing {ckpt / f'.tmp-iter_{failed:07d}'}" in line, line
    assert "the save needs about " in line and " are free there" in line, line
    assert f"`latest` still names the last complete checkpoint {ckpt / f'iter_{kept:07d}'}" in line, line
    assert f"resume with --load {ckpt} (exit 74)" in line, line
    return line


@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync", "async"])
def test_full_disk_keeps_the_last_checkpoint_names_the_space_and_resumes(mode, demo_corpus, tmp_path, mounts):
    """Two ranks at ZeRO-2 (each writes its own optimizer partition): the ranks agree on the failure. With
    --async-save the background writer meets it and the end of training, waiting for it, exits the same way."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", "size=13m", "tmpfs", str(disk))
    ckpt = disk / "ckpt"
    flags = ["--zero-stage", "2", "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "10", *mode]
    result = run(train_argv(demo_corpus, 2, flags, iters=30), tmp_path / "full", code=SAVE_FAILED)
    line = _failed_save_line(result, ckpt, 30, 20, "No space left on device (errno ENOSPC)")
    assert "the save needs about 5.9 MB" in line, line
    warning = _one_error_line(result, "warning: the save needs about")
    assert "it will fail unless space is freed" in warning
    assert (ckpt / "latest").read_text() == "iter_0000020"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["iter_0000010", "iter_0000020"]  # no .tmp-

    shutil.rmtree(ckpt / "iter_0000010")  # space freed: the same command resumes from iteration 20
    resumed = run(train_argv(demo_corpus, 2, flags, iters=30), tmp_path / "resumed")
    assert "resuming from iteration 20" in resumed.stdout + resumed.stderr
    assert sorted(metrics(tmp_path / "resumed")[0]) == list(range(21, 31))
    assert (ckpt / "latest").read_text() == "iter_0000030"


def test_first_save_estimates_its_size_from_the_tensors(demo_corpus, tmp_path, mounts):
    """No save yet to measure: the warning's size comes from the parameters (ZeRO-2, fp32: 4 bytes each for the
    weights, 12 for the master copy and Adam's moments; the checkpoint is 5.9 MB)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk))
    result = run(train_argv(demo_corpus, 1, ["--zero-stage", "2", "--save", str(disk / "ckpt")], iters=2),
                 tmp_path / "run", code=SAVE_FAILED)
    warning = _one_error_line(result, "warning: the save needs about")
    needed = float(re.search(r"needs about ([\d.]+) MB", warning).group(1))
    assert 5.5 <= needed <= 6.2, warning
    line = _one_error_line(result, "saving iteration 2 failed")
    assert "no complete checkpoint was saved before it: free space (or give --save another directory)" in line
    assert not any((disk / "ckpt").glob(".tmp-*"))


def test_read_only_disk_keeps_latest_and_writes_nothing(demo_corpus, tmp_path, mounts):
    """A read-only mount (root ignores file modes, a read-only mount it cannot): EROFS on the first write."""
    source = tmp_path / "source"
    schedule = ["--lr-decay-iters", "10"]  # one LR schedule for both runs
    run(train_argv(demo_corpus, 1, [*schedule, "--save", str(source / "ckpt")], iters=5), tmp_path / "first")
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    mounts("--bind", str(source), str(frozen))
    _mount("-o", "remount,bind,ro", str(frozen))
    before = sorted(p.name for p in (source / "ckpt").iterdir())
    ckpt = frozen / "ckpt"
    result = run(train_argv(demo_corpus, 1, [*schedule, "--load", str(ckpt), "--save", str(ckpt)], iters=7),
                 tmp_path / "ro", code=SAVE_FAILED)
    line = _one_error_line(result, "saving iteration 7 failed")
    assert "Read-only file system (errno EROFS) writing " + str(ckpt) in line, line
    assert f"`latest` still names the last complete checkpoint {ckpt / 'iter_0000005'}" in line, line
    assert sorted(p.name for p in (source / "ckpt").iterdir()) == before
    assert (ckpt / "latest").read_text() == "iter_0000005"


@pytest.fixture
def failing_disk(tmp_path):
    """``failing_disk(budget)``: a directory on which writes fail with EIO once ``budget`` bytes are written."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def start(budget: int) -> Path:
        backing, mountpoint = tmp_path / "backing", tmp_path / "failing"
        backing.mkdir()
        mountpoint.mkdir()
        server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("failing_disk.py")), str(backing),
                                   str(mountpoint), str(budget)], stderr=subprocess.PIPE, text=True)
        started.append((server, mountpoint))
        deadline = time.time() + 30
        while not mountpoint.is_mount():
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                raise AssertionError("the EIO disk (FUSE: mfusepy from the test extra, libfuse3 and /dev/fuse from "
                                     f"fuse3, scripts/setup-test-system.sh) did not mount: {server.communicate()[1]}")
            time.sleep(0.05)
        return mountpoint

    yield start
    for server, mountpoint in started:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        server.wait(timeout=30)


@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync", "async"])
def test_failing_disk_keeps_the_last_checkpoint_and_names_the_io_error(mode, demo_corpus, tmp_path, failing_disk):
    """A disk that fails with EIO after 6 MB: the save at 10 (4.4 MB) is written, the one at 20 is refused (with
    --async-save the background writer meets it, and the run exits where it next waits for the writer)."""
    ckpt = failing_disk(6_000_000) / "ckpt"
    flags = ["--save", str(ckpt), "--save-interval", "10", *mode]
    result = run(train_argv(demo_corpus, 1, flags, iters=30), tmp_path / "eio", code=SAVE_FAILED)
    _failed_save_line(result, ckpt, 20, 10, "Input/output error (errno EIO)")
    assert (ckpt / "latest").read_text() == "iter_0000010"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["iter_0000010"]  # no .tmp-iter_0000020


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_corpus):
    """An uninterrupted 10-iteration run saving at 5 and 10."""
    cwd = tmp_path_factory.mktemp("reference")
    run(train_argv(demo_corpus, 1, ["--save", "ckpt", "--save-interval", "5"]), cwd)
    return cwd


def _copy(reference: Path, dest: Path) -> Path:
    shutil.copytree(reference / "ckpt", dest / "ckpt")
    return dest / "ckpt"


def _continues(cwd: Path, reference: Path, first: int) -> None:
    got, want = metrics(cwd)[0], metrics(reference)[0]
    assert got == {i: want[i] for i in range(first, 11)}  # bitwise


def test_truncated_newest_checkpoint_falls_back_with_a_warning_or_names_the_way(reference, demo_corpus, tmp_path):
    ckpt = _copy(reference, tmp_path)
    model_states = ckpt / "iter_0000010" / "mp_rank_00_model_states.pt"
    with open(model_states, "r+b") as f:
        f.truncate(1000)
    strict = run(train_argv(demo_corpus, 1, ["--load", str(ckpt), "--no-ckpt-fallback"]), tmp_path / "strict", code=2)
    line = _one_error_line(strict, "is partial")
    assert (f"checkpoint {ckpt / 'iter_0000010'} is partial: mp_rank_00_model_states.pt has 1000 bytes" in line
            and f"the newest complete checkpoint is {ckpt / 'iter_0000005'}: add --ckpt-step 5 to resume from it"
            in line), line

    result = run(train_argv(demo_corpus, 1, ["--load", str(ckpt)]), tmp_path / "fallback")
    warning = _one_error_line(result, "warning: checkpoint")
    assert (f"{ckpt / 'iter_0000010'} is partial" in warning and
            f"resuming from the newest complete checkpoint {ckpt / 'iter_0000005'} instead" in warning), warning
    assert "resuming from iteration 5 (20 samples)" in result.stderr
    _continues(tmp_path / "fallback", reference, 6)


def test_ckpt_step_loads_that_iteration_and_a_corrupt_one_is_named(reference, demo_corpus, tmp_path):
    ckpt = _copy(reference, tmp_path)
    result = run(train_argv(demo_corpus, 1, ["--load", str(ckpt), "--ckpt-step", "5"]), tmp_path / "step")
    assert "resuming from iteration 5 (20 samples)" in result.stderr and "warning" not in result.stderr
    _continues(tmp_path / "step", reference, 6)

    missing = run(train_argv(demo_corpus, 1, ["--load", str(ckpt), "--ckpt-step", "7"]), tmp_path / "seven", code=2)
    line = _one_error_line(missing, "--ckpt-step 7")
    assert f"{ckpt / 'iter_0000007'} does not exist; complete checkpoints in {ckpt}: iterations 5, 10" in line

    # the right size, the wrong bytes: DeepSpeed cannot read it; named with the complete one before it
    model_states = ckpt / "iter_0000010" / "mp_rank_00_model_states.pt"
    model_states.write_bytes(b"\0" * model_states.stat().st_size)
    corrupt = run(train_argv(demo_corpus, 1, ["--load", str(ckpt)]), tmp_path / "corrupt", code=2)
    line = _one_error_line(corrupt, "is corrupt")
    assert (f"checkpoint {ckpt / 'iter_0000010'} is corrupt" in line and
            f"the newest complete checkpoint before it is {ckpt / 'iter_0000005'}: add --ckpt-step 5" in line), line


@pytest.mark.parametrize("latest", ["", "iter_0000030", "\x00\xffgarbage", "../../etc"])
def test_latest_naming_nothing_falls_back_to_the_newest_complete(reference, tmp_path, latest, capsys):
    ckpt = _copy(reference, tmp_path)
    (ckpt / "latest").write_bytes(latest.encode("utf-8", "surrogateescape"))
    (ckpt / "iter_0000010" / "mds_checkpoint.json").write_text("{not json")  # and the newest is corrupt
    tag, directory, metadata = choose(str(ckpt))
    assert (tag, metadata["iteration"]) == ("iter_0000005", 5)
    warning = capsys.readouterr().err
    assert f"resuming from the newest complete checkpoint {directory} instead" in warning, warning
    with pytest.raises(CheckpointError, match="add --ckpt-step 5 to resume from it"):
        choose(str(ckpt), fallback=False)


def test_no_latest_and_no_complete_checkpoint_is_named(reference, tmp_path):
    ckpt = _copy(reference, tmp_path)
    (ckpt / "latest").unlink()
    (ckpt / "latest_checkpointed_iteration.txt").unlink()
    for tag in ("iter_0000005", "iter_0000010"):
        metadata = json.loads((ckpt / tag / "mds_checkpoint.json").read_text())
        (ckpt / tag / next(iter(metadata["files"]))).unlink()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint to resume from instead"):
        choose(str(ckpt))
