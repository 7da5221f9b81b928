"""The XLA flags the tests compile with: every test process (`conftest.py`) and the
scripts a test starts (`conftest.script_env`, `stated_output.readers_env`); the
launcher's processes inherit LLVM level 0 only (`conftest.py` says why). The
tests' programs are small and most are compiled once or twice, so compiling is
most of the suite's time. Neither flag changes what a program computes.

- `--xla_cpu_use_fusion_emitters=false`: XLA:CPU's older emitters for fusions.
  They compile in about 60% of the time (the 21 steps of
  `benchmarks/dump_programs.py`: 31.6 s against 52.6 s of compilation; 19.2 s
  against 41.4 s at LLVM level 0), but some programs run slower (the main job's
  test, `train_classifier.py`'s four strategies for two epochs: 257 s with these
  flags, 99 s with XLA's defaults). XLA fuses a few ops otherwise: a compiled step's
  FLOPs move by a few in 10^5 (the experts' steps by 0.4%), its temporaries by
  about a hundred bytes, values by float rounding (within the tests'
  tolerances). The tests' bounds on compiled FLOPs and memory hold under both
  emitters; figures a page of the docs states exactly are compiled with XLA's
  defaults (`xla_default_fusion`), as the benchmarks' are (they set no flags).
- `--xla_backend_optimization_level=0` (LLVM at level 0) compiles about 20%
  faster again and changes no HLO pass (the optimised HLO, its FLOPs and
  temporaries are identical), but its code runs slower.

Scripts that compute more than they compile (the main job's epochs) run with
XLA's defaults (`TRAINING`, no flags).

A flag already in `XLA_FLAGS` is not replaced: set one yourself to run the tests
under another value."""

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping

from jax._src import compiler

FUSION = {"--xla_cpu_use_fusion_emitters": "false"}
COMPILING = {"--xla_backend_optimization_level": "0", **FUSION}
TRAINING: dict[str, str] = {}


def with_compile_flags(flags: str, wanted: Mapping[str, str] = COMPILING) -> str:
    """`flags` (an `XLA_FLAGS` value) plus each flag of `wanted` it lacks."""
    added = [f"{name}={value}" for name, value in wanted.items() if name not in flags]
    return " ".join([flags, *added]).strip()


# `XLA_FLAGS` as the tests found it, before `conftest.py` adds to it.
FOUND = os.environ.get("XLA_FLAGS", "")


def script_flags(wanted: Mapping[str, str] = COMPILING) -> str:
    """The `XLA_FLAGS` of a script a test starts as a user runs it: the flags the
    tests found (`FOUND`) without a device count (each script sets up its own
    simulated devices), plus each flag of `wanted` they lack."""
    kept = [
        f
        for f in FOUND.split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    return with_compile_flags(" ".join(kept), wanted)


@contextlib.contextmanager
def xla_default_fusion() -> Iterator[None]:
    """Programs compiled inside compile with XLA's default fusion emitters (a
    compile option, over `XLA_FLAGS`): for figures stated exactly as a user
    compiles them."""
    original = compiler.get_compile_options

    @functools.wraps(original)
    def with_default_fusion(*args, env_options_overrides=None, **kwargs):
        overrides = {"xla_cpu_use_fusion_emitters": True}
        overrides.update(env_options_overrides or {})
        return original(*args, env_options_overrides=overrides, **kwargs)

    compiler.get_compile_options = with_default_fusion
    try:
        yield
    finally:
        compiler.get_compile_options = original
