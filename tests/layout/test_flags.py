"""The opt-in GPU collective-overlap flags: a flag string, and no change on CPU."""

import os

import jax

import eqxdist as ed


def test_gpu_xla_flags_names_the_overlap_flags():
    flags = ed.gpu_xla_flags().split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert "--xla_gpu_enable_pipelined_all_gather=true" in flags
    assert "--xla_gpu_enable_pipelined_reduce_scatter=true" in flags
    assert all(f.startswith("--xla_gpu_") for f in flags)


def test_enable_gpu_collective_overlap_changes_nothing_on_cpu():
    assert jax.devices()[0].platform == "cpu"
    before = os.environ.get("XLA_FLAGS")
    assert ed.enable_gpu_collective_overlap() is False
    assert os.environ.get("XLA_FLAGS") == before
