"""Test set-up: 8 simulated CPU devices, created before JAX starts its backend."""

import os

# Must happen before JAX initialises its CPU backend (the first `jax.devices()`).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

import eqxdist as ed

jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session")
def mesh8() -> jax.sharding.Mesh:
    assert len(jax.devices()) == 8, "tests expect 8 simulated CPU devices"
    return ed.create_data_parallel_mesh()


@pytest.fixture(scope="session")
def mesh1() -> jax.sharding.Mesh:
    return ed.create_data_parallel_mesh(1)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
