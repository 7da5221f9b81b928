"""The launcher's watchdog, started by `eqxdist.launch` as

    python .../eqxdist/_launch/watchdog.py

It reads process-group ids (one per line) from stdin, the launcher holding the
other end of the pipe. When that pipe closes -- the launcher exited, or was killed
outright (SIGKILL), which no handler in the launcher can see -- it sends SIGKILL to
every group it was told of, so that the processes the scripts started themselves
never outlive the run. (The scripts' own processes die with the launcher through
their parent-death signal; their children have none.)

Standard library only, and run by path, so it starts in milliseconds."""

import contextlib
import os
import signal
import sys


def main() -> None:
    # The launcher's Ctrl-C or SIGTERM is for the launcher: it stops the run and
    # then closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    groups = []
    for line in sys.stdin:
        with contextlib.suppress(ValueError):
            groups.append(int(line))
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


if __name__ == "__main__":
    main()
