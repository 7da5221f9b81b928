"""Test set-up: 8 simulated CPU devices, created before JAX starts its backend."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest
from compile_speed import FOUND, TRAINING, script_flags, with_compile_flags

import eqxdist as ed

# Before JAX initialises its CPU backend (the first array or `jax.devices()`):
# flags that make XLA compile faster without changing what a program computes
# (`compile_speed.py` says which, why, and what they change in compiled figures).
os.environ["XLA_FLAGS"] = with_compile_flags(os.environ.get("XLA_FLAGS", ""))
ed.simulate_cpu_devices(8)
jax.devices()  # the backend starts with these flags
# The processes a test starts with this process's environment (the launcher's)
# keep LLVM level 0 only, as before the fusion flag: one multi-process Ctrl-C
# test (`test_ctrl_c_stops_train_loop_on_2_processes_at_one_saved_step`) failed
# once in three suite runs with the launcher's processes under it (process 1's
# save lost its coordination service as process 0 exited), and never without.
if "--xla_cpu_use_fusion_emitters" not in FOUND:
    os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"].replace(
        " --xla_cpu_use_fusion_emitters=false", ""
    )
jax.config.update("jax_enable_x64", False)

# A persistent compilation cache of this process's own (each pytest-xdist worker
# is a process, so no two writers share a directory: JAX writes entries without
# a lock). Many tests compile programs another test already compiled (the same
# single-device reference, the same small step under another parametrisation);
# a hit skips XLA's compilation, about 17% of the in-process tests' time. The
# executables it returns answer `cost_analysis`/`memory_analysis` as freshly
# compiled ones do. Removed when the process exits.
_CACHE = tempfile.mkdtemp(prefix="eqxdist-tests-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def mesh8() -> jax.sharding.Mesh:
    assert len(jax.devices()) == 8, "tests expect 8 simulated CPU devices"
    return ed.create_data_parallel_mesh()


@pytest.fixture(scope="session")
def mesh1() -> jax.sharding.Mesh:
    return ed.create_data_parallel_mesh(1)


@pytest.fixture(params=["auto", "explicit"])
def axis_types(request: pytest.FixtureRequest) -> str:
    """The kind of axes a test's meshes have: eqxdist's builders' default
    (`Auto`) and what `jax.make_mesh` builds by default (`Explicit`); every
    function that takes a mesh gives the same results on both."""
    kind: str = request.param
    return kind


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def cached_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """This process's environment plus one JAX persistent compilation cache for
    the session, for subprocesses that run one at a time and compile the same
    programs again and again (a resume test runs a script up to four times, about
    20 s of each transformer run; each consumed-state scenario builds the same
    steps): the second and later runs load the compiled programs instead of
    compiling them. Never for processes that run at once (a multi-process job):
    JAX writes an entry without a lock, so one could read another's half-written
    entry. Each pytest-xdist worker has its own session, so its own cache."""
    env = dict(os.environ)
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax-cache"))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


@pytest.fixture(scope="session")
def script_env(cached_env: dict[str, str]) -> dict[str, str]:
    """The environment of an example script run as a subprocess, as a user runs
    it: without this process's device count in `XLA_FLAGS` (each script sets up
    its own simulated devices) but with the tests' compile flags
    (`compile_speed.COMPILING`), with the session's compilation cache
    (`cached_env`)."""
    return {**cached_env, "XLA_FLAGS": script_flags()}


@pytest.fixture(scope="session")
def training_script_env(cached_env: dict[str, str]) -> dict[str, str]:
    """`script_env` for a script that computes more than it compiles (the main
    job's epochs): XLA's default flags (`compile_speed.TRAINING`)."""
    return {**cached_env, "XLA_FLAGS": script_flags(TRAINING)}


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (the default, `addopts`): one pytest-xdist worker per core,
    as many as the memory holds at about 5 GiB each (a worker's 8 simulated
    devices and its compiled programs peak near 4 GiB). Most tests spend their
    time compiling on one thread, so a machine with more cores runs more at
    once; on a 2-core machine, two."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cores, memory // (5 * 2**30)))
