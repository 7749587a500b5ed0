"""The SIF as HPC users run it: `make sif-cpu` converts the CPU image the Docker tests build (one definition,
apptainer/mds.def, for every flavour), its %test runs on the read-only image, and `apptainer exec` trains 2 ranks
on data bound in from the host, to the losses of the same run outside the container, whose resume from the
container's checkpoint continues exactly.

Apptainer is the host's where it has one, else the Debian root (trixie, sid's apptainer) that
scripts/setup-apptainer.sh builds and scripts/apptainer enters (the `apptainer` marker deselects these tests; a
missing piece fails naming itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from .recipes import CPU_TEST_IMAGE, ROOT, make

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.apptainer]

ENTRYPOINT = str(Path(sys.executable).with_name("entrypoint"))
LAUNCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
INSIDE_DATA, INSIDE_OUT = "/data", "/out"


def environment() -> dict[str, str]:
    """The test's environment without launcher variables, one thread per rank (apptainer passes it in)."""
    return dict({k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}, OMP_NUM_THREADS="1")


def apptainer(*args: str, name: str = "apptainer", cwd: Path | None = None) -> subprocess.CompletedProcess:
    """scripts/apptainer (or scripts/singularity) with ARGS, run in CWD: not the checkout, whose megatron_ds/
    would shadow the image's (apptainer binds the working directory, and `python -m` imports from it)."""
    return subprocess.run([str(ROOT / "scripts" / name), *args], capture_output=True, text=True, timeout=600,
                          env=environment(), cwd=cwd or tempfile.gettempdir())


@pytest.fixture(scope="session")
def sif(docker, cpu_image, tmp_path_factory):
    """mds-cpu.sif from the session's CPU image by `make sif-cpu` (which sets up Apptainer where the host has
    none); its path and build log."""
    setup = subprocess.run(["bash", str(ROOT / "scripts" / "setup-apptainer.sh")], capture_output=True, text=True,
                           timeout=1200)
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    path = tmp_path_factory.mktemp("sif") / "mds-cpu.sif"
    code, log = make(docker, "sif-cpu", f"IMAGE_CPU={CPU_TEST_IMAGE}", f"SIF_CPU={path}")
    assert code == 0, log[-6000:]
    assert path.is_file(), f"make sif-cpu reported success but wrote no {path}:\n{log[-3000:]}"
    return SimpleNamespace(path=str(path), log=log)


def test_build_runs_its_test_on_the_read_only_image(sif):
    assert "apptainer/mds.def" in sif.log and f"IMAGE={CPU_TEST_IMAGE}" in sif.log  # the command is printed
    for result in (sif.log, apptainer("test", sif.path).stdout):
        assert "mds doctor (flavour cpu" in result and "all checks passed" in result, result[-3000:]
        assert "/opt/mds is read-only (a SIF): this report is not kept" in result
        assert "mds: self check passed" in result and "Read-only file system" not in result
    tested = apptainer("test", sif.path)
    assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-3000:]
    labels = apptainer("inspect", "--labels", sif.path).stdout
    assert "io.mds.flavour: cpu" in labels and f"io.mds.from-image: {CPU_TEST_IMAGE}" in labels, labels


@pytest.mark.parametrize("name", ["apptainer", "singularity"])
def test_doctor_inside_names_the_flavour(sif, name):
    result = apptainer("exec", sif.path, "entrypoint", "doctor", "--strict", name=name)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "mds doctor (flavour cpu" in result.stdout and "all checks passed" in result.stdout


def train_flags(data: str, vocab: str, merges: str, out: str) -> list[str]:
    """A tiny GPT, fp32, 2 ranks over gloo, 10 iterations (eval at 5 and 10), metrics and the data's index cache
    in OUT (the data may be read-only)."""
    return ["train", "--nproc-per-node", "2", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
            "--data-path", data, "--vocab-file", vocab, "--merge-file", merges, "--tokenizer-type",
            "GPT2BPETokenizer", "--split", "98,2,0", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "10", "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
            "--min-lr", "1e-4", "--seed", "7", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1",
            "--metrics-file", f"{out}/metrics.jsonl", "--data-cache-path", f"{out}/index-cache"]


def inside(corpus) -> list[str]:
    """The corpus as the container sees it, bound at /data."""
    return [f"{INSIDE_DATA}/{Path(p).name}" for p in (corpus.prefix, corpus.vocab_file, corpus.merge_file)]


def losses(out: Path) -> tuple[dict[int, float], dict[int, float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return ({r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r},
            {r["iteration"]: r["val_loss"] for r in records if "val_loss" in r})


def on_host(flags: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([ENTRYPOINT, *flags], cwd=cwd, capture_output=True, text=True, timeout=600,
                            env=environment())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def test_training_inside_matches_outside_and_resumes_outside(sif, demo_corpus, tmp_path):
    """5 of 10 iterations in the SIF (data bound read-only, checkpoint and metrics in a bound folder), by
    `apptainer exec` and by `singularity exec`, log the losses of the same run on the host, bitwise; the host
    resumes the container's checkpoint to its end."""
    corpus_dir = str(Path(demo_corpus.prefix).parent)
    flags = [*train_flags(*inside(demo_corpus), INSIDE_OUT), "--exit-interval", "5", "--save", f"{INSIDE_OUT}/ckpt"]
    for name in ("apptainer", "singularity"):
        out = tmp_path / f"out-{name}"
        out.mkdir()
        result = apptainer("exec", "-B", f"{corpus_dir}:{INSIDE_DATA}:ro", "-B", f"{out}:{INSIDE_OUT}", sif.path,
                           "entrypoint", *flags, name=name, cwd=tmp_path)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        assert (out / "ckpt" / "latest").read_text().strip() == "iter_0000005"
    assert losses(tmp_path / "out-singularity") == losses(tmp_path / "out-apptainer")
    out = tmp_path / "out-apptainer"

    host = [demo_corpus.prefix, demo_corpus.vocab_file, demo_corpus.merge_file]
    reference = tmp_path / "reference"
    on_host(train_flags(*host, str(reference)), reference)
    (got, got_val), (want, want_val) = losses(out), losses(reference)
    assert sorted(got) == [1, 2, 3, 4, 5] and got == {i: want[i] for i in range(1, 6)}  # bitwise
    assert got_val == {5: want_val[5]}

    resumed = tmp_path / "resumed"
    log = on_host([*train_flags(*host, str(resumed)), "--load", str(out / "ckpt")], resumed)
    assert "resuming from iteration 5" in log.stdout + log.stderr
    (got, got_val) = losses(resumed)
    assert got == {i: want[i] for i in range(6, 11)} and got_val == {10: want_val[10]}


@pytest.mark.parametrize("name", ["apptainer", "singularity"])
def test_data_not_bound_in_exits_2_naming_it_as_seen_inside(sif, demo_corpus, tmp_path, name):
    result = apptainer("exec", sif.path, "entrypoint", *train_flags(*inside(demo_corpus), str(tmp_path)), name=name,
                       cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    error = [line for line in result.stderr.splitlines() if "--data-path" in line]
    assert len(error) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"file not found: {INSIDE_DATA}/{Path(demo_corpus.prefix).name}.bin" in error[0]
    assert f"`-B HOST_DIR:{INSIDE_DATA}`" in error[0]


@pytest.mark.parametrize("target, variable, builder",
                         [("sif", "IMAGE", "image"), ("sif-cpu", "IMAGE_CPU", "image-cpu")])
def test_sif_before_its_image_names_the_target_that_builds_it(docker, target, variable, builder, tmp_path):
    code, log = make(docker, target, f"{variable}=mds:not-built-here", f"SIF={tmp_path}/x.sif",
                     f"SIF_CPU={tmp_path}/x.sif", timeout=120)
    assert code == 2, log
    assert f"make {target}: the Docker image mds:not-built-here is not in the local Docker daemon: " \
           f"run make {builder} first" in log
    assert not (tmp_path / "x.sif").exists()
