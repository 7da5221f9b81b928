"""The grouped matrix products of the experts: the tiled computation (each
group padded to whole tiles) against `jax.lax.ragged_dot`, values and gradients
(float32, 1e-5), on uneven groups, empty ones, all rows in one group and rows
past the groups (another device's, zeros)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdist._experts.grouped import grouped_matmul
from eqxdist._experts.tiles import tiled_matmul

TOL = {"rtol": 1e-5, "atol": 1e-5}
SIZES = [
    ([3, 0, 7, 0, 1, 5], 16),  # uneven, empty groups
    ([0, 0, 20, 0], 20),  # all rows in one group
    ([0, 4, 2], 11),  # five rows past the groups
    ([0, 0], 3),  # no row in any group
]


def _operands(sizes, rows, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(len(sizes), 5, 3)), jnp.float32)
    c = jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), c


def _value_and_grads(matmul, x, w, c):
    # A fixed random weighting of the outputs: a loss no symmetry can fake.
    f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(matmul(x, w) * c), (0, 1)))
    return matmul(x, w), f(x, w)


@pytest.mark.parametrize(("sizes", "rows"), SIZES)
@pytest.mark.parametrize("tile", [None, 1, 2, 4])
def test_tiles_equal_ragged_dot(sizes, rows, tile):
    x, w, s, c = _operands(sizes, rows)
    if tile is None:  # the tile grouped_matmul chooses
        tiled = lambda x, w: grouped_matmul(x, w, s, method="tiled")  # noqa: E731
    else:
        tiled = lambda x, w: tiled_matmul(x, w, s, tile=tile)  # noqa: E731
    ragged = lambda x, w: grouped_matmul(x, w, s, method="ragged_dot")  # noqa: E731
    got, want = _value_and_grads(tiled, x, w, c), _value_and_grads(ragged, x, w, c)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
    np.testing.assert_array_equal(got[0][sum(sizes) :], 0.0)


def test_auto_takes_tiles_on_cpu_and_equals_ragged_dot():
    x, w, s, _ = _operands(*SIZES[0])
    assert jax.default_backend() == "cpu"
    assert "ragged_dot" in str(jax.make_jaxpr(jax.lax.ragged_dot)(x, w, s))
    assert "ragged_dot" not in str(jax.make_jaxpr(grouped_matmul)(x, w, s))
    np.testing.assert_allclose(
        grouped_matmul(x, w, s), jax.lax.ragged_dot(x, w, s), **TOL
    )


def test_an_unknown_method_is_refused():
    x, w, s, _ = _operands(*SIZES[0])
    with pytest.raises(ValueError, match=r"grouped_matmul: method='megablox'"):
        grouped_matmul(x, w, s, method="megablox")
