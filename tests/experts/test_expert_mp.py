"""Expert parallelism across processes: 2 processes x 4 devices train the MoE
model as 1 process x 8 devices does (float32, 1e-5)."""

import equinox as eqx
import jax
import numpy as np
import pytest
from harness import MP_SCRIPTS, launch, train_experts


@pytest.mark.slow
def test_experts_across_two_processes_equal_one(tmp_path):
    """The data axis of `{"data": 8}` spans 2 processes x 4 devices, the experts
    split over it (FSDP for the rest), each process passing its own rows: the
    final parameters are those of 1 process x 8 devices on the same global
    batches."""
    result = launch(MP_SCRIPTS / "experts.py", tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    state = train_experts()  # 1 process x 8 devices, every row
    saved = np.load(tmp_path / "experts.npz")
    leaves = jax.tree_util.tree_flatten_with_path(
        eqx.filter(state.model, eqx.is_array)
    )[0]
    assert len(saved.files) == len(leaves)
    for path, leaf in leaves:
        np.testing.assert_allclose(
            saved[jax.tree_util.keystr(path)], np.asarray(leaf), rtol=0, atol=1e-5
        )
