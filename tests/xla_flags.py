"""XLA flags for the test processes and the scripts they start.

The tests compile far more than they run: most programs are a few small steps on
tiny models, compiled once and run once or twice. XLA's CPU backend spends most of
a compilation in LLVM; at `-O0` without its expensive passes it compiles about a
quarter faster (measured: `tests/layout/test_pipeline.py -k every_schedule` 96 s ->
72 s of CPU time, `tests/metrics/test_metrics.py tests/experts/test_moe.py` 153 s
-> 129 s), while the HLO passes, and so every program's collectives, buffers,
memory analysis and values up to rounding, are those of the default build. Each
test compares against a reference compiled in the same process with the same
flags, so its tolerances are unaffected; benchmarks and the examples run as users
run them do not use these flags."""

import os
from collections.abc import Mapping

FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)


def with_fast_compile(flags: str) -> str:
    """`flags` with the fast-compile flags added (once)."""
    return flags if FAST_COMPILE in flags else f"{flags} {FAST_COMPILE}".strip()


def fresh_process_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` for a script that sets up its own simulated devices: without this
    process's device-count flag, with the fast-compile flags."""
    env = {k: v for k, v in environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = FAST_COMPILE
    return env
