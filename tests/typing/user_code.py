"""Typical user code, type-checked in CI (`mypy --strict tests/typing/`).

It is never run: it proves that a user's type checker understands eqxdist's API.
Each deliberate misuse carries a `# type: ignore[code]`; CI runs mypy with
`--warn-unused-ignores`, so if our annotations stopped catching a misuse, the ignore
would become unused and CI would fail.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

import eqxdist as ed


def build_mesh() -> Mesh:
    mesh = ed.create_device_mesh({"data": -1, "model": 2})
    info: dict[str, Any] = ed.get_mesh_info(mesh)
    assert info["total_devices"] == 8
    manager = ed.compat.DeviceMeshManager()
    return manager.create_data_parallel_mesh(manager.num_devices)


def place(mesh: Mesh, inputs: np.ndarray) -> Any:
    sharding: NamedSharding = ed.create_data_parallel_sharding(mesh)
    return ed.shard_batch({"inputs": inputs}, sharding)


def per_device(x: jax.Array, key: jax.Array) -> dict[str, Any]:
    key = ed.fold_rng_over_axis(key, "data")
    noise = jax.random.normal(key, x.shape)
    metrics = {"loss": jnp.mean((x + noise) ** 2), "n": x.shape[0]}
    reduced = ed.reduce_custom(metrics, {"n": "sum"})
    averaged: dict[str, Any] = ed.compat.DistributedMetrics().reduce_mean(reduced)
    return averaged


def misuse(mesh: Mesh) -> None:
    ed.create_data_parallel_mesh("8")  # type: ignore[arg-type]
    ed.create_data_parallel_sharding(mesh, data_axis=0)  # type: ignore[arg-type]
    ed.shard_batch({"x": np.ones(8)}, mesh)  # type: ignore[arg-type]
    ed.reduce_mean({"loss": jnp.ones(())}, axis_name=1)  # type: ignore[arg-type]
