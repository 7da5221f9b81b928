"""Names to mesh axes: which dimension of each parameter lives on which mesh axis.

Two rules, in one place: the FSDP rule (a large leaf is split over the data axis on
one divisible dimension: `fsdp_specs`, `FsdpRule`) and the parameter rules
(`param_rules`: a regular expression on a leaf's path gives it a `PartitionSpec` over
model axes: `ParamRules`). `FsdpRule.spec` composes them for one leaf. Modules that
gather their own parameters (`FSDP`, `Stacked`) derive from `SelfGathering` and are
handed each of their leaves' rules (`_own_specs`), so no caller needs to know either.
"""

import abc
import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import PyTree

from .._utils import (
    check_min_weight_size,
    is_array_like,
    not_in_mesh,
    plural,
    typecheck,
)

LAYOUTS = ("largest", "leading")
DEFAULT_LAYOUT = "leading"
"""The layout everything that trains uses unless told otherwise (`make_train_step`,
`FSDP`, `FSDPSequential`): each shard one contiguous block, so gathers need no
transposing copies. `fsdp_specs` keeps the tutorial's rule, `"largest"`, as its
contract says."""
"""The FSDP layouts: `"largest"` (the largest divisible
dimension, ties to the later one) and `"leading"` (the first divisible dimension, so
every shard is one contiguous block of the row-major array)."""

OUTPUTS = "outputs"
"""The train step's third FSDP layout (`fsdp_layout="outputs"`, the global view's
default under `"fsdp"`): each `eqx.nn.Linear` weight, stored `(out, in)`, on its
leading dimension, every other leaf on its largest (ties to the later: a square
`x @ W` weight on its columns). Either way a weight is split on its output
features where its shape says which they are, and XLA's partitioner then splits
the product instead of gathering the weight."""

ParamRuleSpecs = Sequence[tuple[str, P]]


def check_layout(
    layout: str, caller: str, argument: str = "layout", valid: tuple[str, ...] = LAYOUTS
) -> None:
    if layout not in valid:
        raise ValueError(
            f"{caller}: `{argument}`={layout!r} is not a layout; expected one of "
            f"{valid}."
        )


def in_linear(tree: Any) -> list[bool]:
    """Per leaf of `jax.tree.leaves(tree)`: whether it belongs to an
    `eqx.nn.Linear` (`OUTPUTS` shards those on their leading dimension)."""
    flags: list[bool] = []
    for part in jax.tree.leaves(tree, is_leaf=_is_linear):
        flags.extend([_is_linear(part)] * len(jax.tree.leaves(part)))
    return flags


def _is_linear(x: Any) -> bool:
    return isinstance(x, eqx.nn.Linear)


def is_spec_leaf(x: Any) -> bool:
    """`is_leaf` for a tree of specs: a `PartitionSpec` (itself a tuple) or `None`
    (a leaf that is not an array) ends the walk."""
    return x is None or isinstance(x, P)


def spec_axes(spec: P | None) -> set[str]:
    """Every mesh axis a `PartitionSpec` names."""
    names: set[str] = set()
    for entry in spec or ():
        if isinstance(entry, str):
            names.add(entry)
        elif isinstance(entry, tuple):
            names.update(entry)
    return names


def sharded_dim(spec: P | None, axis_name: str) -> int | None:
    """The dimension `spec` shards over `axis_name` alone, or `None`."""
    if spec is None:
        return None
    for dim, entry in enumerate(spec):
        if entry == axis_name or entry == (axis_name,):
            return dim
    return None


def restrict(spec: P | None, keep: Sequence[str]) -> P | None:
    """`spec` with only the axes in `keep` (the others become `None`)."""
    if spec is None:
        return None
    out: list[Any] = []
    for entry in spec:
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(n for n in names if n in keep)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def entry_size(mesh: Mesh, entry: Any) -> int:
    """The number of devices one `PartitionSpec` entry splits a dimension over."""
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return math.prod(mesh.shape[n] for n in names)


def leaf_spec(
    shape: tuple[int, ...],
    axis_size: int,
    axis_name: str,
    min_weight_size: int,
    *,
    prefer: str = "largest",
) -> P:
    """The FSDP rule for one array of `shape` (see `fsdp_specs`); `prefer` is the
    layout: `"largest"` or `"leading"` divisible dimension."""
    if math.prod(shape) <= min_weight_size:
        return P()
    divisible = [(d, i) for i, d in enumerate(shape) if d % axis_size == 0]
    if not divisible:
        return P()
    if prefer == "leading":
        _, dim = divisible[0]
    else:
        _, dim = max(divisible)  # largest dimension; ties go to the later one
    return P(*[axis_name if i == dim else None for i in range(len(shape))])


@dataclasses.dataclass(frozen=True)
class FsdpRule:
    """The FSDP rule over one data axis: `axis_name` of `axis_size` devices, leaves
    of more than `min_weight_size` elements, the `layout`'s dimension
    (`"largest"`, `"leading"` or `OUTPUTS`)."""

    axis_name: str
    axis_size: int
    min_weight_size: int
    layout: str

    def spec(
        self, shape: tuple[int, ...], rule: P | None = None, linear: bool = False
    ) -> P:
        """The spec of a leaf of `shape` whose parameter rule is `rule`: the FSDP
        rule on the dimensions `rule` leaves unsharded (`min_weight_size` compares
        the leaf's full size), added to `rule`. `linear`: the leaf belongs to an
        `eqx.nn.Linear` (under `OUTPUTS`, its leading dimension)."""
        rule = rule or P()
        if math.prod(shape) <= self.min_weight_size or self.axis_name in spec_axes(
            rule
        ):
            # Already split over the axis (an expert weight over its experts).
            return rule
        taken = {d for d, e in enumerate(rule) if e is not None}
        free = tuple(1 if d in taken else n for d, n in enumerate(shape))
        prefer = self.layout
        if prefer == OUTPUTS:
            prefer = "leading" if linear else "largest"
        own = leaf_spec(free, self.axis_size, self.axis_name, 0, prefer=prefer)
        dim = sharded_dim(own, self.axis_name)
        if dim is None or dim in taken:
            return rule
        entries = list(rule) + [None] * (len(shape) - len(rule))
        entries[dim] = self.axis_name
        return P(*entries)


@typecheck
def fsdp_specs(
    tree: PyTree[Any],
    axis_size: int,
    *,
    axis_name: str = "data",
    min_weight_size: int = 2**18,
    layout: str = "largest",
) -> PyTree[Any]:
    """The `PartitionSpec` FSDP gives each array leaf of `tree`.

    The rule: a leaf with `size <= min_weight_size` is
    replicated (`P()`); otherwise its largest dimension that `axis_size` divides is
    sharded over `axis_name` (on a tie, the later dimension); if no dimension divides,
    it is replicated. Small leaves stay whole because splitting them saves little
    memory and costs a collective each.

    With `layout="leading"` the *first* divisible dimension is sharded instead. Each
    device's shard is then one contiguous block of the row-major array, so an
    all-gather delivers the full array as it is laid out in memory and a
    reduce-scatter reads contiguous blocks: no transposing copies around the
    collectives (an `eqx.nn.Linear` weight, stored `(out, in)`, is sharded on `out`).
    PyTorch's FSDP2 shards dimension 0 for the same reason. See the FSDP guide for
    measurements.

    **Arguments:**

    - `tree`: parameters, a whole model, an optimizer state or a `TrainState`; array
      leaves may be concrete or abstract (`jax.ShapeDtypeStruct`).
    - `axis_size`: the number of devices along `axis_name`.
    - `axis_name`: the mesh axis parameters are sharded over.
    - `min_weight_size`: leaves with at most this many elements are replicated.
    - `layout`: `"largest"` (the default) or `"leading"`.

    **Returns:**

    A pytree of the structure of `tree`: a `PartitionSpec` with one entry per
    dimension (or `P()`) for each array leaf, `None` for every other leaf.

    **Raises:**

    `ValueError` for `axis_size < 1`, a negative `min_weight_size` or an unknown
    `layout`.

    !!! Example

        ```python
        ed.fsdp_specs({"w": jnp.zeros((784, 512)), "b": jnp.zeros(10)}, 8,
                      min_weight_size=16)
        # {"w": P("data", None), "b": P()}
        ed.fsdp_specs({"w": jnp.zeros((256, 512))}, 8, layout="leading")
        # {"w": P("data", None)}  (`"largest"`: P(None, "data"))
        ```
    """
    if axis_size < 1:
        raise ValueError(f"fsdp_specs: `axis_size` must be >= 1; got {axis_size}.")
    check_min_weight_size(min_weight_size, "fsdp_specs")
    check_layout(layout, "fsdp_specs")
    rule = FsdpRule(axis_name, axis_size, min_weight_size, layout)
    return jax.tree.map(
        lambda x: rule.spec(tuple(x.shape)) if is_array_like(x) else None, tree
    )


class ParamRules:
    """`param_rules` checked against a mesh: `(pattern, PartitionSpec)` pairs, the
    first pattern `re.search`-ing a leaf's path giving its spec over model (not
    data) axes. Every mistake is a `ValueError` naming `caller` and the pattern."""

    def __init__(
        self,
        rules: Sequence[Any],
        mesh: Mesh,
        data_axes: tuple[str, ...],
        caller: str,
    ) -> None:
        self.mesh = mesh
        self.caller = caller
        checked = []
        for i, rule in enumerate(rules):
            if not (isinstance(rule, tuple | list) and len(rule) == 2):
                raise TypeError(
                    f"{caller}: param_rules[{i}] is {rule!r}; expected a pair "
                    "(pattern, PartitionSpec)."
                )
            pattern, spec = rule
            if not isinstance(pattern, str) or not isinstance(spec, P):
                raise TypeError(
                    f"{caller}: param_rules[{i}] is ({pattern!r}, {spec!r}); "
                    "expected (a regular expression string, a PartitionSpec)."
                )
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"{caller}: param_rules pattern {pattern!r} is not a valid "
                    f"regular expression: {e}."
                ) from None
            for axis in spec_axes(spec):
                if axis not in mesh.axis_names:
                    raise ValueError(
                        f"{caller}: param_rules pattern {pattern!r}: spec {spec} "
                        f"names an axis the mesh lacks: {not_in_mesh(axis, mesh)}"
                    )
                if axis in data_axes:
                    raise ValueError(
                        f"{caller}: param_rules pattern {pattern!r}: spec {spec} "
                        f"names the data axis {axis!r}; rules shard parameters over "
                        "the other (model) axes, the strategy handles data axes."
                    )
            checked.append((compiled, spec))
        self.rules: tuple[tuple[re.Pattern[str], P], ...] = tuple(checked)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def match(self, paths: Sequence[str], leaves: Sequence[Any]) -> list[P | None]:
        """The rule spec of each leaf (`None`: no rule matched, or not an array).
        A LoRA adapter (`lora_a`/`lora_b` beside a `weight`, `adapters`) whose
        weight has a rule is placed by it (`adapter_spec`), not matched itself."""
        out: list[P | None] = [None] * len(leaves)
        used = [False] * len(self.rules)
        adapted = adapters(paths, leaves)
        for j in [*(j for j in range(len(leaves)) if j not in adapted), *adapted]:
            path, leaf = paths[j], leaves[j]
            if not is_array_like(leaf):
                continue
            if j in adapted and out[adapted[j][0]] is not None:
                weight, kind = adapted[j]
                out[j] = adapter_spec(out[weight], kind, len(leaf.shape))  # type: ignore[arg-type]
                continue
            for r, (pattern, spec) in enumerate(self.rules):
                if pattern.search(path):
                    used[r] = True
                    self._check_fits(pattern.pattern, spec, path, tuple(leaf.shape))
                    out[j] = spec
                    break
        for r, was_used in enumerate(used):
            if not was_used:
                raise ValueError(
                    f"{self.caller}: param_rules pattern "
                    f"{self.rules[r][0].pattern!r} matches no array of the model "
                    "(paths are written as jax.tree_util.keystr writes them, e.g. "
                    f"{paths[0] if paths else '.layers[0].weight'!r})."
                )
        return out

    def _check_fits(
        self, pattern: str, spec: P, path: str, shape: tuple[int, ...]
    ) -> None:
        if len(spec) > len(shape):
            raise ValueError(
                f"{self.caller}: param_rules pattern {pattern!r} gives spec {spec} "
                f"to {path} of shape {shape}; the spec has more entries than the "
                "leaf has dimensions."
            )
        for dim, entry in enumerate(spec):
            size = entry_size(self.mesh, entry)
            if entry is not None and shape[dim] % size:
                raise ValueError(
                    f"{self.caller}: param_rules pattern {pattern!r}: dimension "
                    f"{dim} of {path} (shape {shape}) has size {shape[dim]}, not "
                    f"divisible by the {plural(size, 'device')} of {entry!r}."
                )


def adapters(paths: Sequence[str], leaves: Sequence[Any]) -> dict[int, tuple[int, str]]:
    """The LoRA adapters among `leaves`: `{adapter: (its weight, "lora_a" or
    "lora_b")}`, a leaf `<m>.lora_a` `(..., rank, in)` or `<m>.lora_b` `(...,
    out, rank)` beside `<m>.weight` `(..., out, in)` (`ed.LoRALinear`)."""
    index = {path: j for j, path in enumerate(paths)}
    found = {}
    for j, path in enumerate(paths):
        for kind, dim in (("lora_a", -1), ("lora_b", -2)):
            w = index.get(path[: -len(kind)] + "weight", -1)
            if not path.endswith("." + kind) or w < 0:
                continue
            a, b = leaves[j], leaves[w]
            if (
                is_array_like(a)
                and is_array_like(b)
                and len(a.shape) == len(b.shape) >= 2
                and a.shape[dim] == b.shape[dim]
            ):
                found[j] = (w, kind)
    return found


def adapter_spec(weight: P, kind: str, ndim: int) -> P:
    """An adapter's spec from its weight's rule: the weight's output-dimension
    axis on `lora_b`'s output dimension, its input-dimension axis on `lora_a`'s
    input dimension, leading (layer) axes kept; the rank never split."""
    entries = [*weight, *[None] * (ndim - len(weight))]
    entries[-2 if kind == "lora_a" else -1] = None  # the rank
    return P(*entries)


def merge_specs(rule: P | None, own: P | None, path: str, caller: str) -> P | None:
    """A parameter rule's axes added to the FSDP spec a `FSDP`/`Stacked` module
    gives its own leaf, or a `ValueError` when both claim one dimension."""
    if rule is None or own is None:
        return own if rule is None else rule
    n = max(len(rule), len(own))
    a = list(rule) + [None] * (n - len(rule))
    b = list(own) + [None] * (n - len(own))
    for dim, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is not None and y is not None:
            raise ValueError(
                f"{caller}: param_rules shard dimension {dim} of {path} over {x!r}, "
                f"which its FSDP/Stacked module already shards over {y!r}; write "
                "the rule for another dimension (a Stacked leaf's dimension 0 is "
                "the layer axis)."
            )
    return P(*[x if x is not None else y for x, y in zip(a, b, strict=True)])


class SelfGathering(eqx.Module):
    """A module that all-gathers its own parameters when called inside `shard_map`
    (`FSDP`, `Stacked`). An enclosing FSDP layout leaves its leaves to it: it
    gives their specs (`_own_specs`) and does not gather them."""

    @abc.abstractmethod
    def _own_specs(
        self,
        fsdp: FsdpRule,
        rules: Sequence[P | None],
        paths: Sequence[str],
        caller: str,
    ) -> list[P | None]:
        """The spec of each of `jax.tree.leaves(self)` under the enclosing FSDP
        rule (which a module with its own settings may ignore), given each leaf's
        parameter rule (`None`: none) and path (for errors naming `caller`)."""


def _is_self_gathering(x: Any) -> bool:
    return isinstance(x, SelfGathering)


def leaf_plan(
    tree: Any,
    fsdp: FsdpRule,
    rules: Sequence[P | None] | None = None,
    paths: Sequence[str] | None = None,
    caller: str = "",
) -> tuple[list[P | None], list[bool]]:
    """Per leaf of `jax.tree.leaves(tree)`: its spec under `fsdp` and its parameter
    rule (`rules`, one per leaf; none by default), and whether it is gathered at
    this level (`False` inside `FSDP`/`Stacked` modules, which gather their own
    leaves and give their own specs)."""
    n = len(jax.tree.leaves(tree))
    rules = [None] * n if rules is None else list(rules)
    paths = [""] * n if paths is None else list(paths)
    linear = in_linear(tree) if fsdp.layout == OUTPUTS else [False] * n
    specs: list[P | None] = []
    own: list[bool] = []
    for part in jax.tree.leaves(tree, is_leaf=_is_self_gathering):
        i = len(specs)
        if isinstance(part, SelfGathering):
            k = len(jax.tree.leaves(part))
            specs.extend(
                part._own_specs(fsdp, rules[i : i + k], paths[i : i + k], caller)
            )
            own.extend([False] * k)
        else:
            array = is_array_like(part)
            spec = fsdp.spec(tuple(part.shape), rules[i], linear[i]) if array else None
            specs.append(spec)
            own.append(True)
    return specs, own


def has_fsdp_modules(tree: Any) -> bool:
    """Whether `tree` holds an `FSDP` or `Stacked` module."""
    return any(
        isinstance(p, SelfGathering)
        for p in jax.tree.leaves(tree, is_leaf=_is_self_gathering)
    )
