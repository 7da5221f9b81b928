"""The small pieces `train_loop` is made of, each usable alone in a hand-written
loop: a progress display, a watchdog, the learning rate of an optimizer state, a
persistent compilation cache, and scalar values of a step's metrics."""

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from .._metrics import Metric
from .._utils import Closing, typecheck


class Progress:
    """Progress of a run: a `tqdm` bar on a terminal (steps/s, ETA and the values
    last passed to `update`, e.g. the live loss), plain lines otherwise (one per
    `update`, for log files).

    **Arguments:**

    - `total`: the step the run ends at (for the ETA).
    - `initial`: the step it starts from (e.g. when resuming).
    - `name`: a label before the bar or each line.
    - `bar`: `None` chooses `tqdm` when standard output is a terminal and `tqdm`
      is installed (plain lines otherwise); `True` asks for `tqdm` (an
      `ImportError` without it); `False` forces plain lines.
    """

    @typecheck
    def __init__(
        self, total: int, *, initial: int = 0, name: str = "", bar: bool | None = None
    ) -> None:
        self.name = name
        self.step = initial
        self.total = total
        self._bar: Any = None
        wanted = bar
        if bar is None:
            bar = sys.stdout.isatty()
        if bar and jax.process_index() == 0:
            try:
                from tqdm import tqdm
            except ImportError:
                if wanted:  # asked for by name: say so rather than print lines
                    raise ImportError(
                        "Progress(bar=True) needs tqdm: pip install tqdm (or "
                        "eqxdist[examples]); bar=None falls back to plain lines."
                    ) from None
                return
            self._bar = tqdm(
                total=total, initial=initial, desc=name or None, unit="step",
                dynamic_ncols=True, file=sys.stdout,
            )  # fmt: skip

    def advance(self, step: int) -> None:
        """Move the bar to `step` (cheap: call it after every step). It only moves
        forward: an earlier `step` leaves it where it is."""
        if step > self.step:
            if self._bar is not None:
                self._bar.update(step - self.step)
            self.step = step

    def update(self, step: int, values: Mapping[str, float]) -> None:
        """Show `values` (host numbers) as those of `step`: in the bar's postfix,
        or as a plain line `name step S/T  key value ...`. The values of a step
        the bar has passed (a loop that fetches them later) leave the bar where it
        is."""
        self.advance(step)
        text = "  ".join(f"{k} {compact(v)}" for k, v in values.items())
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
        else:
            self.print(f"step {step}/{self.total}  {text}")

    def print(self, line: str) -> None:
        """Print a line above the bar (process 0 only)."""
        if jax.process_index() != 0:
            return
        line = f"{self.name} {line}" if self.name else line
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def compact(value: float) -> str:
    """`value` in few characters, so a bar's postfix fits a terminal line: 4
    significant digits, and from 10,000 up a suffix for thousands, millions,
    ... (`15.64k` for 1.564e+04)."""
    v = float(value)
    if np.isfinite(v) and abs(v) >= 1e4:
        for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
            if abs(v) >= scale:
                return f"{v / scale:.4g}{suffix}"
    return f"{v:.4g}"


class Watchdog(Closing):
    """Ends the process when the run stops making progress: if `beat()` is not
    called for `timeout` seconds, it prints every thread's stack
    (`faulthandler.dump_traceback(all_threads=True)`) to standard error and exits
    with status `exit_code`, so that a hung collective ends the job (and a
    launcher with restarts can restart it) instead of holding the machines until
    the scheduler's limit.

    Call `beat()` whenever a step has completed. With a train step that bounds
    the steps in flight (`make_train_step`'s `max_steps_in_flight`), a step
    returning means an earlier one completed, so beating after each call is
    enough. Leave room for compilation: start the watchdog after the first step.

    **Arguments:**

    - `timeout`: seconds without a beat before the process is ended.
    - `exit_code`: the exit status (non-zero).
    """

    @typecheck
    def __init__(self, timeout: float | int, *, exit_code: int = 1) -> None:
        if not timeout > 0:
            raise ValueError(f"Watchdog: `timeout` must be > 0 seconds; got {timeout}.")
        if exit_code == 0:
            raise ValueError("Watchdog: `exit_code` must be non-zero (a failure).")
        self.timeout = float(timeout)
        self.exit_code = exit_code
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Record progress (a float store: cheap enough for every step)."""
        self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout:
                err = sys.__stderr__ or sys.stderr
                err.write(
                    f"\neqxdist watchdog: no step completed in {idle:.0f} s "
                    f"(timeout {self.timeout:g} s); every thread's stack:\n"
                )
                err.flush()
                faulthandler.dump_traceback(file=err, all_threads=True)
                err.flush()
                os._exit(self.exit_code)

    def close(self) -> None:
        """Stop watching."""
        self._stop.set()
        self._thread.join()


def learning_rate(opt_state: Any) -> Any:
    """The learning rate an optimizer state exposes, or `None`: the
    `"learning_rate"` hyperparameter of the first `optax.inject_hyperparams`
    state found in `opt_state` (e.g. of
    `optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)`), a 0-d array
    that may still be being computed."""
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds)):
        if isinstance(s, kinds) and s.hyperparams.get("learning_rate") is not None:
            return s.hyperparams["learning_rate"]
    return None


def compute(metrics: Any) -> Any:
    """A step's metrics as values (still on the devices: no wait): `Metric`s
    computed, `(sum, count)` pairs divided, mappings mapped."""
    if isinstance(metrics, Metric):
        return metrics.compute()
    if isinstance(metrics, tuple) and len(metrics) == 2:
        return metrics[0] / metrics[1]
    if isinstance(metrics, Mapping):
        return {name: compute(value) for name, value in metrics.items()}
    return metrics


def merge(a: Any, b: Any) -> Any:
    """Metrics of two batches together: `Metric`s merged, `(sum, count)` pairs
    and arrays added, mappings mapped."""
    if isinstance(a, Metric):
        return a.merge(b)
    if isinstance(a, Mapping):
        return {name: merge(value, b[name]) for name, value in a.items()}
    if isinstance(a, tuple):
        return tuple(x + y for x, y in zip(a, b, strict=True))
    return a + b


def scalars(metrics: Any, prefix: str = "") -> dict[str, Any]:
    """The 0-d values of a step's metrics (see `compute`) as a flat `{name: 0-d
    array}`, nested names joined with `/`; values of higher rank (e.g. a
    confusion matrix) are left out."""
    values = compute(metrics)
    if isinstance(values, Mapping):
        out = {}
        for name, value in values.items():
            out.update(scalars(value, f"{prefix}{name}/"))
        return out
    if isinstance(values, jax.Array | np.ndarray | float | int) and not np.ndim(values):
        return {prefix.rstrip("/") or "value": values}
    return {}


@typecheck
def enable_compilation_cache(
    directory: str | os.PathLike[str], *, min_compile_seconds: float = 1.0
) -> None:
    """Keep compiled programs in `directory` (JAX's persistent compilation
    cache), so that a restarted or repeated run skips the compilations it has
    already done. Call it before the first step compiles.

    **Arguments:**

    - `directory`: the cache directory (created if missing; on a cluster, local
      or shared storage every process can write).
    - `min_compile_seconds`: only programs that took at least this long to
      compile are kept.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
