"""Expert parallelism across processes: 2 processes x 4 devices train the MoE
model as one device does in plain Equinox and Optax (float32, 1e-5)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import ADAMW, MP_SCRIPTS, MoENet, batches, launch, moe_loss


def _one_device() -> MoENet:
    """`harness.train_experts`'s 2 steps on one device: the device view's loss,
    each of the 8 devices' losses on its 4 rows, averaged."""
    params, static = eqx.partition(MoENet(jax.random.key(0)), eqx.is_inexact_array)
    state = ADAMW.init(params)

    def loss(params, batch):
        model = eqx.combine(params, static)
        parts = [
            moe_loss(model, {k: v[d * 4 : (d + 1) * 4] for k, v in batch.items()}, None)
            for d in range(8)
        ]
        return jnp.mean(jnp.stack([p[0] for p in parts]))

    for batch in batches(steps=2, rows=32, features=6, seed=11):
        grads = jax.grad(loss)(params, batch)
        updates, state = ADAMW.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return eqx.combine(params, static)


@pytest.mark.slow
def test_experts_across_two_processes_equal_one(tmp_path):
    """The data axis of `{"data": 8}` spans 2 processes x 4 devices, the experts
    split over it (FSDP for the rest), each process passing its own rows: the
    final parameters are one device's on the same global batches."""
    result = launch(MP_SCRIPTS / "experts.py", tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    saved = np.load(tmp_path / "experts.npz")
    leaves = jax.tree_util.tree_flatten_with_path(
        eqx.filter(_one_device(), eqx.is_array)
    )[0]
    assert len(saved.files) == len(leaves)
    for path, leaf in leaves:
        np.testing.assert_allclose(
            saved[jax.tree_util.keystr(path)], np.asarray(leaf), rtol=0, atol=1e-5
        )
