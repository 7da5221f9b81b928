"""The one home of JAX internals: each is found lazily, and a missing one is an
error naming the JAX version when used, never when eqxdist is imported."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxdist as ed
from eqxdist import _jax


def test_no_jax_internals_outside_the_one_module():
    root = pathlib.Path(ed.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "_jax.py"
        and re.search(r"jax\._src|from jax import _src", path.read_text())
    ]
    assert offenders == []


def test_internals_answer():
    assert _jax.backends_are_initialized() in (True, False)
    assert _jax.distributed_client() is None  # a plain single process
    assert all(hasattr(env, "is_env_present") for env in _jax.cluster_types())


def test_missing_internal_names_the_jax_version():
    with pytest.raises(_jax.MissingInternalError, match=re.escape(jax.__version__)):
        _jax._internal("jax._src.no_such_module", "anything")
    with pytest.raises(_jax.MissingInternalError, match="no_such_name"):
        _jax._internal("jax._src.lax.parallel", "no_such_name")


def test_all_gather_invariant_gathers(mesh8):
    x = jnp.arange(8.0)

    def per_device(shard):
        return _jax.all_gather_invariant(shard, "data", tiled=True)

    out = jax.shard_map(per_device, mesh=mesh8, in_specs=P("data"), out_specs=P())(x)
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.0))


def test_shard_map_manual_axes_of_a_traced_shard_map():
    mesh = ed.create_device_mesh({"data": 4, "model": 2})

    def f(x):
        body = jax.shard_map(
            lambda s: s * 2,
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
            axis_names={"data"},
        )
        return body(x)

    (eqn,) = jax.make_jaxpr(f)(jnp.ones((8, 2))).jaxpr.eqns
    assert _jax.shard_map_manual_axes(eqn.params) == {"data"}
    with pytest.raises(_jax.MissingInternalError, match=re.escape(jax.__version__)):
        _jax.shard_map_manual_axes({"mesh": mesh, "jaxpr": None})
