"""What a step's `jax.shard_map` takes (`StepInputs`), shared by the train and
evaluation steps: the model split into trained and frozen arrays, its model state
and the batch, each split from what is not an array, with the specs they enter
the map with; and the model state as it leaves the map (`sync_model_state`)."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from .._layout.layout import Layout
from .._layout.partitioned import KeyPath, partitioned as partitioned_layers
from .._layout.pipeline import Seen
from .._layout.plan import ModelPlan
from .._layout.remat import UNSET
from .._layout.stack_options import with_stack_options
from .._utils import is_array


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The arrays a step's `shard_map` takes and what to put back inside: the
    trained and frozen arrays of the model and its static part, the model
    state's arrays and static part, the batch's; the model's plan; the mesh the
    step computes on."""

    layout: Layout
    plan: ModelPlan
    trained: Any
    frozen: Any
    static: Any
    state_arrays: Any
    state_static: Any
    batch_arrays: Any
    batch_static: Any
    with_state: bool
    stack: tuple[Any, Any] = (UNSET, None)

    @classmethod
    def split(
        cls,
        layout: Layout,
        model: Any,
        mask: Any,
        model_state: Any,
        batch: Any,
        *,
        stack: tuple[Any, Any] = (UNSET, None),
    ) -> "StepInputs":
        """`mask` chooses the trained leaves of `model` (the others are frozen);
        `stack`: the `remat` and `unroll` the step sets on every `Stacked`
        (`make_train_step`'s; `UNSET`, `None`: none)."""
        arrays, static = eqx.partition(model, is_array)
        trained, frozen = eqx.partition(arrays, mask)
        state_arrays, state_static = eqx.partition(model_state, is_array)
        batch_arrays, batch_static = eqx.partition(batch, is_array)
        return cls(
            layout,
            layout.plan(model),
            trained,
            frozen,
            static,
            state_arrays,
            state_static,
            batch_arrays,
            batch_static,
            model_state is not None,
            stack,
        )

    @property
    def mesh(self) -> Mesh:
        """The mesh the step computes on (`Layout.compute_mesh`)."""
        return self.layout.compute_mesh(self.with_state)

    def model(
        self,
        trained: Any,
        frozen: Any,
        partitioned: frozenset[KeyPath] = frozenset(),
        *,
        view: str = "device",
        marker: Seen | None = None,
        pipelined: bool = True,
        reads_layers: bool = False,
    ) -> Any:
        """The model as the loss sees it, from its (gathered) array parts: the
        `partitioned` layers (`_layout.partitioned`) computing on their weights'
        shards, its `Stacked` blocks with the step's `remat` and `unroll` and
        as the layout runs them (a pipeline: `Layout.for_loss`)."""
        model = eqx.combine(trained, frozen, self.static)
        axis = self.plan.fsdp_axis
        if axis is not None:
            model = partitioned_layers(model, partitioned, axis)
        remat, unroll = self.stack
        model = with_stack_options(model, remat, unroll, "make_train_step")
        return self.layout.loss_view(
            model,
            stages=self.plan.stages,
            view=view,
            remat=remat,
            marker=marker,
            pipelined=pipelined,
            reads_layers=reads_layers,
        )

    def model_state(self, state_arrays: Any) -> Any:
        return eqx.combine(state_arrays, self.state_static)

    def batch(self, batch_arrays: Any) -> Any:
        return eqx.combine(batch_arrays, self.batch_static)

    def shard_map(
        self,
        per_device: Callable[..., Any],
        extra: Any,
        extra_specs: Any,
        out_specs: Any,
    ) -> Any:
        """`per_device(trained, frozen, state_arrays, batch_arrays, extra)` on every
        device's rows, manual over the data axes only (tensor-parallel rule axes
        are left to XLA).

        `check_vma=False`: gradients of replicated parameters stay per-device and
        are averaged explicitly (`ModelPlan.sum_gradients`), as in a hand-written
        step, and the compiled step carries no replication checks."""
        manual = self.plan.manual
        batch_specs = self.layout.batch_specs(self.batch_arrays)
        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(manual, manual, P(), batch_specs, extra_specs),
            out_specs=out_specs,
            axis_names=frozenset(self.layout.manual_axes),
            check_vma=False,
        )(
            self.plan.in_stage_order(self.trained),
            self.plan.in_stage_order(self.frozen),
            self.state_arrays,
            self.batch_arrays,
            extra,
        )


def _first_device(x: Any, axes: tuple[str, ...]) -> Any:
    """`x` as the first device along `axes` holds it, on every device (exact for
    any dtype: every other device adds zeros)."""
    first = jax.lax.axis_index(axes) == 0
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _first_device(jax.random.key_data(x), axes)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if x.dtype == jnp.bool_:
        return jax.lax.psum(jnp.where(first, x, False).astype(jnp.int32), axes) > 0
    return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axes)


def sync_model_state(model_state: Any, axes: tuple[str, ...]) -> Any:
    """Inside `shard_map`: floating-point leaves averaged over `axes` (a no-op for
    statistics the model already synchronises), every other array leaf taken from
    the first device."""

    def sync(x: Any) -> Any:
        if not is_array(x):
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.pmean(x, axes)
        return _first_device(x, axes)

    return jax.tree.map(sync, model_state)
