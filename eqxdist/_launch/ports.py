"""The coordinator port of a launched run: a free loopback port, or the one the user
chose, held for the whole run so that two runs on one machine are kept apart."""

import contextlib
import fcntl
import socket
import tempfile
from pathlib import Path
from typing import IO


class PortTaken(Exception):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def check_no_listener(port: int) -> None:
    """Raise `PortTaken` if something listens on `port` (another run's JAX
    coordinator, any server). SO_REUSEADDR: a port left only in TIME_WAIT by an
    earlier run is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise PortTaken(f"port {port} is in use ({e.strerror})") from None


def hold_port(port: int) -> IO[bytes]:
    """Lock `port` for this run (released when the lock file is closed or the
    launcher exits, however it exits); `PortTaken` if another launcher holds it or
    something listens on it. The coordinator only binds the port once process 0 has
    started JAX, seconds later: the lock keeps a second launcher out in between."""
    path = Path(tempfile.gettempdir()) / f"eqxdist-launch-port-{port}.lock"
    lock = open(path, "ab")  # noqa: SIM115 (held for the whole run)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise PortTaken(
            f"port {port} is used by another eqxdist.launch run on this machine "
            f"(it holds {path})"
        ) from None
    try:
        check_no_listener(port)
    except PortTaken:
        lock.close()
        raise
    return lock


def hold_free_port() -> tuple[int, IO[bytes]]:
    for _ in range(20):
        port = free_port()
        with contextlib.suppress(PortTaken):
            return port, hold_port(port)
    raise RuntimeError("eqxdist.launch: found no free port on 127.0.0.1.")


def hold(port: int | None) -> tuple[int, IO[bytes]]:
    """The port `--port` asks for (`None`: a free one) and its lock."""
    if port is None:
        return hold_free_port()
    return port, hold_port(port)
