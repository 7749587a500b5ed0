"""The recipes built for real on a local CPU base, then run: doctor, a 2-rank collective through
`entrypoint launch`, and a 20-step CPU training run of a tiny GPT on the embedded corpus.

Needs a Docker daemon and a BuildKit-capable client: the `docker` fixture (conftest.py) starts dockerd when
none answers and fails these tests, naming the missing piece, when it cannot (the `docker` marker
deselects them: README). The CPU base (Debian bookworm by debootstrap + the CPU torch wheel) is built
once and cached by its
tag; the image builds reuse Docker's layer cache, so a rerun takes seconds.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from .recipes import BUILD_TIMEOUT_S, CPU_TEST_IMAGE, ROOT, make

pytestmark = [pytest.mark.slow, pytest.mark.docker]

IMAGE = CPU_TEST_IMAGE
ROCM_IMAGE = "mds:rocm-cpu-test"


def run(docker, image, *command, timeout=600):
    result = subprocess.run([docker, "run", "--rm", "--shm-size=1g", image, *command], capture_output=True,
                            text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def test_build_says_what_it_skips_and_ends_with_the_self_check(docker, cpu_image):
    log = cpu_image
    assert "docker/cpu-base/build.sh" in log and "DOCKER_BUILDKIT=1" in log and "-f Dockerfile" in log  # printed
    # what the steps skipped, and the self check's report, are kept in the image (the layer cache may
    # replay the steps without printing them again)
    notes = run(docker, IMAGE, "cat", "/opt/mds/build-notes.txt")[1]
    assert "SKIPPED prebuilding DeepSpeed ops" in notes and "no GPU compiler" in notes
    report = run(docker, IMAGE, "cat", "/opt/mds/self-check.txt")[1]
    assert "mds doctor (flavour cpu" in report and "all checks passed" in report


def test_labels_name_the_pins_and_where_the_found_stack_is(docker, cpu_image):
    """Labels carry the versions the recipe asked for, named as pins; what the image holds is recorded in
    /opt/mds/stack.json at build time (on the CPU base torch differs from its pin: the label must not say otherwise)."""
    out = subprocess.run([docker, "image", "inspect", IMAGE, "--format", "{{json .Config.Labels}}"],
                         capture_output=True, text=True, check=True).stdout
    labels = json.loads(out)
    assert labels["org.opencontainers.image.version"] == "0.1.0"
    assert labels["org.opencontainers.image.base.name"].startswith("mds-cpu-base:")
    assert labels["io.mds.stack.deepspeed.pinned"] == "0.19.8" and labels["io.mds.flavour"] == "cpu"
    assert labels["io.mds.stack.torch.pinned"] and labels["org.opencontainers.image.revision"]
    unqualified = [key for key in labels if key.startswith("io.mds.stack.") and not key.endswith(".pinned")]
    assert unqualified == ["io.mds.stack.record"], f"stack labels that do not say they are pins: {unqualified}"
    stack = json.loads(run(docker, IMAGE, "cat", labels["io.mds.stack.record"])[1])
    assert stack["pinned"]["TORCH_VERSION"] == labels["io.mds.stack.torch.pinned"]
    assert stack["found"]["TORCH_VERSION"].startswith("2.13.0") and "TORCH_VERSION" in stack["differs"]


def build_steps(log: str) -> dict[str, str]:
    """BuildKit's plain log: instruction text -> 'CACHED' or 'RAN' for each step of the recipe."""
    steps = dict(re.findall(r"^#(\d+) \[\s*\d+/\d+\] (.+)$", log, re.M))
    cached = set(re.findall(r"^#(\d+) CACHED$", log, re.M))
    return {instruction: "CACHED" if number in cached else "RAN" for number, instruction in steps.items()}


def test_editing_docs_or_benchmarks_rebuilds_nothing(docker, cpu_image, tmp_path):
    """The recipes copy only what the install reads: a copy of the tree with README.md and bench/ edited
    builds from the layer cache alone (install and self check included)."""
    tree = tmp_path / "tree"
    local = {".git", ".cache", "data", "runs", "build", ".pytest_cache"}  # this checkout's own, at its top only
    shutil.copytree(ROOT, tree, ignore=lambda folder, names: [
        n for n in names if n == "__pycache__" or n.startswith(".venv") or n.endswith(".egg-info")
        or (folder == str(ROOT) and n in local)])
    (tree / "README.md").write_text((tree / "README.md").read_text() + "\nan edit that no image needs\n")
    (tree / "bench" / "RESULTS.md").write_text((tree / "bench" / "RESULTS.md").read_text() + "\na new result\n")
    (tree / "bench" / "results" / "new-run.json").write_text('{"kind": "mds_train"}\n')
    result = subprocess.run(["make", "--no-print-directory", "image-cpu", "IMAGE_CPU=mds:cache-test",
                             f"DOCKER={docker}"], cwd=tree, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    steps = build_steps(log)
    runs = {instruction: state for instruction, state in steps.items() if instruction.startswith("RUN")}
    assert any("install-mds.sh" in i for i in runs) and any("self-check.sh" in i for i in runs), log[-6000:]
    rebuilt = [i for i, state in steps.items() if state != "CACHED" and not i.startswith("FROM")]
    assert not rebuilt, f"editing README.md and bench/ rebuilt: {rebuilt}"
    subprocess.run([docker, "rmi", "mds:cache-test"], capture_output=True)


def test_doctor_in_the_image(docker, cpu_image):
    code, out = run(docker, IMAGE, "entrypoint", "doctor", "--strict")
    assert code == 0, out
    assert "all checks passed" in out
    code, out = run(docker, IMAGE, "entrypoint", "doctor", "--json")
    report = json.loads(out[out.index("{"):])
    names = [p["name"] for p in report["patch_manifest"]["patches"]]
    series = (ROOT / "patches" / "deepspeed" / "series").read_text().splitlines()
    assert names == [line.strip() for line in series if line.strip() and not line.startswith("#")]
    assert names[:3] == ["0001-no-start-up-jit-of-shm-comm.patch", "0002-bf16-optimizer-norm-on-device.patch",
                         "0003-zero-bf16-step-on-device.patch"]  # every one applied at build, in order
    stack = json.loads(run(docker, IMAGE, "cat", "/opt/mds/stack.json")[1])
    assert stack["found"]["DEEPSPEED_VERSION"] == "0.19.8" and "TORCH_VERSION" in stack["differs"]


TWO_RANK_ALLREDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} allreduce {t.item():.0f}", flush=True)
dist.destroy_process_group()
"""


def test_two_rank_launch_in_the_image(docker, cpu_image):
    code, out = run(docker, IMAGE, "entrypoint", "launch", "--nproc-per-node", "2", "--",
                    "python3", "-c", TWO_RANK_ALLREDUCE, timeout=300)
    assert code == 0, out
    assert "rank 0/2 allreduce 3" in out and "rank 1/2 allreduce 3" in out


TRAIN = (
    "python3 -m megatron_ds.data.demo_corpus --dest /tmp/demo >/dev/null && "
    "entrypoint train --nproc-per-node 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
    "--seq-length 64 --max-position-embeddings 64 --hidden-dropout 0 --attention-dropout 0 "
    "--micro-batch-size 4 --global-batch-size 8 --train-iters 20 --lr 1e-3 --lr-warmup-iters 2 "
    "--data-path /tmp/demo/stdlib_text_document --vocab-file /tmp/demo/vocab.json "
    "--merge-file /tmp/demo/merges.txt --tokenizer-type GPT2BPETokenizer --split 98,2,0 "
    "--log-interval 1 --eval-iters 0 --metrics-file /tmp/metrics.jsonl --tensorboard-dir /tmp/tb "
    "&& cat /tmp/metrics.jsonl && ls -s /tmp/tb"
)


def test_cpu_training_run_in_the_image(docker, cpu_image):
    """20 steps of a tiny GPT, 2 ranks (data parallel over gloo), on the embedded corpus, in the container."""
    code, out = run(docker, IMAGE, "sh", "-c", TRAIN, timeout=900)
    assert code == 0, out[-6000:]
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{") and '"iteration"' in line]
    losses = {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}
    assert max(losses) == 20, f"expected 20 logged iterations, got {sorted(losses)}"
    assert all(0 < loss < 20 for loss in losses.values())
    assert losses[20] < losses[1], f"loss did not go down: {losses[1]} -> {losses[20]}"
    # the image carries tensorboard (pyproject's `image` extra): the event file is there and not empty
    events = re.findall(r"^\s*(\d+) (events\.out\.tfevents\.\S+)$", out, re.M)
    assert events and int(events[0][0]) > 0, out[-3000:]


def test_rocm_recipe_on_the_cpu_base_says_what_it_skips(docker, cpu_image):
    code, log = make(docker, "image-rocm", "BASE_IMAGE=mds-cpu-base:bookworm-torch-2.13.0_cpu",
                     f"IMAGE_ROCM={ROCM_IMAGE}")
    assert code == 0, log[-6000:]
    notes = run(docker, ROCM_IMAGE, "cat", "/opt/mds/build-notes.txt")[1]
    for skipped in ("SKIPPED prebuilding DeepSpeed ops", "SKIPPED flash-attn (ROCm)", "SKIPPED apex (ROCm)",
                    "torch is a CPU-only build: checking as flavour cpu"):
        assert skipped in notes, f"the ROCm build on a CPU base must say {skipped!r}"
    assert "all checks passed" in run(docker, ROCM_IMAGE, "cat", "/opt/mds/self-check.txt")[1]
    code, out = run(docker, ROCM_IMAGE, "entrypoint", "launch", "--nproc-per-node", "2", "--",
                    "python3", "-c", TWO_RANK_ALLREDUCE, timeout=300)
    assert code == 0 and "rank 1/2 allreduce 3" in out, out
    # the LUMI RCCL profile ships in the image and is selected on LUMI
    code, out = run(docker, ROCM_IMAGE, "entrypoint", "env", "--list-profiles")
    assert code == 0 and any(line.split()[:2] == ["lumi", "rocm"] for line in out.splitlines()), out
    code, out = run(docker, ROCM_IMAGE, "sh", "-c", "SLURM_CLUSTER_NAME=lumi entrypoint env")
    assert code == 0 and "lumi" in out and "NCCL_SOCKET_IFNAME" in out, out


def test_base_without_torch_fails_at_the_self_check_naming_it(docker, cpu_image):
    code, log = make(docker, "image", "BASE_IMAGE=mds-rootfs:bookworm", "IMAGE=mds:bad-base-test", timeout=600)
    assert code != 0
    assert "self check: the base image lacks torch" in log
    assert "== mds step: install DeepSpeed" not in log, "the preflight must stop the build before any install"
