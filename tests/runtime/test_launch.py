"""Real launchers, real processes: the per-node spawner, torchrun, Open MPI, become_rank, and faults."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from runtime_helpers import ENTRYPOINT, PROBE, alive, assert_two_ranks, clean_env, free_port

pytestmark = pytest.mark.slow
PY = sys.executable


def _run(cmd, env=None, timeout=120, **kw):
    return subprocess.run(cmd, env=env or clean_env(), capture_output=True, text=True, timeout=timeout, **kw)


def test_spawner_runs_two_ranks_and_all_reduces(tmp_path):
    result = _run([ENTRYPOINT, "launch", "--nproc-per-node", "2", "--label", "--", PY, str(PROBE), str(tmp_path)])
    assert result.returncode == 0, result.stderr
    ranks = assert_two_ranks(tmp_path, master="127.0.0.1")
    assert [r["local_rank"] for r in ranks] == [0, 1] and {r["local_world_size"] for r in ranks} == {2}
    assert ranks[0]["profile"] == "generic"
    assert "spawning 2 local rank(s)" in result.stderr


def test_the_rendezvous_port_is_held_before_any_rank_starts(tmp_path):
    """Another process grabbing the announced port while the ranks still import must not break the job.

    A probed-free port handed to rank 0 to bind later was taken in CI by another test's connection
    (EADDRINUSE): the launcher now serves the store itself, so the port is bound from the announcement on."""
    slow_rank = f"sleep 3; exec {PY} {PROBE} {tmp_path}"
    proc = subprocess.Popen([ENTRYPOINT, "launch", "--nproc-per-node", "2", "--", "sh", "-c", slow_rank],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    thief = socket.socket()
    try:
        announced = proc.stderr.readline()
        port = int(re.search(r"master 127\.0\.0\.1:(\d+)", announced).group(1))
        with pytest.raises(OSError, match="in use"):
            thief.bind(("127.0.0.1", port))
            thief.listen()  # had it been free, we would hold it while rank 0 tries to serve there
        _, err = proc.communicate(timeout=120)
    finally:
        thief.close()
        proc.kill()
    assert proc.returncode == 0, announced + err
    assert {r["master_port"] for r in assert_two_ranks(tmp_path, master="127.0.0.1")} == {port}


@pytest.mark.parametrize("command", ["launch", "train"])
def test_a_taken_master_port_stops_the_launch_in_seconds_naming_it(tmp_path, demo_corpus, command):
    """--master-port (or MASTER_PORT) that another process holds: exit 2 before any rank starts, not a rank 0
    traceback after its imports."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        argv = ([ENTRYPOINT, "launch", "--master-port", str(port), "--nproc-per-node", "2", "--", PY, str(PROBE),
                 str(tmp_path)] if command == "launch" else
                [ENTRYPOINT, "train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                 "--train-iters", "1", "--lr", "1e-3", "--data-path", demo_corpus.prefix, "--vocab-file",
                 demo_corpus.vocab_file, "--merge-file", demo_corpus.merge_file, "--master-port", str(port),
                 "--nproc-per-node", "2"])
        start = time.monotonic()
        result = _run(argv, timeout=60)
        seconds = time.monotonic() - start
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"MASTER_PORT={port}: cannot serve the ranks' rendezvous on it" in result.stderr, result.stderr
    assert "--master-port" in result.stderr and seconds < 20, (seconds, result.stderr)
    assert not list(tmp_path.glob("rank*.json"))  # no rank ran


def test_torchrun(tmp_path):
    torchrun = str(Path(PY).parent / "torchrun")
    result = _run([torchrun, "--standalone", "--nproc-per-node", "2", "--no-python",  # its agent picks the port
                   ENTRYPOINT, "launch", "--", PY, str(PROBE), str(tmp_path)])
    assert result.returncode == 0, result.stderr
    assert_two_ranks(tmp_path)


def test_open_mpi(tmp_path):
    mpirun = shutil.which("mpirun.openmpi") or shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun not found: install openmpi-bin (`make test` does, as root)")
    result = _run([mpirun, "-n", "2", "--allow-run-as-root", "--oversubscribe", "-x", "PATH",
                   ENTRYPOINT, "launch", "--", PY, str(PROBE), str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = assert_two_ranks(tmp_path, master="127.0.0.1")
    assert [r["local_rank"] for r in ranks] == [0, 1]


def test_mpich_hydra(tmp_path):
    """MPICH's Hydra (as Intel MPI): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS."""
    mpiexec = shutil.which("mpiexec.hydra")
    if mpiexec is None:
        pytest.fail("mpiexec.hydra not found: install mpich (`make test` does, as root)")
    result = _run([mpiexec, "-n", "2", ENTRYPOINT, "launch", "--", PY, str(PROBE), str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = assert_two_ranks(tmp_path, master="127.0.0.1")
    assert [r["local_rank"] for r in ranks] == [0, 1] and {r["local_world_size"] for r in ranks} == {2}


def test_become_rank_spawns_entrypoint_children(tmp_path):
    """What `entrypoint train` does: become_rank spawns `entrypoint <child_argv>` per local rank."""
    driver = (
        "import sys\n"
        "from megatron_ds.runtime.bootstrap import become_rank\n"
        f"code = become_rank(['launch', '--', {PY!r}, {str(PROBE)!r}, {str(tmp_path)!r}], nproc_per_node=2)\n"
        "print('supervisor returned', code)\n"
        "sys.exit(code)\n")
    result = _run([PY, "-c", driver])
    assert result.returncode == 0 and "supervisor returned 0" in result.stdout, result.stderr
    assert_two_ranks(tmp_path, master="127.0.0.1")


def test_become_rank_in_a_rank_sets_the_environment():
    driver = ("import os\nfrom megatron_ds.runtime.bootstrap import become_rank\n"
              "assert become_rank(['unused']) is None\n"
              "print(*[os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', "
              "'MASTER_PORT', 'MDS_PROFILE')])\n")
    env = clean_env(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1",
                    OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_PORT="4321")
    result = _run([PY, "-c", driver], env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "2", "1", "2", "127.0.0.1", "4321", "generic"]


# ---------------------------------------------------------------- faults

RANK_SCRIPT = """
echo $$ > "$OUT/pid_$RANK"
sleep 300 &
echo $! > "$OUT/child_$RANK"
{action}
wait
exit 0
"""


def _pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob("*_*")) if p.name.startswith(("pid_", "child_"))]


def _wait_for_files(out: Path, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while len(list(out.glob("child_*"))) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(out.glob("child_*"))) == count, "ranks did not start"


def _launch_bash(out: Path, action: str, nproc: int = 2, grace: float = 3, **kw):
    script = RANK_SCRIPT.format(action=action)
    return [ENTRYPOINT, "launch", "--nproc-per-node", str(nproc), "--grace", str(grace), "--", "bash", "-c", script]


def test_failing_rank_stops_the_others_and_gives_its_exit_code(tmp_path):
    cmd = _launch_bash(tmp_path, 'if [ "$RANK" = 1 ]; then sleep 0.5; exit 3; fi')
    start = time.monotonic()
    result = _run(cmd, env=clean_env(OUT=str(tmp_path)), timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == 3, result.stderr
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert "root cause: rank 1" in result.stderr and "exited with code 3" in result.stderr
    pids = _pids(tmp_path)
    assert len(pids) == 4 and not [p for p in pids if alive(p)], "a rank or its child is still alive"


def test_rank_killed_by_sigkill_gives_137(tmp_path):
    cmd = _launch_bash(tmp_path, 'if [ "$RANK" = 0 ]; then sleep 0.5; kill -9 $$; fi')
    result = _run(cmd, env=clean_env(OUT=str(tmp_path)), timeout=60)
    assert result.returncode == 137, result.stderr
    assert "rank 0" in result.stderr and "killed by signal 9" in result.stderr
    assert not [p for p in _pids(tmp_path) if alive(p)]


def test_stubborn_rank_is_killed_after_the_grace_period(tmp_path):
    # rank 0 ignores SIGTERM and keeps going (its sleeps die, the loop does not)
    cmd = _launch_bash(tmp_path, 'trap "" TERM; if [ "$RANK" = 1 ]; then sleep 0.5; exit 5; fi; '
                       'while :; do sleep 0.2; done',
                       grace=1)
    start = time.monotonic()
    result = _run(cmd, env=clean_env(OUT=str(tmp_path)), timeout=60)
    assert result.returncode == 5 and time.monotonic() - start < 10, result.stderr
    assert "SIGKILL" in result.stderr
    assert not [p for p in _pids(tmp_path) if alive(p)]


@pytest.mark.parametrize("sig, expect_stop", [(signal.SIGTERM, True), (signal.SIGINT, True), (signal.SIGUSR1, False)])
def test_signals_are_forwarded_to_every_rank(tmp_path, sig, expect_stop):
    name = sig.name[3:]
    action = (f'trap \'echo got > "$OUT/{name}_$RANK"; kill $(cat "$OUT/child_$RANK"); exit 7\' {name}'
              if expect_stop else f'trap \'echo got > "$OUT/{name}_$RANK"; kill $(cat "$OUT/child_$RANK")\' {name}')
    proc = subprocess.Popen(_launch_bash(tmp_path, action), env=clean_env(OUT=str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_files(tmp_path, 2)
        time.sleep(0.3)  # let both shells install their traps and reach `wait`
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert sorted(p.name for p in tmp_path.glob(f"{name}_*")) == [f"{name}_0", f"{name}_1"], stderr
    assert proc.returncode == (7 if expect_stop else 0), stderr
    assert not [p for p in _pids(tmp_path) if alive(p)]


def test_sigterm_to_launcher_stops_ranks_that_ignore_nothing(tmp_path):
    """Plain ranks (no trap) die of the forwarded SIGTERM: exit 143, nothing left."""
    proc = subprocess.Popen(_launch_bash(tmp_path, ""), env=clean_env(OUT=str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_files(tmp_path, 2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr
    assert not [p for p in _pids(tmp_path) if alive(p)]


@pytest.mark.parametrize("env, names", [
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ["RANK=2", "WORLD_SIZE=2"]),
    ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
      "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "n1"},
     ["SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS=4"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, ["OMPI_COMM_WORLD_LOCAL_SIZE=2", "OMPI_COMM_WORLD_SIZE=3"]),
])
def test_inconsistent_environment_is_exit_2_naming_variables(env, names):
    start = time.monotonic()
    result = _run([ENTRYPOINT, "launch", "--", "true"], env=clean_env(**env), timeout=30)
    assert result.returncode == 2 and time.monotonic() - start < 10
    for name in names:
        assert name in result.stderr


def test_launch_tee_writes_per_rank_logs(tmp_path):
    result = _run([ENTRYPOINT, "launch", "--nproc-per-node", "2", "--label", "--tee", str(tmp_path), "--",
                   "sh", "-c", 'echo "hello from $RANK"'])
    assert result.returncode == 0
    assert "[rank0] hello from 0" in result.stdout and "[rank1] hello from 1" in result.stdout
    assert (tmp_path / "rank1.log").read_text() == "hello from 1\n"


def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    """The launcher itself killed (-9, no chance to clean up): its ranks get SIGKILL from the kernel."""
    proc = subprocess.Popen(_launch_bash(tmp_path, ""), env=clean_env(OUT=str(tmp_path)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_files(tmp_path, 2)
        ranks = [int(p.read_text()) for p in sorted(tmp_path.glob("pid_*"))]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while [p for p in ranks if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in ranks if alive(p)]
    finally:
        for path in tmp_path.glob("child_*"):  # the ranks' own children are not covered (documented)
            try:
                os.kill(int(path.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_root_cause_shows_the_failed_ranks_last_output(tmp_path):
    script = 'echo "working $RANK"; if [ "$RANK" = 1 ]; then echo "Traceback: boom" >&2; exit 4; fi; sleep 30'
    result = _run([ENTRYPOINT, "launch", "--nproc-per-node", "2", "--label", "--", "bash", "-c", script], timeout=60)
    assert result.returncode == 4
    cause = result.stderr[result.stderr.index("root cause"):]
    assert "rank 1" in cause and "last output of rank 1:\nworking 1\nTraceback: boom" in cause


def test_signal_grace_lets_ranks_finish_after_an_outside_sigterm():
    """A TERM from outside gives the ranks `signal_grace` (e.g. to save a checkpoint), not the short failure grace."""
    from megatron_ds.runtime.supervisor import RankSpec, supervise

    slow_exit = [PY, "-c", "import signal, sys, time\n"
                 "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(2), sys.exit(0)))\n"
                 "time.sleep(60)"]
    specs = [RankSpec(rank=r, local_rank=r, argv=slow_exit, env=clean_env(), cpus=None) for r in range(2)]
    def terminate_soon():
        time.sleep(1.5)
        os.kill(os.getpid(), signal.SIGTERM)

    for grace, signal_grace, expected in ((0.5, None, 128 + signal.SIGKILL), (0.5, 30, 0)):
        threading.Thread(target=terminate_soon, daemon=True).start()
        start = time.monotonic()
        assert supervise(specs, grace=grace, signal_grace=signal_grace) == expected
        assert time.monotonic() - start < 10


@pytest.mark.parametrize("mode", ["spawn", "exec"])
def test_rank_ld_preload_reaches_ranks_only(tmp_path, mode):
    """MDS_RANK_LD_PRELOAD (the MS-AMP image's libmsamp_dist.so) is preloaded into rank processes, not the launcher."""
    # one write(2) per rank: two ranks share the pipe, and print() may split a line into several writes
    show = [PY, "-c", "import os; maps = open('/proc/self/maps').read(); "
            "os.write(1, f\"PRELOAD {os.environ.get('LD_PRELOAD')} {'libz.so' in maps}\\n\".encode())"]
    env = clean_env(MDS_RANK_LD_PRELOAD="libz.so.1")
    if mode == "exec":
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = _run([ENTRYPOINT, "launch", "--nproc-per-node", "2", "--", *show], env=env)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("PRELOAD")]
    assert lines == ["PRELOAD libz.so.1 True"] * (2 if mode == "spawn" else 1), result.stdout


def test_in_process_rank_reexecs_itself_with_the_rank_preload():
    """`entrypoint train` runs its rank in-process: become_rank re-runs the process so the preload takes effect."""
    show = [PY, "-c", "import os; print('PRELOAD', os.environ.get('LD_PRELOAD'), "
                      "'libz.so' in open('/proc/self/maps').read())"]
    code = ("import sys; from megatron_ds.runtime.bootstrap import become_rank; "
            f"print('RESULT', become_rank(['launch', '--', *{show!r}]))")
    env = clean_env(MDS_RANK_LD_PRELOAD="libz.so.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = _run([PY, "-c", code], env=env)
    assert result.returncode == 0, result.stderr
    assert "PRELOAD libz.so.1 True" in result.stdout and "RESULT" not in result.stdout, result.stdout


def test_a_master_port_out_of_range_exits_2_naming_it(capsys):
    from megatron_ds.runtime import launch_cli

    assert launch_cli.main(["--master-port", "70000", "--", "true"]) == 2
    assert "entrypoint launch: --master-port: must be a TCP port (1-65535), got 70000" in capsys.readouterr().err
