"""A real local Slurm (started by the `slurm` fixture): srun and sbatch drive `entrypoint launch`."""

import json
import subprocess
import sys
import time

import pytest
from runtime_helpers import ENTRYPOINT, PROBE, assert_two_ranks

pytestmark = pytest.mark.slow
PY = sys.executable


def test_srun_two_tasks_map_and_exec(slurm, tmp_path):
    result = subprocess.run(["srun", "-n", "2", "--time=2", ENTRYPOINT, "launch", "--", PY, str(PROBE), str(tmp_path)],
                            env=slurm.env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr + slurm.logs()
    ranks = assert_two_ranks(tmp_path, master=slurm.hostname)
    assert [r["local_rank"] for r in ranks] == [0, 1] and {r["local_world_size"] for r in ranks} == {2}
    assert 20000 <= ranks[0]["master_port"] < 50000  # derived from the job id


def test_srun_one_task_per_node_spawns(slurm, tmp_path):
    result = subprocess.run(["srun", "-n", "1", "-c", "2", "--time=2", ENTRYPOINT, "launch", "--nproc-per-node", "2",
                             "--", PY, str(PROBE), str(tmp_path)],
                            env=slurm.env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr + slurm.logs()
    assert "spawning 2 local rank(s)" in result.stderr
    assert_two_ranks(tmp_path, master=slurm.hostname)


def test_srun_failing_rank_stops_the_step(slurm, tmp_path):
    """One task per GPU: the rank is exec'd, so Slurm sees its exit code and --kill-on-bad-exit stops the rest
    (srun then reports the largest task exit code: 143 for the task Slurm terminated)."""
    start = time.monotonic()
    result = subprocess.run(["srun", "-n", "2", "--kill-on-bad-exit=1", "--time=2", ENTRYPOINT, "launch", "--",
                             "sh", "-c", 'if [ "$RANK" = 1 ]; then exit 3; fi; sleep 60'],
                            env=slurm.env(), capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and time.monotonic() - start < 30, result.stdout + result.stderr
    assert "task 1: Exited with exit code 3" in result.stderr


def test_sbatch_generated_script_runs_to_the_end(slurm, tmp_path):
    out = tmp_path / "ranks"
    out.mkdir()
    job = tmp_path / "job.sh"
    gen = subprocess.run([ENTRYPOINT, "sbatch", "--nodes", "1", "--gpus-per-node", "0", "--ntasks-per-node", "2",
                          "--runtime", "none", "--time", "00:05:00", "--entrypoint", ENTRYPOINT, "-o", str(job),
                          "--", "launch", "--", PY, str(PROBE), str(out)],
                         env=slurm.env(), capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0, gen.stderr
    submit = subprocess.run(["sbatch", "--parsable", str(job)], env=slurm.env(), cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr + slurm.logs()
    job_id = submit.stdout.strip().split(";")[0]
    state = _wait_for_job(slurm, job_id, timeout=180)  # polls faster than `sbatch --wait`
    logs = "".join(p.read_text() for p in tmp_path.glob("mds-*.out"))
    assert state.startswith("COMPLETED") and "ExitCode=0:0" in state, state + logs + slurm.logs()
    assert_two_ranks(out, master=slurm.hostname)


def _wait_for_job(slurm, job_id: str, timeout: float) -> str:
    """The job's final `scontrol show job` record (JobState=... ExitCode=...)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        show = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=slurm.env(), capture_output=True,
                              text=True, timeout=30).stdout
        fields = dict(item.split("=", 1) for item in show.split() if "=" in item)
        if fields.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return f"{fields['JobState']} ExitCode={fields.get('ExitCode')}"
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s")


def test_sbatch_generated_script_trains_two_ranks(slurm, tmp_path, demo_corpus):
    """The user's path end to end: `entrypoint sbatch --runtime none -- train ...`, submitted to a real Slurm,
    two tasks (one per rank, map + exec), a tiny GPT trained to its last iteration with TP=2."""
    job = tmp_path / "job.sh"
    metrics = tmp_path / "metrics.jsonl"
    train = ["train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--train-iters", "3", "--lr", "1e-3", "--tensor-model-parallel-size", "2", "--log-interval", "1",
             "--eval-iters", "0", "--data-path", demo_corpus.prefix, "--vocab-file", demo_corpus.vocab_file,
             "--merge-file", demo_corpus.merge_file, "--tokenizer-type", "GPT2BPETokenizer", "--split", "98,2,0",
             "--metrics-file", str(metrics)]
    gen = subprocess.run([ENTRYPOINT, "sbatch", "--nodes", "1", "--gpus-per-node", "0", "--ntasks-per-node", "2",
                          "--runtime", "none", "--time", "00:05:00", "--entrypoint", ENTRYPOINT, "-o", str(job),
                          "--", *train], env=slurm.env(), capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0, gen.stderr
    submit = subprocess.run(["sbatch", "--parsable", str(job)], env=slurm.env(), cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr + slurm.logs()
    state = _wait_for_job(slurm, submit.stdout.strip().split(";")[0], timeout=280)
    logs = "".join(p.read_text() for p in tmp_path.glob("mds-*.out"))
    assert state.startswith("COMPLETED") and "ExitCode=0:0" in state, state + logs + slurm.logs()
    records = [json.loads(line) for line in metrics.read_text().splitlines() if "lm_loss" in line]
    assert [r["iteration"] for r in records] == [1, 2, 3], logs
    for r in records:  # the job's output holds the training's loss lines
        assert f"iteration {r['iteration']:8d}/       3" in logs and f"lm loss: {r['lm_loss']:.6E}" in logs, logs
