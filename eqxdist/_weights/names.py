"""Tensor names for a model's array leaves, as a PyTorch state dict writes them:
the leaf's path joined by dots (`blocks.3.lin.weight`), an `ed.Stacked`'s leaves
as the list of blocks it was built from (`layers.0.wq.weight`, one tensor per
layer), then renamed by `(pattern, template)` rules."""

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax

from .._layout.stacked import Stacked
from .._utils import is_array_like, path_str


def _key_name(key: Any) -> str:
    for attribute in ("name", "idx", "key"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def dotted(path: Sequence[Any]) -> str:
    """`(GetAttrKey('blocks'), SequenceKey(3), GetAttrKey('lin'))` -> `blocks.3.lin`."""
    return ".".join(_key_name(k) for k in path)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One array leaf of a model: `path` (as `jax.tree_util.keystr` writes it,
    for messages), its tensor names (one, or one per layer of a `Stacked`, the
    layer axis then not part of any tensor) and the leaf itself."""

    path: str
    names: tuple[str, ...]
    stacked: bool
    leaf: Any


def _is_stacked(x: Any) -> bool:
    return isinstance(x, Stacked)


def leaf_entries(model: Any, names: "Renamer") -> list[Entry | None]:
    """One `Entry` per leaf of `jax.tree.leaves(model)` (`None` for a leaf that is
    not an array), named by default and renamed by `names`."""
    out: list[Entry | None] = []
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_stacked)[0]
    for path, node in flat:
        if not isinstance(node, Stacked):
            if not is_array_like(node):
                out.append(None)
                continue
            name = names(dotted(path))
            out.append(Entry(path_str(path), (name,), False, node))
            continue
        prefix = dotted(path)
        for inner, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
            if not is_array_like(leaf):
                out.append(None)
                continue
            suffix = dotted(inner[1:])  # inner[0] is the Stacked's own `.layers`
            layer_names = tuple(
                names(_join(prefix, str(i), suffix)) for i in range(node.num_layers)
            )
            out.append(Entry(path_str((*path, *inner)), layer_names, True, leaf))
    return out


class Renamer:
    """`names=[(pattern, template), ...]` checked: the first pattern that
    `re.fullmatch`es a default name gives the tensor's name by
    `match.expand(template)`; no match keeps the default."""

    def __init__(self, rules: Any, caller: str) -> None:
        self.rules: list[tuple[re.Pattern[str], str]] = []
        if rules is None:
            return
        if isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
            raise TypeError(
                f"{caller}: `names` is {rules!r}; expected a sequence of "
                "(pattern, template) pairs, e.g. [(r'layers\\.(\\d+)\\.wq\\.weight', "
                "r'model.layers.\\1.self_attn.q_proj.weight')]."
            )
        for i, rule in enumerate(rules):
            if not (
                isinstance(rule, tuple | list)
                and len(rule) == 2
                and all(isinstance(s, str) for s in rule)
            ):
                raise TypeError(
                    f"{caller}: names[{i}] is {rule!r}; expected a pair of strings "
                    "(pattern, template)."
                )
            try:
                self.rules.append((re.compile(rule[0]), rule[1]))
            except re.error as e:
                raise ValueError(
                    f"{caller}: names[{i}] pattern {rule[0]!r} is not a valid "
                    f"regular expression: {e}."
                ) from None
        self.caller = caller

    def __call__(self, name: str) -> str:
        for pattern, template in self.rules:
            match = pattern.fullmatch(name)
            if match is not None:
                try:
                    return match.expand(template)
                except (re.error, IndexError) as e:
                    raise ValueError(
                        f"{self.caller}: names template {template!r} (pattern "
                        f"{pattern.pattern!r}) cannot expand {name!r}: {e}."
                    ) from None
        return name


def check_unique(entries: Sequence[Entry | None], caller: str) -> None:
    """A `ValueError` naming two leaves (or layers) written as one tensor."""
    seen: dict[str, str] = {}
    for entry in (e for e in entries if e is not None):
        for layer, name in enumerate(entry.names):
            where = f"{entry.path} (layer {layer})" if entry.stacked else entry.path
            if name in seen:
                raise ValueError(
                    f"{caller}: {seen[name]} and {where} both have the tensor "
                    f"name {name!r}; change `names` so that each tensor has its own."
                )
            seen[name] = where
