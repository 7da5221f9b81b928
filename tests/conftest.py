"""Test set-up: 8 simulated CPU devices, created before JAX starts its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

import eqxdist as ed

# Before JAX initialises its CPU backend (the first array or `jax.devices()`).
ed.simulate_cpu_devices(8)
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
