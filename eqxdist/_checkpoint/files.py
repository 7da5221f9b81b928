"""The on-disk format of eqxdist checkpoints, shared by `save_checkpoint`,
`restore_checkpoint`, `latest_step` and `CheckpointManager`.

Layout: `directory/<step>/` is one step as Orbax's `CheckpointManager` writes it
(`default/` holds the array leaves, each process writing only the shards it holds)
plus `eqxdist_checkpoint.json`, which names every leaf by its pytree path with its
shape and dtype and records the size and SHA-256 of every file under `default/`.

Orbax writes a step into a temporary directory and renames it to `<step>` once
every process has finished (its atomic commit). eqxdist gives each save its own
temporary directory (Orbax's default name depends on the step alone, so two saves
of one step would write into the same one and mix) and writes
`eqxdist_checkpoint.json` into it just before that rename: the marker is part of the
commit, not a second step after it. A `<step>` directory without it is therefore
never one of our complete saves (a v0.1 save killed before its marker, or something
that is not ours) and is ignored.
"""

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MARKER = "eqxdist_checkpoint.json"
FORMAT = "eqxdist-checkpoint"
# 1: v0.1 (arrays directly in <step>/, marker written after Orbax's commit, no
# checksums); 2: Orbax CheckpointManager layout (<step>/default/), checksums;
# 3: the user's `metadata` and a SHA-256 of the marker itself (`marker_sha256`),
# so that damage to the marker that leaves valid JSON is detected too.
VERSION = 3
ITEM = "default"  # the directory Orbax's CheckpointManager gives a single item
# Orbax names its temporary directories `<final name><TMP_SUFFIX>...`.
TMP_SUFFIX = ".orbax-checkpoint-tmp"
# A step directory's name: ASCII decimal without leading zeros (`str(step)`), so
# that "007" or "٣" (a non-ASCII digit `int` accepts) is never taken for a step.
_STEP_NAME = re.compile(r"(?:0|[1-9][0-9]*)\Z", re.ASCII)
# Our temporary directories: `<step>.orbax-checkpoint-tmp-<host>-<pid>-<random>`,
# naming the process (process 0 of the run) that saves, so that a later manager can
# tell the leftover of a dead save from a save still running.
_OUR_TMP = re.compile(
    r"(?:0|[1-9][0-9]*)" + re.escape(TMP_SUFFIX) + r"-(?P<host>[A-Za-z0-9_.]+)-"
    r"(?P<pid>[0-9]+)-[0-9a-f]+\Z",
    re.ASCII,
)
_CHUNK = 1 << 22


class DirectoryLock:
    """An exclusive `flock` on the checkpoint directory itself, held by process 0
    of a run from its check that a step is not yet saved until that save commits or
    fails.

    Orbax's `CheckpointManager.save` removes an existing step directory before
    writing (it always passes `force=True` to its checkpointer), so a step that
    another run commits between our check and Orbax's start would be deleted and
    replaced, and both saves would report success. Holding this lock makes the
    check and the commit one step for every saver on this filesystem: the later
    save waits, then finds the step saved and gets the ordinary "already saved"
    error. The kernel drops the lock when its holder dies, so a killed save never
    blocks the next one. On a filesystem without `flock` (`OSError` on locking) the
    lock is not taken and the atomic rename is the only guard (see `writer.py`).
    Released once, from whichever thread finishes the save."""

    def __init__(self, root: Path) -> None:
        self._fd: int | None = None
        self._mutex = threading.Lock()
        fd = os.open(root, os.O_RDONLY)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            os.close(fd)
            return
        self._fd = fd

    def release(self) -> None:
        with self._mutex:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops its flock


def host_name() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def temporary_name(step: int, token: str) -> str:
    return f"{step}{TMP_SUFFIX}-{token}"


def check_root(root: Path, caller: str) -> None:
    """A clear error for a `directory` that exists but is not a directory."""
    if root.exists() and not root.is_dir():
        raise ValueError(
            f"{caller}: `directory` {str(root)!r} is a file, not a directory; pass "
            "the checkpoint directory."
        )


def step_of(entry: Path) -> int | None:
    """The step `entry` holds if it is a complete checkpoint of ours, else `None`:
    a real directory (not a symlink) named as `str(step)` with our marker."""
    if not _STEP_NAME.match(entry.name) or entry.is_symlink():
        return None
    if not entry.is_dir() or not (entry / MARKER).is_file():
        return None
    return int(entry.name)


def complete_steps(root: Path) -> list[int]:
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(s for s in map(step_of, entries) if s is not None)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _digests(paths: list[Path]) -> list[str]:
    # hashlib releases the GIL on large buffers: threads hash files in parallel.
    workers = max(1, min(8, os.cpu_count() or 1, len(paths)))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(_file_digest, paths))


def checksums(item: Path) -> dict[str, list[Any]]:
    """`{relative path: [size, sha256]}` of every file under `item`."""
    paths = sorted(
        Path(folder) / name for folder, _, names in os.walk(item) for name in names
    )
    return {
        path.relative_to(item).as_posix(): [path.stat().st_size, digest]
        for path, digest in zip(paths, _digests(paths), strict=True)
    }


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def canonical_json(value: Any) -> str:
    """The one JSON text of `value` that digests are taken of."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _marker_digest(marker: dict[str, Any]) -> str:
    body = {k: v for k, v in marker.items() if k != "marker_sha256"}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def write_marker(step_dir: Path, metadata: dict[str, Any]) -> None:
    """Record the checksums of `step_dir/default` and write the marker (durably)."""
    metadata = dict(metadata, checksums=checksums(step_dir / ITEM))
    metadata["marker_sha256"] = _marker_digest(metadata)
    with open(step_dir / MARKER, "w") as f:
        json.dump(metadata, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(step_dir)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_shape(x: Any) -> bool:
    return isinstance(x, list) and all(map(_is_count, x))


_SHA256 = re.compile(r"[0-9a-f]{64}\Z", re.ASCII)


def _leaf_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return f"a leaf is described by {entry!r}, not a mapping"
    if not isinstance(entry.get("path"), str):
        return f"a leaf has no path: {entry!r}"
    if not _is_shape(entry.get("shape")) or not isinstance(entry.get("dtype"), str):
        return f"leaf {entry['path']} has no valid shape and dtype"
    if "prng_impl" in entry and not (
        isinstance(entry["prng_impl"], str) and _is_shape(entry.get("key_data_shape"))
    ):
        return f"leaf {entry['path']} has no valid PRNG key description"
    return None


def _marker_problem(marker: Any) -> str | None:
    """What is wrong with a parsed marker, or `None`."""
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        return "not an eqxdist checkpoint description"
    version = marker.get("version", 1)
    if version not in range(1, VERSION + 1) or isinstance(version, bool):
        return f"unknown format version {version!r}"
    if not isinstance(marker.get("leaves"), list):
        return "it lists no leaves"
    for entry in marker["leaves"]:
        if (problem := _leaf_problem(entry)) is not None:
            return problem
    if version == 1:
        return None
    recorded = marker.get("checksums")
    if not isinstance(recorded, dict) or not all(
        isinstance(v, list)
        and len(v) == 2
        and _is_count(v[0])
        and isinstance(v[1], str)
        and _SHA256.match(v[1])
        for v in recorded.values()
    ):
        return "the checksums of its files are missing or damaged"
    if version >= 3:
        if marker.get("marker_sha256") != _marker_digest(marker):
            return "its contents do not match their SHA-256 (it was changed)"
        if not isinstance(marker.get("metadata"), dict):
            return "its metadata is missing"
    return None


def read_marker(location: Path, step: int, caller: str) -> dict[str, Any]:
    """The marker of `location`, checked; a `ValueError` naming the step if it
    cannot be read or is not a whole, unchanged eqxdist marker."""
    try:
        marker = json.loads((location / MARKER).read_text())
        problem = _marker_problem(marker)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        problem = str(e)
    if problem is not None:
        raise ValueError(
            f"{caller}: checkpoint step {step} in {str(location.parent)!r} is "
            f"corrupted: its file {MARKER} cannot be read ({problem})."
        )
    return marker  # type: ignore[no-any-return]


def item_directory(location: Path, metadata: dict[str, Any]) -> Path:
    return location if metadata.get("version", 1) == 1 else location / ITEM


def verify(location: Path, metadata: dict[str, Any], step: int, caller: str) -> None:
    """Raise a `ValueError` naming the step and the file if a file recorded at save
    is missing, has another size, or other bytes."""
    if metadata.get("version", 1) == 1:
        return  # no checksums were recorded (`read_marker` requires them later)
    recorded = metadata["checksums"]
    item = item_directory(location, metadata)
    problems: dict[str, str] = {}
    for name, (size, _) in recorded.items():
        path = item / name
        if not path.is_file():
            problems[name] = "is missing"
        elif path.stat().st_size != size:
            problems[name] = (
                f"has {path.stat().st_size} bytes instead of {size} (truncated?)"
            )
    if not problems:
        names = list(recorded)
        for name, digest in zip(
            names, _digests([item / n for n in names]), strict=True
        ):
            if digest != recorded[name][1]:
                problems[name] = (
                    "does not have the bytes it had when saved (SHA-256 differs)"
                )
    if problems:
        name, problem = next(iter(problems.items()))
        more = f" (and {len(problems) - 1} more files)" if len(problems) > 1 else ""
        raise ValueError(
            f"{caller}: checkpoint step {step} in {str(location.parent)!r} is "
            f"corrupted: file {str(Path(ITEM) / name)!r} {problem}{more}. Restore "
            "another step (`step=`) or save again."
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# A temporary directory of another host's save that nothing has written to for this
# long is taken for the leftover of a dead save (its process cannot be asked).
STALE_SECONDS = 3600


def _untouched_for(path: Path) -> float:
    newest = path.stat().st_mtime
    for folder, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                newest = max(newest, (Path(folder) / name).stat().st_mtime)
    return time.time() - newest


def leftovers(root: Path) -> list[Path]:
    """Temporary directories of saves that can no longer finish: Orbax's own
    (`<step>.orbax-checkpoint-tmp`, no owner), ours whose saving process on this
    host is gone, and ours from other hosts untouched for `STALE_SECONDS`. Those of
    live saves are kept."""
    found = []
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    this_host = host_name()
    for entry in entries:
        if TMP_SUFFIX not in entry.name or entry.is_symlink():
            continue
        ours = _OUR_TMP.match(entry.name)
        if ours is None:
            if entry.name.endswith(TMP_SUFFIX):
                found.append(entry)
        elif ours["host"] == this_host:
            if not _pid_alive(int(ours["pid"])):
                found.append(entry)
        elif _untouched_for(entry) > STALE_SECONDS:
            found.append(entry)
    return found


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def is_collision(error: BaseException) -> bool:
    """An `OSError` from renaming onto a step directory another save committed
    (etils' rename checks first and raises `FileExistsError` without an errno)."""
    if isinstance(error, FileExistsError):
        return True
    return isinstance(error, OSError) and error.errno in (errno.ENOTEMPTY, errno.EEXIST)


def check_user_metadata(value: Any, caller: str) -> dict[str, Any]:
    """A copy of `value` as JSON gives it back, or a clear error if it is not a
    dict that JSON represents exactly (string keys; lists, not tuples; finite
    floats; Python numbers, not NumPy's)."""
    if not isinstance(value, dict):
        raise TypeError(
            f"{caller}: `metadata` must be a dict; got {type(value).__name__}."
        )
    try:
        copy = json.loads(canonical_json(value))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{caller}: `metadata` must be JSON-serialisable (str keys; str, int, "
            f"float, bool, None, lists and dicts as values); {e}."
        ) from None
    if copy != value or canonical_json(copy) != canonical_json(value):
        raise ValueError(
            f"{caller}: `metadata` {value!r} does not come back the same from JSON "
            "(tuples become lists, non-str keys become strings); use lists and str "
            "keys."
        )
    return copy  # type: ignore[no-any-return]


def user_metadata(location: Path, step: int, caller: str) -> dict[str, Any]:
    """The `metadata` saved with the checkpoint at `location` (`{}` if none was)."""
    marker = read_marker(location, step, caller)
    saved: dict[str, Any] = marker.get("metadata", {})
    return saved
