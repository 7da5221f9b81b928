"""Small helpers shared by every module: type checking, pytree walking, axis checks."""

import difflib
import functools
import inspect
import re
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeAlias, TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jax.sharding import Mesh
from jaxtyping import jaxtyped

_F = TypeVar("_F", bound=Callable[..., Any])

AxisName: TypeAlias = str | tuple[str, ...]
"""A mesh axis name, or a tuple of names to act over several axes at once."""


def typecheck(fn: _F) -> _F:
    """Check `fn`'s annotations (jaxtyping shapes/dtypes too) with beartype on every
    call. A mismatch raises `jaxtyping.TypeCheckError`, a `TypeError` whose message
    names the parameter, the value seen and the type expected."""
    checked: _F = jaxtyped(typechecker=beartype)(fn)
    return checked


def is_array(x: Any) -> bool:
    """`jax.Array`, `np.ndarray` and NumPy scalars: the leaves our functions act on."""
    return eqx.is_array(x)


def is_array_like(x: Any) -> bool:
    """An array leaf, concrete or abstract (`jax.ShapeDtypeStruct`, e.g. from
    `eqx.filter_eval_shape`): what layouts and restore targets are computed from."""
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def strong_types(tree: Any) -> Any:
    """`tree` with every weakly typed array leaf (e.g. the `jnp.asarray(0.2)` of
    `eqx.nn.PReLU(0.2)`) given a strong type of the same dtype; other leaves
    kept. A step's update makes such leaves strong (`param + update`), so a
    state that kept them weak would compile every step a second time."""

    def weak(x: Any) -> bool:
        return isinstance(x, jax.Array) and jax.typeof(x).weak_type

    if not any(weak(x) for x in jax.tree.leaves(tree)):
        return tree  # the very object: a state's model is the model it was given
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=x.dtype) if weak(x) else x, tree)


def plural(count: int, noun: str) -> str:
    """`"1 device"`, `"8 devices"`: a count and its noun, for messages."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def map_arrays(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply `fn` to every array leaf of `tree`; every other leaf is kept as it is."""
    return jax.tree.map(lambda x: fn(x) if is_array(x) else x, tree)


def path_str(path: tuple[Any, ...]) -> str:
    """A readable pytree path: `['params']['w']`, or `<root>` for the tree itself."""
    return jax.tree_util.keystr(path) or "<root>"


def axis_names(axis_name: AxisName) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def check_axis_bound(
    axis_name: AxisName, caller: str, *, has_global_mode: bool = False
) -> tuple[str, ...]:
    """Raise a `ValueError` telling the user what to do if `axis_name` is not bound.

    A collective (`psum`, `all_gather`, `axis_index`, ...) only means something inside
    `jax.shard_map` (or `vmap` with that `axis_name`); outside it JAX raises a bare
    `NameError`. `has_global_mode`: the caller also accepts `axis_name=None`, so the
    message offers it. Returns the names as a tuple."""
    names = axis_names(axis_name)
    if not names:
        raise ValueError(f"{caller}: `axis_name` is an empty tuple; name a mesh axis.")
    for name in names:
        if not axis_is_bound(name):
            alternative = (
                ", or pass `axis_name=None` to reduce global (sharded) arrays instead"
                if has_global_mode
                else ""
            )
            raise ValueError(
                f"{caller}: mesh axis {name!r} is not bound here. Call it inside "
                f"`jax.shard_map` over a mesh that has an axis {name!r}{alternative}."
            )
    return names


def axis_is_bound(axis_name: str) -> bool:
    """Whether `axis_name` is bound here (inside `shard_map` over it)."""
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def not_in_mesh(axis: Any, mesh: Mesh) -> str:
    """The one way an error says that `axis` is not an axis of `mesh`: the
    mesh's axes, and the close name the user may have meant."""
    names = tuple(mesh.axis_names)
    close = difflib.get_close_matches(str(axis), [str(n) for n in names], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return f"{axis!r} is not an axis of the mesh; the mesh's axes are {names}{hint}"


def check_axis_in_mesh(mesh: Mesh, axis: str, caller: str, argument: str) -> None:
    """Raise a `ValueError` naming `argument`, the mesh's axes and a close name
    if `axis` is not an axis of `mesh`."""
    if axis not in mesh.axis_names:
        raise ValueError(f"{caller}: `{argument}`={not_in_mesh(axis, mesh)}")


def check_mesh(mesh: Any, caller: str, argument: str = "mesh") -> None:
    """A `TypeError` naming the value when `mesh` is not a `jax.sharding.Mesh`,
    with the mesh to build instead."""
    if not isinstance(mesh, Mesh):
        axis = mesh if isinstance(mesh, str) and mesh else "data"
        raise TypeError(
            f"{caller}: `{argument}` must be a jax.sharding.Mesh; got "
            f"{type(mesh).__name__} {mesh!r}. Build one, e.g. "
            f"`ed.create_device_mesh({{{axis!r}: {jax.device_count()}}})` (all "
            "devices on one axis) or `jax.make_mesh(...)`, and name its batch axis "
            "with `data_axis`."
        )


def check_function(form: str) -> Callable[[Any, str, str], None]:
    """A check for `checked_first`: a `TypeError` naming the argument and the
    value when it is not callable; `form` says how it is called."""

    def check(fn: Any, caller: str, argument: str) -> None:
        if not callable(fn):
            raise TypeError(
                f"{caller}: `{argument}` must be a function `{form}`; got "
                f"{type(fn).__name__} {fn!r}."
            )

    return check


def checked_first(
    *whole: Callable[..., None], **checks: Callable[[Any, str, str], None]
) -> Callable[[_F], _F]:
    """Decorate a public function so that its plain checks run first, before the
    annotation check of `typecheck` (or of the test run's jaxtyping hook, which
    adds its checks below every decorator): the commonest mistakes (a string for
    a mesh, a batch where one sequence goes) get a few lines with the fix, not
    beartype's report. Each of `whole` gets the call's arguments as they were
    passed; `checks[name](value, caller, name)` gets one named argument."""

    def decorate(fn: _F) -> _F:
        signature = inspect.signature(fn)
        caller = fn.__qualname__.removesuffix(".__init__")

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            for check in whole:
                check(*args, **kwargs)
            if checks:  # binding costs a signature walk; only when one is named
                try:
                    given = signature.bind(*args, **kwargs).arguments
                except TypeError:  # Python's own error, from the call below
                    given = {}
                for name, check_one in checks.items():
                    if name in given:
                        check_one(given[name], caller, name)
            return fn(*args, **kwargs)

        return cast(_F, checked)

    return decorate


def check_min_weight_size(min_weight_size: Any, caller: str) -> None:
    if isinstance(min_weight_size, bool) or not isinstance(
        min_weight_size, int | np.integer
    ):
        raise TypeError(
            f"{caller}: `min_weight_size` must be an int (a number of elements); got "
            f"{type(min_weight_size).__name__} {min_weight_size!r}."
        )
    if min_weight_size < 0:
        raise ValueError(
            f"{caller}: `min_weight_size` must be >= 0; got {min_weight_size}."
        )


# One array of every state a step donated, by `id` (the weak reference drops the
# entry when the array dies, before its `id` can be reused).
_donated: dict[int, "weakref.ref[Any]"] = {}


def note_donated(array: jax.Array) -> None:
    """Record that `array` (and the state it belongs to) was donated to a step.

    An array whose host copy is still alive (`jax.device_get` on CPU can return a
    view of the device buffer) reports `is_deleted() == False` after donation,
    yet passing it to a compiled function crashes the process; this record is
    what `deleted_leaf` sees instead."""
    key = id(array)
    _donated[key] = weakref.ref(array, lambda _: _donated.pop(key, None))


def was_donated(array: Any) -> bool:
    """`array` was donated: deleted, or recorded by `note_donated`."""
    if not isinstance(array, jax.Array):
        return False
    ref = _donated.get(id(array))
    return (ref is not None and ref() is array) or array.is_deleted()


def deleted_leaf(tree: Any) -> str | None:
    """The path of the first `jax.Array` leaf of `tree` whose buffers were deleted
    (donated to an earlier step), or `None`.

    JAX on CPU crashes the process when a compiled function receives such an array,
    so every entry point that takes a state checks this first."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if was_donated(leaf):
            return path_str(path)
    return None


def check_not_consumed(tree: Any, caller: str, argument: str = "state") -> None:
    """Raise the `ValueError` of a consumed (donated) state; see `deleted_leaf`.

    A step donates only the state it returned, so the array went with that
    state: either `tree` is an older state, or it shares the array with one
    (a GAN's two states copied into each other with `eqx.tree_at`)."""
    path = deleted_leaf(tree)
    if path is not None:
        raise ValueError(
            f"{caller}: `{argument}` was consumed by an earlier step (its array at "
            f"{path} was donated and deleted); pass the state the step returned "
            "instead. If you did, that array was shared with another state (e.g. "
            "put into it with `eqx.tree_at`) which a step consumed since: share "
            "arrays after the step that donates them, share a copy (`jnp.copy`), "
            "or build the steps with `donate=False`."
        )


def check_rows(batch: Any, divisor: int, caller: str, why: str) -> None:
    """Raise a `ValueError` naming the first batch leaf (rank >= 1) whose leading
    dimension `divisor` does not divide; `why` says what `divisor` is."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if is_array(leaf) and np.ndim(leaf) > 0 and np.shape(leaf)[0] % divisor:
            raise ValueError(
                f"{caller}: batch leaf {path_str(path)} has leading dimension "
                f"{np.shape(leaf)[0]}, which is not divisible by {why}; make the "
                f"batch size a multiple of {divisor}."
            )


def batch_rows(batch: Any, caller: str) -> int | None:
    """The number of rows every array leaf of rank >= 1 of `batch` has (`None`
    when there is none), or a `ValueError` naming the leaves that disagree."""
    rows: dict[int, str] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if is_array_like(leaf) and np.ndim(leaf) > 0:
            rows.setdefault(np.shape(leaf)[0], path_str(path))
    if len(rows) > 1:
        found = ", ".join(f"{p}: {n}" for n, p in rows.items())
        raise ValueError(
            f"{caller}: every batch leaf must have the same number of rows; got "
            f"{found}."
        )
    return next(iter(rows)) if rows else None


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Every floating-point array leaf of `tree` cast to `dtype` (`None`: `tree`
    as it is); other leaves are kept."""
    if dtype is None:
        return tree
    return jax.tree.map(
        lambda x: (
            x.astype(dtype)
            if is_array(x) and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
            else x
        ),
        tree,
    )


def state_like(
    state: Any, model: Any, *, opt_state: Any, step: Any, key: Any, model_state: Any
) -> Any:
    """A tree of `state`'s (a `TrainState`'s) structure with the given value per
    part, one leaf per leaf of that part (e.g. the parts' `PartitionSpec`s), built
    without running `TrainState.__init__` (which checks real states)."""
    parts = [
        flatten_up_to(part, value)
        for part, value in (
            (state.model, model),
            (state.opt_state, opt_state),
            (state.step, step),
            (state.key, key),
            (state.model_state, model_state),
        )
    ]
    return jax.tree.unflatten(
        jax.tree.structure(state), [leaf for part in parts for leaf in part]
    )


def check_callable_takes(
    fn: Callable[..., Any], arguments: tuple[str, ...], caller: str, why: str = ""
) -> None:
    """A `TypeError` naming `caller` and the call it makes, `caller(a, b, ...)`,
    when `fn` cannot be called with `len(arguments)` positional arguments (e.g. a
    loss written `loss_fn(model, x, y, key)` where the step calls
    `loss_fn(model, batch, key)`), instead of Python's bare "missing argument".
    Callables whose signature Python cannot read are not checked."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*arguments)
    except TypeError as e:
        name = getattr(fn, "__name__", type(fn).__name__)
        call = f"{caller}({', '.join(arguments)})"
        raise TypeError(
            f"{caller} is called as `{call}`{why}, but `{name}{signature}` cannot "
            f"take that ({e}). Write it as `{call}`: the batch is one argument "
            "(unpack it inside, e.g. `x, y = batch`), and an argument it does not "
            "use can be ignored."
        ) from None


def call_with_axes(
    fn: Callable[..., Any], args: tuple[Any, ...], caller: str, axes: tuple[str, ...]
) -> Any:
    """`fn(*args)`, where `fn` is a user's function a step runs with the mesh
    axes `axes` bound: JAX's `NameError` for another axis (a BatchNorm or
    collective naming an axis that is not in the mesh, found 50 frames deep)
    becomes a `ValueError` naming `caller`, the axis and the axes it can use."""
    try:
        return fn(*args)
    except NameError as e:
        found = re.search(r"unbound axis name: ([^.\s]+)", str(e))
        if found is None:
            raise
        axis = found.group(1)
        if not axes:  # the global view
            raise ValueError(
                f"{caller} uses the axis {axis!r}, but in the global view it runs "
                "once on the whole batch with no mesh axis bound: collectives and "
                "`axis_name=` over mesh axes are neither needed nor allowed there. "
                "Write it as for one device (a BatchNorm's `axis_name` names only "
                f"{caller}'s own `jax.vmap` axis, e.g. `axis_name='batch'`), or use "
                "view='device'."
            ) from None
        raise ValueError(
            f"{caller} uses the axis {axis!r}, which is not bound where the step "
            f"runs it: it binds the mesh axes {axes} (and whatever `jax.vmap` axes "
            f"{caller} names itself). Name one of those, e.g. "
            "`eqx.nn.BatchNorm(..., axis_name=('batch', 'data'))` under "
            "`jax.vmap(..., axis_name='batch')`."
        ) from None


def check_compute_dtype(dtype: Any, caller: str) -> Any:
    """`dtype` as a NumPy floating dtype, or a `TypeError` naming it (`None` stays
    `None`: no cast)."""
    if dtype is None:
        return None
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or not jax.numpy.issubdtype(resolved, jax.numpy.floating):
        raise TypeError(
            f"{caller}: `compute_dtype` must be a floating-point dtype such as "
            f"jnp.bfloat16 or jnp.float32, or None; got {dtype!r}."
        )
    return resolved


def flatten_up_to(tree: Any, values: Any) -> list[Any]:
    """`values`' leaves, one per leaf of `tree` (`values` has `tree`'s structure
    down to `tree`'s leaves, e.g. `None` or a `PartitionSpec` at each)."""
    treedef: Any = jax.tree.structure(tree)
    leaves: list[Any] = treedef.flatten_up_to(values)
    return leaves


def is_key_array(x: Any) -> bool:
    """An array of new-style PRNG keys (`jax.random.key`)."""
    return bool(jnp.issubdtype(x.dtype, jax.dtypes.prng_key))


def _numeric(dtype: Any) -> bool:
    # bfloat16 and the other ml_dtypes count (NumPy calls them kind "V").
    return bool(jnp.issubdtype(dtype, np.number) or jnp.issubdtype(dtype, np.bool_))


def check_array_leaves(
    tree: Any, caller: str, argument: str, *, keys: str | None = None
) -> None:
    """Raise a `TypeError` naming the leaf path, its dtype and what was expected for
    an array leaf JAX cannot compute with: a NumPy array of strings, bytes, Python
    objects or dates. `keys`: if set, PRNG key arrays are refused too, `keys` saying
    what cannot be done with them (e.g. "averaged")."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not is_array(leaf):
            continue
        if is_key_array(leaf):
            if keys is not None:
                raise TypeError(
                    f"{caller}: `{argument}` leaf {path_str(path)} is an array of PRNG "
                    f"keys ({leaf.dtype}); keys cannot be {keys}. Leave keys out of "
                    f"`{argument}` (or pass `jax.random.key_data(key)` if you want "
                    "their bits)."
                )
            continue
        if not _numeric(leaf.dtype):
            raise TypeError(
                f"{caller}: `{argument}` leaf {path_str(path)} is a NumPy array of "
                f"dtype {leaf.dtype} ({_short(leaf)}); expected a numeric or bool "
                "array. JAX cannot hold strings or Python objects on devices: convert "
                f"it (e.g. to integer ids) or keep it out of `{argument}`."
            )


def _short(x: Any) -> str:
    text = np.array2string(
        np.asarray(x).ravel()[:3], separator=", ", max_line_width=10**6
    )
    return text if x.size <= 3 else text[:-1] + ", ...]"


_Closing = TypeVar("_Closing", bound="Closing")


class Closing:
    """Mixin for objects that hold threads or files: `with obj:` closes it on
    leaving the block, as `obj.close()` does."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Closing) -> _Closing:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
