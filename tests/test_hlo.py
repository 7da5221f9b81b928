"""count_collectives: collectives per run of a compiled program, loops included."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import eqxdist as ed


def test_counts_ops_in_loops_by_trip_count(mesh8):
    def per_device(x):
        def body(carry, _):
            full = jax.lax.all_gather(carry, "data", tiled=True)
            return carry + full[:1].sum(), None

        x, _ = jax.lax.scan(body, x, None, length=5)
        return jax.lax.psum(x, "data")

    fn = jax.jit(
        jax.shard_map(
            per_device, mesh=mesh8, in_specs=P("data"), out_specs=P(), check_vma=False
        )
    )
    compiled = fn.lower(jnp.ones(8)).compile()
    counts = ed.count_collectives(compiled)
    assert counts["all-gather"] == 5 and counts["all-reduce"] == 1
    assert counts == ed.count_collectives(compiled.as_text())
    assert counts["reduce-scatter"] == 0
