"""The hang watchdog: its allowances (pure), and real ranks under our supervisor, alone, and under a real Slurm."""

import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runtime_helpers import ENTRYPOINT, HERE, clean_env

from megatron_ds.runtime.restarts import NONFINITE_EXIT, Failure, RestartPolicy
from megatron_ds.runtime.watchdog import FLOOR, HANG_EXIT, SLOW_PHASE, Record, Timeouts, name_stuck

PY = sys.executable
HANG_PROBE = str(HERE / "hang_probe.py")


# ---------------------------------------------------------------- allowances (pure)

def test_default_allowance_adapts_to_the_step_time():
    adaptive = Timeouts()
    assert adaptive.allowance("step", [0.05] * 20) == FLOOR <= 300 - 30  # 50 ms steps: a hang is noticed within 5 min
    assert adaptive.allowance("step", [10.0] * 20) == 200  # 10 s steps: 20 x median, above a 60 s checkpoint save
    assert adaptive.allowance("step", [0.1] * 10 + [50.0] * 3) == FLOOR  # the median: a few slow steps change nothing
    for phase in ("starting", "evaluating", "saving"):
        assert adaptive.allowance(phase, [0.05] * 20) == SLOW_PHASE >= 60
    assert adaptive.allowance("step", [0.05, 0.05]) == SLOW_PHASE  # first steps may compile


def test_fixed_and_disabled_timeouts():
    assert Timeouts(step=5).allowance("step", [0.05] * 5) == 5
    assert Timeouts(step=5, slow_phase=30).allowance("saving", []) == 30
    assert Timeouts(step=3000, slow_phase=30).allowance("saving", []) == 3000  # never shorter than a step's
    off = Timeouts(step=0)
    assert not off.enabled and off.allowance("starting", []) == 0 == off.allowance("step", [1.0] * 5)


def test_the_rank_behind_is_named():
    records = {r: Record(r, 1000 + r, "step", 7 if r == 2 else 8, 0.0, 1.0) for r in range(4)}
    stuck = name_stuck(records, stacks={r: Path("/dev/null") for r in range(4)})
    assert list(stuck) == [2] and "did not reach iteration 8" in stuck[2]


def test_restart_policy_gives_up_on_a_loop_and_when_restarts_are_used():
    policy = RestartPolicy(max_restarts=5)
    assert policy.should_restart(Failure(137, 1, 30), stopped_from_outside=False)
    assert policy.should_restart(Failure(HANG_EXIT, 0, 45), stopped_from_outside=False)
    assert not policy.should_restart(Failure(HANG_EXIT, 0, 45), stopped_from_outside=False)  # same place twice
    assert not RestartPolicy(0).should_restart(Failure(1, 0, 3), stopped_from_outside=False)
    assert not RestartPolicy(3).should_restart(Failure(2, 0, None), stopped_from_outside=False)  # config error
    assert not RestartPolicy(3).should_restart(Failure(NONFINITE_EXIT, 0, 12), stopped_from_outside=False)
    assert not RestartPolicy(3).should_restart(Failure(74, 0, 30), stopped_from_outside=False)  # disk refused a save
    assert not RestartPolicy(3).should_restart(Failure(143, 0, 9), stopped_from_outside=True)
    one = RestartPolicy(1)
    assert one.should_restart(Failure(1, 0, 3), False) and not one.should_restart(Failure(1, 0, 9), False)


# ---------------------------------------------------------------- real ranks

def _launch(tmp_path: Path, how: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([ENTRYPOINT, "launch", "--nproc-per-node", "2", "--grace", "2", "--", PY, HANG_PROBE,
                             str(tmp_path), how], env=clean_env(TMPDIR=str(tmp_path), **env),
                            capture_output=True, text=True, timeout=120)
    return result, time.monotonic() - start


def _hang_age(tmp_path: Path) -> float:
    """Seconds since the probes reached their hang."""
    return time.time() - max(float(p.read_text()) for p in tmp_path.glob("hang_start_*"))


@pytest.mark.slow
def test_supervisor_names_the_sleeping_rank_outside_the_collective(tmp_path):
    result, _ = _launch(tmp_path, "sleep")
    age = _hang_age(tmp_path)
    print(f"\nsupervisor: {age:.1f} s from the hang to the end of the job (step timeout 3 s)")
    assert result.returncode == HANG_EXIT, result.stderr
    assert age <= 3 + 15, f"{age:.1f} s from the hang to the end"
    assert "stuck rank: 1: not inside a collective while the other ranks wait in one" in result.stderr
    for rank in (0, 1):  # both answered the dump request
        assert f"stacks of rank {rank}:" in result.stderr
    (stacks,) = tmp_path.glob("mds-watchdog-*/rank1.stacks")
    assert "hang_probe.py" in stacks.read_text() and "all_reduce" not in stacks.read_text()
    # the flight recorder follows the stacks: rank 0's last collective is the all_reduce it waits in, not completed
    for rank in (0, 1):
        assert f"flight recorder of rank {rank}:" in result.stderr
    (trace,) = tmp_path.glob("mds-watchdog-*/rank0.flight_recorder.pkl")
    last = pickle.loads(trace.read_bytes())["entries"][-1]
    assert last["profiling_name"] == "gloo:all_reduce" and last["collective_seq_id"] == 9, last
    assert last["state"] != "completed", last
    assert "flight recorder: " in (trace.parent / "rank0.stacks").read_text()


@pytest.mark.slow
def test_launch_with_restarts_gives_up_on_a_restart_loop(tmp_path):
    """The same failure at the same iteration twice: no further restart, the cause is said."""
    driver = ("import sys\nfrom megatron_ds.runtime import bootstrap\n"
              "plan = bootstrap.make_plan(2)\n"
              f"sys.exit(bootstrap.spawn_ranks(plan, [{PY!r}, {HANG_PROBE!r}, {str(tmp_path)!r}, 'exit3'], grace=2, "
              "max_restarts=5))\n")
    result = subprocess.run([PY, "-c", driver], env=clean_env(TMPDIR=str(tmp_path)), capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 3, result.stderr
    assert "restart 1/5 after exit code 3 of rank 1 at iteration 5" in result.stderr
    assert ("restart loop: 2 attempts in a row ended with the same failure (exit code 3 of rank 1 at iteration 5); "
            "giving up") in result.stderr
    assert "restart 2/5" not in result.stderr


@pytest.mark.slow
def test_rank_without_a_supervisor_watches_itself(tmp_path):
    """One task per GPU (here: RANK set by hand, as a scheduler would): each rank's own watchdog ends it with 124.
    Rank 0 (waiting in the collective, 3 s) fires before rank 1 (sleeping, 6 s), so neither sees the other's
    exit first."""
    from megatron_ds.runtime.rendezvous import hosted_store

    with hosted_store() as store:
        procs = [subprocess.Popen([PY, HANG_PROBE, str(tmp_path), "sleep"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                                MASTER_ADDR="127.0.0.1", PROBE_STAGGER="1", **store.rank_env))
                 for r in range(2)]
        outputs = [p.communicate(timeout=120) for p in procs]
    age = _hang_age(tmp_path)
    print(f"\nself-watching ranks: {age:.1f} s from the hang to the last exit (step timeouts 3 s and 6 s)")
    assert [p.returncode for p in procs] == [HANG_EXIT, HANG_EXIT], outputs
    assert age <= 6 + 5, f"{age:.1f} s"
    assert "mds watchdog: HANG: rank 1" in outputs[1][1] and "hang_probe.py" in outputs[1][1]
    assert "all_reduce" in outputs[0][1]  # rank 0's stacks show where it waits
    assert "mds watchdog: flight recorder: " in outputs[0][1]  # and its flight recorder, after them


@pytest.mark.slow
def test_srun_step_ends_when_a_rank_sleeps_inside_a_collective(slurm, tmp_path):
    """srun -n 2 (one task per rank, no supervisor of ours): the ranks' own watchdogs exit 124 and
    --kill-on-bad-exit ends the step within the timeout (3 s here, for rank 0 waiting in the all_reduce; the
    sleeping rank 1 has 6 s) plus a few seconds. srun exits with the largest task exit code: 143 for the task
    Slurm terminated, so the 124 is in srun's task line."""
    start = time.monotonic()
    result = subprocess.run(["srun", "-n", "2", "--kill-on-bad-exit=1", "--time=3", ENTRYPOINT, "launch", "--",
                             PY, HANG_PROBE, str(tmp_path), "sleep"],
                            env=slurm.env(PROBE_STAGGER="1"), capture_output=True, text=True, timeout=150)
    age = _hang_age(tmp_path)
    print(f"\nsrun: {time.monotonic() - start:.1f} s in all, {age:.1f} s from the hang to the end of the step")
    assert result.returncode != 0, result.stdout + result.stderr + slurm.logs()
    assert age <= 3 + 10, f"{age:.1f} s"
    assert "mds watchdog: HANG: rank 0" in result.stderr and "all_reduce" in result.stderr
    assert "task 0: Exited with exit code 124" in result.stderr, result.stderr
