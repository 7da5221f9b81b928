"""Training: per-device randomness, train state, gradient accumulation, steps."""

import jax
from jaxtyping import Array, PRNGKeyArray

from ._utils import AxisName, check_axis_bound, typecheck


@typecheck
def fold_rng_over_axis(key: PRNGKeyArray, axis_name: AxisName) -> Array:
    """A different key on each device along `axis_name`, inside `jax.shard_map`.

    Folds the device's index along `axis_name` into `key`, so that e.g. dropout
    masks differ between the devices that hold different parts of a batch, while
    devices that differ only along other axes (say, a model axis) agree.

    **Arguments:**

    - `key`: a PRNG key (typed `jax.random.key` or raw `uint32[2]`), the same on
      every device.
    - `axis_name`: the mesh axis (or axes) to vary over.

    !!! Example

        ```python
        def loss_fn(model, batch, key):
            key = ed.fold_rng_over_axis(key, "data")  # per-device dropout key
            ...
        ```
    """
    names = check_axis_bound(axis_name, "fold_rng_over_axis")
    return jax.random.fold_in(key, jax.lax.axis_index(names))
