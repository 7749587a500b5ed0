"""Slurm running the image as a container, as users run it: Slurm's own OCI support (`srun --container=BUNDLE`, an
oci.conf beside slurm.conf running runc), the bundle made from the CPU image by scripts/oci-bundle.

Two real clusters: Slurm 24.11 (a Debian trixie root, scripts/setup-slurm24-root.sh; several tasks per container
step, each with its task variables), and bookworm's Slurm 22.05 (one task per node per container step, and none of
the task variables inside: the entrypoint places the task from the step's node list). The trainings run 2 ranks on
gloo and are compared, loss for loss, with the same run outside any container.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .recipes import ROOT

sys.path.insert(0, str(ROOT / "tests" / "runtime"))
from runtime_helpers import ENTRYPOINT, IMAGE_PATH, PROBE, Slurm, Slurm24, assert_two_ranks, write_oci_conf  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.slurm_container]

# The CPU image under a tag of its own: the same recipe and tree as tests/images/test_docker_build.py's mds:cpu-test,
# so Docker's layer cache makes the two one build, and the bundle (kept while the image id is the same) stays valid.
IMAGE = "mds:cpu-slurm-test"
CACHE = ROOT / ".cache" / "slurm-container"
BUNDLE, WORK = CACHE / "mds-bundle", CACHE / "work"
JOB_STATES_DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def train_flags(corpus, metrics: str) -> list[str]:
    """A tiny GPT, fp32, 2 data-parallel ranks, 4 steps on the embedded corpus."""
    return ["train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3",
            "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--data-path", corpus.prefix,
            "--vocab-file", corpus.vocab_file, "--merge-file", corpus.merge_file,
            "--tokenizer-type", "GPT2BPETokenizer", "--split", "98,2,0", "--metrics-file", metrics]


def losses(path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


def assert_same_losses(got: dict[int, float], reference: dict[int, float], context: str) -> None:
    """The same run in and out of the container: same torch and DeepSpeed (the image's pins are the venv's)."""
    assert sorted(got) == sorted(reference) == [1, 2, 3, 4], context
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), f"step {step}: {got} vs {reference}\n{context}"


def wait_for_job(cluster, job_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        show = cluster.run(["scontrol", "-o", "show", "job", job_id]).stdout
        fields = dict(item.split("=", 1) for item in show.split() if "=" in item)
        if fields.get("JobState") in JOB_STATES_DONE:
            return f"{fields['JobState']} ExitCode={fields.get('ExitCode')}"
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s")


def submit_and_check_training(cluster, script: Path, reference: dict[int, float]) -> None:
    """sbatch SCRIPT from its directory: the job reaches COMPLETED, its metrics (written relative to the submit
    directory) are the reference run's, and its output holds the loss lines."""
    submit = cluster.run(["sbatch", "--parsable", str(script)], cwd=script.parent)
    assert submit.returncode == 0, submit.stderr + cluster.logs()
    job_id = submit.stdout.strip().split(";")[0]
    state = wait_for_job(cluster, job_id, timeout=400)
    log = (script.parent / f"mds-{job_id}.out").read_text()
    assert state == "COMPLETED ExitCode=0:0", state + log[:6000] + "\n...\n" + log[-3000:] + cluster.logs()
    got = losses(script.parent / "metrics.jsonl")
    assert_same_losses(got, reference, log[-2000:])
    for step, loss in got.items():
        assert f"iteration {step:8d}/       4" in log and f"lm loss: {loss:.6E}" in log, log[-3000:]


# Session-scoped: under pytest-xdist the module-scoped ones were set up twice in one run (the image build, the bundle
# check, the cluster and the reference run once more: a minute).
@pytest.fixture(scope="session")
def work():
    """This run's work directory, under one the bundle binds (the bundle outlives the run: see `bundle`)."""
    WORK.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="run-", dir=WORK))
    yield path
    shutil.rmtree(path)


@pytest.fixture(scope="session")
def bundle(docker, demo_corpus):
    """The CPU image (built by make, or found in Docker's layer cache) as an OCI bundle binding the work directories
    and the corpus: kept in .cache/ while the image is the same (scripts/oci-bundle keeps it), since removing its
    1.5 GB takes longer than making it."""
    build = subprocess.run(["make", "--no-print-directory", "image-cpu", f"IMAGE_CPU={IMAGE}", f"DOCKER={docker}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    start = time.monotonic()
    WORK.mkdir(parents=True, exist_ok=True)
    made = subprocess.run([str(ROOT / "scripts" / "oci-bundle"), IMAGE, str(BUNDLE), str(WORK),
                           str(Path(demo_corpus.prefix).parent)], env=dict(os.environ, DOCKER=docker),
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stdout + made.stderr
    print(f"\nmds: {made.stdout.strip()} in {time.monotonic() - start:.1f} s")
    return BUNDLE


@pytest.fixture(scope="session")
def slurm24(tmp_path_factory, bundle, work, demo_corpus):
    cluster = Slurm24(tmp_path_factory.mktemp("slurm24"), [bundle, WORK, Path(demo_corpus.prefix).parent])
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def reference(work, demo_corpus):
    """The run outside any container: this venv's entrypoint, two local ranks."""
    metrics = work / "reference.jsonl"
    result = subprocess.run([ENTRYPOINT, *train_flags(demo_corpus, str(metrics)), "--nproc-per-node", "2"],
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return losses(metrics)


def test_two_tasks_in_one_container_step_train_as_outside(slurm24, bundle, work, demo_corpus, reference):
    """`srun -n 2 --container=BUNDLE entrypoint train ...`: one rank per task, placed by Slurm's task variables."""
    metrics = work / "srun.jsonl"
    result = slurm24.run(["srun", "-n", "2", "--time=5", f"--container={bundle}", "entrypoint",
                          *train_flags(demo_corpus, str(metrics))], cwd=work, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + slurm24.logs()
    assert "slurm: node 0/1" in output and "slurm runs 2 tasks on this node: one rank each" in output, output[-3000:]
    assert_same_losses(losses(metrics), reference, output[-2000:])


def test_sbatch_oci_script_reaches_completed_with_the_losses(slurm24, bundle, work, demo_corpus, reference):
    """`entrypoint sbatch --runtime oci` writes the script, sbatch runs it: the ranks start in the submit directory
    (the relative --metrics-file lands there) and the job's output holds the training's loss lines."""
    job_dir = work / "sbatch-oci"
    job_dir.mkdir()
    script = job_dir / "job.sh"
    gen = subprocess.run([ENTRYPOINT, "sbatch", "--nodes", "1", "--gpus-per-node", "0", "--ntasks-per-node", "2",
                          "--runtime", "oci", "--image", str(bundle), "--time", "00:05:00", "-o", str(script),
                          "--", *train_flags(demo_corpus, "metrics.jsonl")], capture_output=True, text=True,
                         timeout=60)
    assert gen.returncode == 0, gen.stderr
    submit_and_check_training(slurm24, script, reference)


def test_sbatch_apptainer_script_reaches_completed_with_the_losses(slurm24, bundle, work, demo_corpus, reference):
    """`entrypoint sbatch --runtime apptainer` under Slurm 24.11: each task runs the root's Apptainer (sid's) on the
    image, here the bundle's unpacked root file system (a sandbox: the same files a SIF of the image holds, without
    building one), with the corpus bound by --mount."""
    job_dir = work / "sbatch-apptainer"
    job_dir.mkdir()
    script = job_dir / "job.sh"
    corpus = str(Path(demo_corpus.prefix).parent)
    gen = subprocess.run([ENTRYPOINT, "sbatch", "--nodes", "1", "--gpus-per-node", "0", "--ntasks-per-node", "2",
                          "--runtime", "apptainer", "--image", str(bundle / "rootfs"), "--mount", corpus,
                          "--time", "00:05:00", "-o", str(script), "--", *train_flags(demo_corpus, "metrics.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0, gen.stderr
    submit_and_check_training(slurm24, script, reference)


def test_slurm_22_05_container_step_is_placed_from_its_node_list(bundle, work, tmp_path_factory):
    """Bookworm's Slurm 22.05: a container step runs one task per node (`-n 2` is refused) and shows the task none
    of SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID. The entrypoint says "slurm", not "none": the rank comes from this
    host's place in the step's node list, and `entrypoint launch --nproc-per-node 2` starts the node's ranks; inside
    a batch script (where the container sees the batch shell's variables instead) too."""
    cluster = Slurm(tmp_path_factory.mktemp("slurm2205"))
    cluster.first_job_id = 8000  # beside tests/runtime's cluster (from 1) and Slurm24's (5000)
    write_oci_conf(cluster)
    cluster.start()
    try:
        env = {"PATH": IMAGE_PATH}  # srun hands its environment to the container
        refused = cluster.run(["srun", "-n", "2", "--time=2", f"--container={bundle}", "true"], env=env, timeout=120)
        assert refused.returncode != 0, refused.stdout + refused.stderr
        out = work / "ranks-2205"
        out.mkdir()
        probe = work / "probe.py"
        shutil.copy(PROBE, probe)
        step = cluster.run(["srun", "-n", "1", "-c", "2", "--time=3", f"--container={bundle}", "entrypoint", "launch",
                            "--nproc-per-node", "2", "--", "python3", str(probe), str(out)], env=env, timeout=300)
        assert step.returncode == 0, step.stdout + step.stderr + cluster.logs()
        assert "slurm: node 0/1, spawning 2 local rank(s)" in step.stderr, step.stderr
        assert_two_ranks(out, master=cluster.hostname)

        batch_out = work / "ranks-2205-batch"
        batch_out.mkdir()
        job = work / "job-2205.sh"
        job.write_text(f"#!/bin/bash\n#SBATCH -n 1 -c 2 --time=3 --output={work}/mds-2205-%j.out\n"
                       f"srun --container={bundle} entrypoint launch --nproc-per-node 2 -- "
                       f"python3 {probe} {batch_out}\n")
        submit = cluster.run(["sbatch", "--parsable", str(job)], env=env, cwd=work)
        assert submit.returncode == 0, submit.stderr
        job_id = submit.stdout.strip().split(";")[0]
        state = wait_for_job(cluster, job_id, timeout=300)
        log = (work / f"mds-2205-{job_id}.out").read_text()
        assert state == "COMPLETED ExitCode=0:0", state + log + cluster.logs()
        assert "slurm: node 0/1, spawning 2 local rank(s)" in log, log
        assert_two_ranks(batch_out, master=cluster.hostname)
    finally:
        cluster.stop()
