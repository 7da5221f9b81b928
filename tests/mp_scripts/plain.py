"""A script for testing `eqxdist.launch` itself, without JAX (so it starts fast).

    plain.py env                  print the environment the launcher set, and exit
    plain.py script ARGS...       print what the script sees of how it was started
    plain.py fail OUT ID CODE     process ID exits with CODE; the others sleep
    plain.py sleep OUT            every process sleeps
    plain.py hang OUT ID          process ID sleeps; the others exit with status 0
    plain.py graceful OUT         every process sleeps, and exits with 0 on SIGTERM
    plain.py flaky OUT K CODE     the first K attempts (counted in OUT/attempts-ID):
                                  process 1 exits with CODE, the others sleep; later
                                  attempts all exit with 0

Sleeping processes start a child that sleeps too; every process id goes to
`OUT/pids`, so the tests can check that none outlives the launcher."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

index = int(os.environ.get("EQXDIST_PROCESS_ID", "0"))
mode = sys.argv[1]
if mode == "env":
    keys = [
        "EQXDIST_COORDINATOR",
        "EQXDIST_NUM_PROCESSES",
        "EQXDIST_PROCESS_ID",
        "JAX_PLATFORMS",
        "XLA_FLAGS",
    ]
    for key in keys:
        print(f"{key}={os.environ[key]}")
    print(f"stderr of {index}", file=sys.stderr)
    print(
        "[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of connected "
        "peer ranks is : 7"
    )
    print("no newline at the end", end="")
    sys.exit(0)

if mode == "script":
    print({"argv": sys.argv, "file": __file__, "path0": sys.path[0], "name": __name__})
    sys.exit(0)

out = Path(sys.argv[2])
if mode == "fail" and index == int(sys.argv[3]):
    time.sleep(0.5)
    print(f"process {index} fails", file=sys.stderr, flush=True)
    sys.exit(int(sys.argv[4]))
if mode == "hang" and index != int(sys.argv[3]):
    time.sleep(0.5)
    print(f"process {index} done", flush=True)
    sys.exit(0)
if mode == "flaky":
    counter = out / f"attempts-{index}"
    attempt = len(counter.read_text().split()) if counter.exists() else 0
    with open(counter, "a") as f:
        f.write(f"{os.environ['EQXDIST_RESTART_COUNT']}\n")
    print(f"attempt {attempt} at {os.environ['EQXDIST_COORDINATOR']}", flush=True)
    if attempt >= int(sys.argv[3]):
        sys.exit(0)
    if index == 1:
        time.sleep(0.2)
        sys.exit(int(sys.argv[4]))
if mode == "graceful":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(out / "pids", "a") as f:
    f.write(f"{os.getpid()}\n{child.pid}\n")
print(f"process {index} sleeping", flush=True)
time.sleep(600)
