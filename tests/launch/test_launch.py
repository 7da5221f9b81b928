"""Multi-process runs with real processes: the launcher, `initialize_distributed`, and
meshes, batches, metrics, training and checkpoints on 2 processes x 4 devices
compared with this process's 8 devices on the same global data.

The scripts the launcher runs live in `tests/mp_scripts/`."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from mp_scripts import common

import eqxdist as ed
from eqxdist import launch
from eqxdist._distributed import detected_cluster
from eqxdist._launch import ports
from eqxdist._launch.job import xla_flags_with_devices

SCRIPTS = Path(__file__).parent.parent / "mp_scripts"
# A generous bound: the runs take seconds; a hang (the bug these tests are for)
# would take forever.
TIMEOUT = 240

# `python` with SIGINT at its default, as a terminal's Ctrl-C finds it, although
# a run in the background (CI) inherits it ignored: reset, then exec Python.
WITH_SIGINT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
]


def run_launcher(
    *args: object, timeout: float = TIMEOUT
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eqxdist.launch", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def explain(result: subprocess.CompletedProcess) -> str:
    return (
        f"exit status {result.returncode}\n--- stdout\n{result.stdout}\n"
        f"--- stderr\n{result.stderr}"
    )


def assert_all_gone(pid_file: Path) -> None:
    """Every process listed in `pid_file` has ended (zombies waiting for init to
    reap them count as ended)."""
    pids = [int(p) for p in pid_file.read_text().split()]
    assert pids
    deadline = time.monotonic() + 10
    while True:
        alive = []
        for pid in pids:
            try:
                state = (
                    Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                )
            except FileNotFoundError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not alive, f"processes {alive} outlived the launcher"


# --------------------------------------------------------------------- the launcher


@pytest.mark.slow
def test_launcher_sets_environment_and_prefixes_output():
    result = run_launcher("-n", 3, "-d", 2, SCRIPTS / "plain.py", "env")
    assert result.returncode == 0, explain(result)
    out = result.stdout.splitlines()
    coordinators = {line for line in out if "EQXDIST_COORDINATOR=" in line}
    assert len({line.split("=")[1] for line in coordinators}) == 1  # one shared port
    for i in range(3):
        assert f"[{i}] EQXDIST_PROCESS_ID={i}" in out
        assert f"[{i}] EQXDIST_NUM_PROCESSES=3" in out
        assert f"[{i}] JAX_PLATFORMS=cpu" in out
        assert f"[{i}] no newline at the end" in out
        assert f"[{i}] stderr of {i}" in result.stderr.splitlines()
        [flags] = [line for line in out if line.startswith(f"[{i}] XLA_FLAGS=")]
        # The test process's own 8-device flag is replaced, not added to.
        assert flags.count("xla_force_host_platform_device_count") == 1
        assert flags.endswith("--xla_force_host_platform_device_count=2")
    assert coordinators.pop().split("=")[1].startswith("127.0.0.1:")
    assert "Gloo" not in result.stdout  # gloo's connection chatter is dropped


@pytest.mark.slow
def test_launcher_runs_the_script_as_python_would():
    script = SCRIPTS / "plain.py"
    # Relative to the working directory, as typed on a command line.
    args = [script.relative_to(SCRIPTS.parent.parent), "script", "a b", "--flag"]
    cwd = SCRIPTS.parent.parent
    direct = subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd
    )
    assert direct.returncode == 0, direct.stderr
    launched = subprocess.run(
        [sys.executable, "-m", "eqxdist.launch", "-n", "1", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=TIMEOUT,
    )
    assert launched.returncode == 0, explain(launched)
    assert launched.stdout == "[0] " + direct.stdout


@pytest.mark.slow
def test_launcher_returns_first_failure_and_stops_the_others(tmp_path):
    result = run_launcher("-n", 3, SCRIPTS / "plain.py", "fail", tmp_path, 1, 3)
    assert result.returncode == 3, explain(result)
    assert "[1] process 1 fails" in result.stderr
    assert "eqxdist.launch: process 1 exited with status 3" in result.stderr
    assert_all_gone(tmp_path / "pids")  # the sleepers and their children


@pytest.mark.slow
def _start_launcher(tmp_path, mode):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eqxdist.launch",
            "-n",
            "2",
            "--grace-period",
            "2",
            str(SCRIPTS / "plain.py"),
            mode,
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(
    ("signum", "status", "mode"),
    [
        (signal.SIGINT, 130, "sleep"),
        (signal.SIGTERM, 143, "sleep"),
        # Processes that stop cleanly on SIGTERM (a preempted run that saved).
        (signal.SIGTERM, 0, "graceful"),
    ],
)
def test_launcher_passes_on_ctrl_c_and_sigterm(tmp_path, signum, status, mode):
    # A process started with SIGINT ignored (as pytest-xdist workers and `cmd &` in
    # a script are) passes that on, and Python then installs no KeyboardInterrupt
    # handler. Started from a terminal, the launcher has Python's own handler: with
    # a handler (not `SIG_IGN`) here, the launcher starts with the default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = _start_launcher(tmp_path, mode)
    finally:
        signal.signal(signal.SIGINT, previous)
    pid_file = tmp_path / "pids"
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and len(pid_file.read_text().split()) == 4):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    assert_all_gone(pid_file)


def test_launcher_rejects_bad_arguments(tmp_path, capsys):
    script = SCRIPTS / "plain.py"
    cases = [
        (["-n", "0", str(script)], "--num-processes must be >= 1, got 0"),
        (["-n", "-3", str(script)], "--num-processes must be >= 1, got -3"),
        (["-n", "100000000", str(script)], "is more than this machine allows"),
        (["-n", "2", "--port", "70000", str(script)], "--port must be in 1..65535"),
        (["-n", "2", "--port", "-5", str(script)], "--port must be in 1..65535"),
        (["-n", "2", "--port", "0", str(script)], "--port must be in 1..65535"),
        (["-n", "2", "--port", "x", str(script)], "--port: invalid int value"),
        (["-n", "2", "--exit-timeout", "0", str(script)], "--exit-timeout must be"),
        (["-n", "2", "-d", "0", str(script)], "--devices-per-process must be >= 1"),
        (["-n", "2", "--grace-period", "-1", str(script)], "--grace-period must be"),
        (["-n", "2", "--max-restarts", "-1", str(script)], "--max-restarts must be >="),
        (["-n", "2", str(tmp_path / "missing.py")], "missing.py' not found"),
        ([str(script)], "--num-processes"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            launch.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def launched(tmp_path, *args):
    return subprocess.Popen(
        [sys.executable, "-m", "eqxdist.launch", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_pids(proc, pid_file, count):
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and len(pid_file.read_text().split()) >= count):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)


@pytest.mark.slow
def test_a_second_run_on_a_used_port_is_refused_and_leaves_the_first_alone(
    tmp_path,
):
    port = ports.free_port()
    first = launched(
        tmp_path, "-n", 2, "--port", port, SCRIPTS / "plain.py", "sleep", tmp_path
    )
    wait_for_pids(first, tmp_path / "pids", 4)
    second = run_launcher("-n", 2, "--port", port, SCRIPTS / "plain.py", "env")
    assert second.returncode == 2, explain(second)
    assert f"port {port} is used by another eqxdist.launch run" in second.stderr
    assert "[0]" not in second.stdout  # it started nothing
    assert first.poll() is None  # the first run goes on
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=60)
    assert_all_gone(tmp_path / "pids")
    # Any other server listening on the port: refused too, naming the port.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        taken = server.getsockname()[1]
        result = run_launcher("-n", 1, "--port", taken, SCRIPTS / "plain.py", "env")
    assert result.returncode == 2, explain(result)
    assert f"port {taken} is in use" in result.stderr
    # Once free again (TIME_WAIT left over or not), the port can be used.
    again = run_launcher("-n", 2, "--port", port, SCRIPTS / "plain.py", "env")
    assert again.returncode == 0, explain(again)


@pytest.mark.slow
def test_a_hung_process_is_killed_after_the_exit_timeout_and_named(tmp_path):
    start = time.monotonic()
    result = run_launcher(
        "-n", 3, "--exit-timeout", 4, SCRIPTS / "plain.py", "hang", tmp_path, 1
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 124, explain(result)
    assert 4 <= elapsed < 24
    assert "[0] process 0 done" in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert re.match(
        r"eqxdist.launch: process 1 did not exit within 4 s \(--exit-timeout\) of "
        r"process [02], which exited with status 0; killed it \(its Python stacks "
        r"are printed above\).",
        last,
    ), last
    # Before it was killed, the hung process printed where it was: the script's
    # `time.sleep` line, in its main thread.
    sleep_line = next(
        n
        for n, line in enumerate((SCRIPTS / "plain.py").read_text().splitlines(), 1)
        if line.strip() == "time.sleep(600)"
    )
    assert re.search(
        rf"^\[1\] +File \".*plain\.py\", line {sleep_line} in <module>$",
        result.stderr,
        re.MULTILINE,
    ), result.stderr
    assert "[0] " not in result.stderr  # only the hung process was asked
    assert_all_gone(tmp_path / "pids")


def signal_when_ready(args, ready, signum):
    """Launch with `args`, send `signum` to the launcher once `ready(stdout so far)`,
    wait; the status, output, and seconds from the signal to the launcher's exit."""
    proc = launched(None, *args)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if ready("".join(lines)):
            break
    assert proc.poll() is None, "".join(lines) + proc.stderr.read()
    start = time.monotonic()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, "".join(lines) + out, err, time.monotonic() - start


@pytest.mark.slow
# No (ordinary_train.py, SIGHUP): the launcher passes SIGHUP on as SIGTERM, so the
# script meets exactly the SIGTERM case, and the launcher's own SIGHUP handling
# (status, last line) is plain.py's case; the training run costs a minute of CI.
@pytest.mark.parametrize(
    ("script", "signum"),
    [
        ("plain.py", signal.SIGTERM),
        ("plain.py", signal.SIGHUP),
        ("ordinary_train.py", signal.SIGTERM),
    ],
)
def test_a_signal_ends_a_script_that_does_not_handle_it_at_once(
    tmp_path, script, signum
):
    # plain.py keeps Python's default SIGTERM disposition; ordinary_train.py trains
    # under jax.distributed, whose handler catches SIGTERM, and never asks the
    # preemption sync point. Neither may hold the run for the grace period, nor be
    # restarted.
    mode = ("sleep",) if script == "plain.py" else ()
    args = ("-n", 2, "-d", 2, "--grace-period", 60, "--max-restarts", 2)
    status, out, err, elapsed = signal_when_ready(
        (*args, SCRIPTS / script, *mode, tmp_path),
        lambda out: (
            "[1] process 1 sleeping" in out and "[0] process 0 sleeping" in out
            if script == "plain.py"
            else "[0] step 1 done" in out
        ),
        signum,
    )
    assert status == 128 + signum, f"{out}\n{err}"
    assert elapsed < 12, f"{elapsed:.1f} s\n{err}"
    assert "restart" not in err
    name = signal.Signals(signum).name
    assert err.strip().splitlines()[-1] == (
        f"eqxdist.launch: received {name}; passed it on and stopped every process."
    )
    if script == "ordinary_train.py":
        assert "[1] eqxdist.launch: SIGTERM: this process does not handle" in err
    assert_all_gone(tmp_path / "pids")


@pytest.mark.slow
def test_a_signal_gives_a_script_that_handles_it_the_grace_period(tmp_path):
    # plain.py graceful sets its own SIGTERM handler; its clean exit is not a
    # failure: nothing is restarted. (A training script that saves and stops at
    # JAX's preemption sync point is Orbax's check-first loop's test below.)
    # Every process must have set its handler (plain.py prints after) before the
    # signal, or one still with the default disposition dies of it.
    ready = ["[0] process 0 sleeping", "[1] process 1 sleeping"]
    status, out, err, _ = signal_when_ready(
        (
            "-n",
            2,
            "-d",
            2,
            "--max-restarts",
            2,
            SCRIPTS / "plain.py",
            "graceful",
            tmp_path,
        ),
        lambda out: all(line in out for line in ready),
        signal.SIGHUP,
    )
    assert status == 0, f"{out}\n{err}"
    assert "restart" not in err
    assert err.strip().splitlines()[-1] == (
        "eqxdist.launch: received SIGHUP; every process exited with status 0."
    )
    assert_all_gone(tmp_path / "pids")


@pytest.mark.slow
@pytest.mark.parametrize(("failures", "max_restarts"), [(2, 3), (3, 2)])
def test_max_restarts_restarts_the_whole_job_after_a_failure(
    tmp_path, failures, max_restarts
):
    result = run_launcher(
        *("-n", 3, "--max-restarts", max_restarts, SCRIPTS / "plain.py"),
        *("flaky", tmp_path, failures, 5),
    )
    restarts = min(failures, max_restarts)
    recovered = failures <= max_restarts
    assert result.returncode == (0 if recovered else 5), explain(result)
    lines = result.stderr.splitlines()
    assert [line for line in lines if "restart" in line] == [
        f"eqxdist.launch: restart {i} of {max_restarts} after process 1 exited "
        "with status 5."
        for i in range(1, restarts + 1)
    ]
    for i in range(3):  # every process ran once per attempt, told its number
        counts = (tmp_path / f"attempts-{i}").read_text().split()
        assert counts == [str(a) for a in range(restarts + 1)]
    ports = set(re.findall(r"\[0\] attempt \d+ at (\S+)", result.stdout))
    assert len(ports) == restarts + 1  # a fresh coordinator each time
    if not recovered:
        assert lines[-1] == (
            "eqxdist.launch: process 1 failed first (exit status 5); stopped "
            "processes 0, 2."
        )
    assert_all_gone(tmp_path / "pids")


@pytest.mark.slow
def test_max_restarts_restarts_a_hung_job_too(tmp_path):
    result = run_launcher(
        *("-n", 2, "--exit-timeout", 1, "--max-restarts", 1, SCRIPTS / "plain.py"),
        *("hang", tmp_path, 1),
    )
    assert result.returncode == 124, explain(result)
    restarts = [line for line in result.stderr.splitlines() if "restart" in line]
    assert restarts == [
        "eqxdist.launch: restart 1 of 1 after process 1 did not exit within 1 s of "
        "process 0."
    ]
    assert result.stdout.count("[0] process 0 done") == 2
    assert_all_gone(tmp_path / "pids")


@pytest.mark.slow
def test_a_sigkilled_launcher_leaves_no_process_behind(tmp_path):
    proc = launched(tmp_path, "-n", 2, SCRIPTS / "plain.py", "sleep", tmp_path)
    wait_for_pids(proc, tmp_path / "pids", 4)
    proc.kill()  # no handler runs: the parent-death signal and the watchdog act
    proc.communicate(timeout=30)
    assert_all_gone(tmp_path / "pids")


@pytest.mark.slow
def test_the_last_line_names_the_first_failing_process(tmp_path):
    result = run_launcher("-n", 3, SCRIPTS / "plain.py", "fail", tmp_path, 2, 7)
    assert result.returncode == 7, explain(result)
    assert result.stderr.strip().splitlines()[-1] == (
        "eqxdist.launch: process 2 failed first (exit status 7); stopped processes "
        "0, 1."
    )


@pytest.mark.slow
def test_launcher_reports_a_single_process_status(tmp_path):
    result = run_launcher("-n", 1, SCRIPTS / "plain.py", "fail", tmp_path, 0, 5)
    assert result.returncode == 5, explain(result)


# ---------------------------------------------------------- initialize_distributed

CLUSTER_VARIABLES = [
    "EQXDIST_COORDINATOR",
    "EQXDIST_NUM_PROCESSES",
    "EQXDIST_PROCESS_ID",
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "OMPI_MCA_orte_hnp_uri",
    "KUBERNETES_SERVICE_HOST",
]


@pytest.fixture
def plain_environment(monkeypatch):
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_initialize_distributed_is_a_noop_in_a_plain_process(plain_environment):
    ed.initialize_distributed()
    ed.initialize_distributed()  # and calling it twice is fine
    assert not jax.distributed.is_initialized()
    assert jax.process_count() == 1 and len(jax.devices()) == 8


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"EQXDIST_COORDINATOR": "127.0.0.1:1234"}, "EQXDIST_NUM_PROCESSES"),
        (
            {
                "EQXDIST_COORDINATOR": "h:1",
                "EQXDIST_NUM_PROCESSES": "two",
                "EQXDIST_PROCESS_ID": "0",
            },
            "EQXDIST_NUM_PROCESSES='two' is not an integer",
        ),
        (
            {
                "EQXDIST_COORDINATOR": "h:1",
                "EQXDIST_NUM_PROCESSES": "2",
                "EQXDIST_PROCESS_ID": "2",
            },
            "got 2 and 2",
        ),
        (
            {
                "EQXDIST_COORDINATOR": "nohost",
                "EQXDIST_NUM_PROCESSES": "2",
                "EQXDIST_PROCESS_ID": "0",
            },
            "has no host; expected 'host:port'",
        ),
    ],
)
def test_initialize_distributed_rejects_a_broken_environment(
    plain_environment, variables, message
):
    for name, value in variables.items():
        plain_environment.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        ed.initialize_distributed()
    assert not jax.distributed.is_initialized()


def test_cluster_detection_follows_jax(plain_environment):
    assert detected_cluster() is None
    slurm = {
        "SLURM_JOB_ID": "42",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    for name, value in slurm.items():
        plain_environment.setenv(name, value)
    plain_environment.setenv("SLURM_NTASKS", "1")
    assert detected_cluster() is None  # a one-task job is a plain process
    plain_environment.setenv("SLURM_NTASKS", "2")
    assert detected_cluster() == "SlurmCluster"


# --------------------------------------------------- 2 processes x 4 devices vs 1 x 8


@pytest.fixture(scope="module")
def basics(tmp_path_factory):
    out = tmp_path_factory.mktemp("basics")
    result = run_launcher("-n", 2, "-d", 4, SCRIPTS / "mp_basics.py", out)
    assert result.returncode == 0, explain(result)
    return json.loads((out / "basics.json").read_text()), result


DATA = np.arange(16 * 3, dtype=np.float32).reshape(16, 3) - 20.0  # mp_basics.py's


def value(basics, name):
    checks, _ = basics
    result = checks[name]
    assert not (isinstance(result, dict) and "error" in result), result.get("error")
    return result


@pytest.mark.slow
def test_mesh_spans_all_processes(basics):
    assert value(basics, "mesh") == {
        "process_count": 2,
        "total_devices": 8,
        "local_devices": 4,
        "jax_process_count": 2,
    }


@pytest.mark.slow
def test_shard_batch_assembles_process_local_rows(basics):
    got = value(basics, "shard_batch")
    assert got["shape"] == [16, 3] and got["spec"] == "P('data',)"
    np.testing.assert_array_equal(np.array(got["full"]), DATA)
    assert got["sum"] == DATA.sum() and got["scalar"] == 2.5 and got["tag"] == "t"


@pytest.mark.slow
def test_reductions_across_processes(basics):
    assert value(basics, "global_reductions") == {
        "mean": float(DATA.mean()),
        "sum": float(DATA.sum()),
        "max": float(DATA.max()),
        "min": float(DATA.min()),
    }
    got = value(basics, "collectives")
    assert got["mean"] == pytest.approx(DATA.mean())
    assert got["sum"] == DATA.sum() and got["max"] == DATA.max()
    np.testing.assert_array_equal(got["first_column"], DATA[:, 0])


@pytest.mark.slow
def test_metrics_sync_across_processes(basics):
    labels = np.arange(16) % 3
    accuracy = np.mean(DATA.argmax(-1) == labels)
    assert value(basics, "metrics") == {
        "mean": pytest.approx(DATA[:, 0].mean()),
        "accuracy": pytest.approx(accuracy),
        "sum": float(DATA.sum()),
    }


@pytest.mark.slow
def test_placing_process_local_state_on_a_global_mesh(basics):
    import equinox as eqx

    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    got = value(basics, "replicate_params")
    assert got["specs"] == ["P()"]
    np.testing.assert_array_equal(got["weight"], np.asarray(model.layers[0].weight))
    np.testing.assert_array_equal(got["key"], jax.random.key_data(jax.random.key(3)))
    model = eqx.nn.MLP(4, 2, 16, 1, key=jax.random.key(0))
    got = value(basics, "shard_model_state")
    assert got["spec"] == "P('data', None)"
    np.testing.assert_array_equal(got["weight"], np.asarray(model.layers[0].weight))
    assert value(basics, "jit_on_placed") == pytest.approx(DATA.sum() * 2)


@pytest.mark.slow
def test_per_row_evaluation_across_processes(basics):
    # Each process passed the first 7 of its 8 rows.
    real = np.concatenate([DATA[:7], DATA[8:15]])
    for view in ("device", "global"):
        got = value(basics, "per_row_eval")[view]
        assert got["total"] == pytest.approx(real[:, 0].sum())
        np.testing.assert_array_equal(got["twice"], 2 * real[:, 0])
        np.testing.assert_array_equal(got["x"], real)


@pytest.mark.slow
def test_print_metrics_prints_once(basics):
    _, result = basics
    assert result.stdout.count("printed once") == 1
    # The title centred in `=` to the width of the longest line.
    assert "[0] = printed once " in result.stdout.splitlines()
    assert "[0] value: 0.500000" in result.stdout


@pytest.fixture(scope="module")
def training(tmp_path_factory, mesh8):
    """The `common` problem trained here (1 process x 8 devices) and by
    `mp_train.py` (2 processes x 4 devices)."""
    ckpt1 = tmp_path_factory.mktemp("ckpt1")
    reference = {}
    for strategy in ("dp", "fsdp"):
        step = common.make_step(mesh8, strategy)
        state, first, _ = common.train(step, common.make_state(), 0, 2)
        reference[f"{strategy}_step2"] = common.flat(state)
        if strategy == "dp":
            ed.save_checkpoint(ckpt1, state, step=2)
        state, second, _ = common.train(step, state, 2, common.STEPS)
        reference[strategy] = common.flat(state)
        reference[f"{strategy}_metrics"] = first + second

    out = tmp_path_factory.mktemp("mp_train")
    result = run_launcher("-n", 2, "-d", 4, SCRIPTS / "mp_train.py", out, ckpt1)
    assert result.returncode == 0, explain(result)
    runs = {
        name: dict(np.load(out / f"{name}.npz"))
        for name in (
            "dp",
            "fsdp",
            "fsdp_step2",
            "fsdp_resumed",
            "from_one_process",
            "fsdp_init",
        )
    }
    runs["results"] = json.loads((out / "results.json").read_text())
    return reference, runs, out, result


def assert_same_arrays(got, want, exact=True):
    assert sorted(got) == sorted(want)
    for path in want:
        if exact:
            np.testing.assert_array_equal(got[path], want[path], err_msg=path)
        else:
            # Cross-process all-reduces add in another order than one process does.
            np.testing.assert_allclose(
                got[path], want[path], rtol=2e-5, atol=1e-6, err_msg=path
            )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_training_on_2x4_matches_1x8(training, strategy):
    reference, runs, _, _ = training
    assert_same_arrays(runs[strategy], reference[strategy], exact=False)
    got, want = runs["results"][strategy], reference[f"{strategy}_metrics"]
    assert len(got) == len(want) == common.STEPS
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["accuracy"] == w["accuracy"]


@pytest.mark.slow
def test_training_prints_metrics_once(training):
    *_, result = training
    for strategy in ("dp", "fsdp"):
        # The title centred in `=` (none when it is the widest line), by process 0.
        heading = re.compile(rf"\[\d\] =* {strategy} final metrics =*")
        headings = [line for line in result.stdout.splitlines() if heading.match(line)]
        assert len(headings) == 1 and headings[0].startswith("[0] ")


@pytest.mark.slow
def test_resume_on_2_processes_equals_the_uninterrupted_run(training):
    _, runs, _, _ = training
    assert runs["results"]["resumed_step"] == 2
    assert "P('data', None)" in runs["results"]["restored_specs"]  # FSDP layout
    assert_same_arrays(runs["fsdp_resumed"], runs["fsdp"])
    assert runs["results"]["fsdp_resumed"] == runs["results"]["fsdp"][2:]


@pytest.mark.slow
def test_init_state_on_2_processes_equals_the_state_built_on_one(training):
    _, runs, _, _ = training
    # Every process runs init_state's programs (one per group of leaves) in turn.
    assert_same_arrays(runs["fsdp_init"], common.flat(common.make_state()))
    assert "P('data', None)" in runs["results"]["init_specs"]


@pytest.mark.slow
def test_checkpoint_from_1_process_restores_on_2(training):
    reference, runs, _, _ = training
    assert "P('data', None)" in runs["results"]["from_one_process_specs"]
    assert_same_arrays(runs["from_one_process"], reference["dp_step2"])


@pytest.mark.slow
def test_checkpoint_from_2_processes_restores_on_1(training, mesh8):
    _, runs, out, _ = training
    # Orbax's per-process data files: process 1 wrote the shards it held.
    data = out / "ckpt" / "2" / "default"
    assert sorted(p.name for p in data.glob("ocdbt.process_*")) == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]
    dp = ed.make_train_step(common.loss_fn, common.OPTIMIZER, mesh8)
    target = dp.place_state(common.make_state())  # replicated on 8 devices
    restored = ed.restore_checkpoint(out / "ckpt", target)
    assert_same_arrays(common.flat(restored), runs["fsdp_step2"])
    four = ed.create_data_parallel_mesh(4)
    target = ed.make_train_step(common.loss_fn, common.OPTIMIZER, four).place_state(
        common.make_state()
    )
    restored = ed.restore_checkpoint(out / "ckpt", target, step=2)
    assert restored.model.layers[0].weight.sharding.mesh.size == 4
    assert_same_arrays(common.flat(restored), runs["fsdp_step2"])


# --------------------------------------------------------------------- failures


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "status", "message"),
    [
        ("raise", 1, "[1] RuntimeError: injected failure in process 1"),
        # sys.exit skips the exception hook; it used to leave process 1 waiting at
        # its exit for process 0, stuck in a step waiting for process 1.
        ("exit", 3, "[1] process 1 exits with status 3"),
    ],
)
def test_a_failing_process_stops_the_run(tmp_path, how, status, message):
    # The runs take seconds; a process waiting at its exit would take minutes.
    result = run_launcher(
        "-n", 2, "-d", 4, SCRIPTS / "mp_fail.py", tmp_path, how, timeout=60
    )
    assert result.returncode == status, explain(result)
    # Training did run across processes. Process 1 finishing step 2 needs process
    # 0 in step 2's collectives, so process 0 had printed step 1; its own "step 2
    # done" can be lost to the stop that process 1's failure starts (seen in CI).
    assert "[1] step 2 done" in result.stdout
    assert "[0] step 1 done" in result.stdout
    assert message in result.stdout + result.stderr
    assert f"eqxdist.launch: process 1 exited with status {status}" in result.stderr
    # The traceback starts in the script, as under `python mp_fail.py`.
    assert "_launch_child" not in result.stderr
    assert "DEADLINE_EXCEEDED" not in result.stderr
    assert_all_gone(tmp_path / "pids")


# ------------------------------------------------------------------- preemption


def preemption_run(command, victim):
    """Start `command`, SIGTERM process `victim` once it printed `step 3`, wait."""
    run = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines = []
    for line in run.stdout:
        lines.append(line)
        words = line.split()
        if words[-2:] == ["step", "3"] and words[0] == f"[{victim}]":
            os.kill(int(words[2]), signal.SIGTERM)
            break
    out_text, err = run.communicate(timeout=TIMEOUT)
    return run.returncode, "".join(lines) + out_text, err


def launcher_command(*args):
    return [sys.executable, "-m", "eqxdist.launch", "-n", "2", "-d", "2", *args]


def free_slurm_job_id():
    """A job id for which JAX's SLURM port (61440 + id % 4096) is free here."""
    for port in range(61440 + os.getpid() % 4096, 65536):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(port - 61440)
    pytest.skip("no free port in JAX's SLURM range")


def slurm_run(tmp_path, args):
    """Two processes started by hand with the variables SLURM's `srun` sets, as on
    a cluster: JAX detects it and `initialize_distributed` joins them (no eqxdist
    launcher)."""
    base = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    job = free_slurm_job_id()
    procs, logs = [], []
    for rank in range(2):
        env = dict(
            base,
            SLURM_JOB_ID=job,
            SLURM_STEP_NODELIST="localhost",
            SLURM_NTASKS="2",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            JAX_PLATFORMS="cpu",
            # The flags the launcher gives its processes (this process's, with
            # its device count replaced), so that this run's segment compiles as
            # the launcher's segments of the same run do and resumes bit-exactly.
            XLA_FLAGS=xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), 2),
        )
        logs.append(tmp_path / f"slurm{job}_{rank}.log")
        with open(logs[-1], "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-u", *map(str, args)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    for proc in procs:
        proc.wait(timeout=TIMEOUT)
    outputs = [log.read_text() for log in logs]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out
    return outputs


@pytest.mark.slow
def test_sigterm_to_one_of_2_processes_saves_and_the_rerun_resumes_bit_exactly(
    tmp_path,
):
    """One run preempted three times and finished, bit-exactly the
    uninterrupted run: under the launcher (SIGTERM to process 1), resumed as
    SLURM-style processes without the launcher (SIGTERM to process 0 as it
    restores), resumed under the launcher (SIGTERM to process 0 before its
    checkpoint manager opens), resumed under the launcher to the end. Both
    processes stop at the same step each time, and save it.

    16 steps of 0.3 s each leave a signalled run a dozen steps (about 4 s)
    for the preemption notice to cross JAX's coordination service to both
    processes; the runs with no signal take no pause, so the margin costs
    nothing where the notice is quick."""
    script, steps = SCRIPTS / "preempt_train.py", "16"
    # The runs no signal is sent to take no pause per step (`no-pause`).
    full = run_launcher(
        *launcher_command(
            script, tmp_path / "f", tmp_path / "full.npz", steps, "no-pause"
        )[3:]
    )
    assert full.returncode == 0, explain(full)
    ckpt, resumed = tmp_path / "ckpt", tmp_path / "resumed.npz"
    status, out, err = preemption_run(
        launcher_command(script, ckpt, resumed, steps), victim=1
    )
    assert status == 0, f"{out}\n{err}"
    stopped = {int(m) for m in re.findall(r"\[\d\] preempted at (\d+)", out)}
    assert len(stopped) == 1, out  # both processes stopped at the same step
    (first,) = stopped
    assert re.findall(r"\[(\d)\] preempted", out) and 3 <= first < 15
    assert ed.latest_step(ckpt) == first and not resumed.exists()

    # Resumed under SLURM-style `jax.distributed`, and preempted again while it
    # restores (process 0 signals itself), before either process reached its
    # loop: both stop at the loop's first step. (JAX counts a process that asked
    # about no step as at step 0; before the manager told it the resumed step,
    # such a run stopped at step 1, long passed, and trained to its end.)
    run = (script, ckpt, resumed, steps, "signal-on-resume")
    outputs = slurm_run(tmp_path, run)
    assert all(f"resumed at {first}" in o for o in outputs), outputs
    stopped = {int(m) for o in outputs for m in re.findall(r"preempted at (\d+)", o)}
    assert len(stopped) == 1 and all("preempted" in o for o in outputs), outputs
    (second,) = stopped
    assert second == first + 1 and ed.latest_step(ckpt) == second
    assert not resumed.exists()

    # Resumed under the launcher, preempted before the manager opens (JAX set
    # the stop at step 1 then, on both processes): stopped at the first step.
    third = launcher_command(script, ckpt, resumed, steps, "signal-before-manager")
    run = run_launcher(*third[3:])
    assert run.returncode == 0, explain(run)
    assert run.stdout.count(f"resumed at {second}") == 2, explain(run)
    assert run.stdout.count(f"preempted at {second + 1}\n") == 2, explain(run)
    assert ed.latest_step(ckpt) == second + 1 and not resumed.exists()

    rerun = run_launcher(
        *launcher_command(script, ckpt, resumed, steps, "no-pause")[3:]
    )
    assert rerun.returncode == 0, explain(rerun)
    assert f"[0] resumed at {second + 1}" in rerun.stdout
    assert_same_npz(np.load(resumed), np.load(tmp_path / "full.npz"))


@pytest.mark.slow
def test_sigterm_stops_orbaxs_check_first_loop_on_2_processes_at_a_saved_step(
    tmp_path,
):
    """v0.2's contract, Orbax's shape: `if reached_preemption(step): save(step,
    force=True); break`, with an interval that never saves otherwise. SIGTERM to
    the launcher, which passes it on and gives the processes its grace period:
    both stop at the same step, soon, that step is saved with its metadata (v0.3
    waited for a save since the signal: the loop trained on to its last step),
    and their clean exit is not a failure (nothing restarted)."""
    script, ckpt, out_file = SCRIPTS / "preempt_train.py", tmp_path / "ckpt", "o.npz"
    run = (script, ckpt, tmp_path / out_file, 10, "check-first")
    status, out, err, _ = signal_when_ready(
        ("-n", 2, "-d", 2, "--max-restarts", 2, *run),
        lambda out: "step 2\n" in out,
        signal.SIGTERM,
    )
    assert status == 0, f"{out}\n{err}"
    assert "restart" not in err and "resumed at" not in out  # one attempt only
    assert err.strip().splitlines()[-1] == (
        "eqxdist.launch: received SIGTERM; every process exited with status 0."
    )
    stopped = {int(m) for m in re.findall(r"\[\d\] preempted at (\d+)", out)}
    assert len(stopped) == 1 and out.count("preempted at") == 2, out
    (step,) = stopped
    assert 2 <= step < 10 and not (tmp_path / out_file).exists()
    with ed.CheckpointManager(ckpt) as manager:
        assert manager.all_steps() == [step]
        assert manager.metadata(step) == {"next_step": step}


@pytest.mark.slow
def test_ctrl_c_stops_train_loop_on_2_processes_at_one_saved_step(tmp_path):
    """Ctrl-C to the launcher, which passes SIGINT on to every process:
    `train_loop` takes it like SIGTERM (JAX's preemption sync point), so both
    processes stop at the same step, save it and exit with 130, without a
    traceback (it was a `KeyboardInterrupt` in each, nothing saved)."""
    ckpt = tmp_path / "ckpt"
    run = subprocess.Popen(
        [*WITH_SIGINT, *launcher_command(SCRIPTS / "loop_interrupt.py", ckpt)[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    for line in run.stdout:
        lines.append(line)
        if line.startswith("[1]") and line.split()[-2:] == ["step", "3"]:
            run.send_signal(signal.SIGINT)
            break
    rest, err = run.communicate(timeout=TIMEOUT)
    out = "".join(lines) + rest
    assert run.returncode == 130, f"{out}\n{err}"
    saved = re.search(r"\[0\] interrupted \(Ctrl-C\): saved step (\d+), exiting", out)
    assert saved, f"{out}\n{err}"
    assert ed.latest_step(ckpt) == int(saved[1]) >= 3
    assert "Traceback" not in err and "not reached" not in out, err


def assert_same_npz(got, want):
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_stop_signal_is_raised_at_the_next_check_and_only_once():
    """The launcher's SIGTERM/SIGHUP handler only records the signal; `Stopped` is
    raised where the launcher checks (raised from the handler, it once landed
    inside `queue.Queue.get`'s lock release and broke the lock). Only the first
    signal counts."""
    from eqxdist._launch.job import Stopped, StopRequest

    request = StopRequest()
    request.check()  # nothing received: no exception
    request.handler(signal.SIGHUP, None)
    request.handler(signal.SIGTERM, None)  # a repeat, as schedulers send
    with pytest.raises(Stopped) as info:
        request.check()
    assert info.value.signum == signal.SIGHUP
    request.check()  # raised once: the launcher is already stopping


def test_ctrl_c_is_recorded_like_sigterm_and_raised_as_keyboard_interrupt():
    """SIGINT goes through the same record-then-check path as SIGTERM (the same
    lock hazard), raised as the `KeyboardInterrupt` the launcher handles; a later
    SIGTERM does not replace it."""
    from eqxdist._launch.job import StopRequest

    request = StopRequest()
    request.handler(signal.SIGINT, None)
    request.handler(signal.SIGTERM, None)
    with pytest.raises(KeyboardInterrupt):
        request.check()
    request.check()
