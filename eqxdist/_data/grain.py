"""Grain's `MapDataset` as a `BatchLoader` source (the optional extra
`eqxdist[grain]`).

A `MapDataset` is map-style like our sources, but `dataset[i]` takes ONE index
(a slice gives another dataset), indices wrap around modulo `len(dataset)`, and
an element removed by `.filter` reads as `None`. The adapter reads the rows one
index at a time and stacks them, and refuses the `None`s, so the batch of a step
keeps its fixed number of rows."""

import sys
from typing import Any

import jax
import numpy as np


class GrainSource:
    """The rows of a Grain `MapDataset`, stacked leaf by leaf into a batch."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: np.ndarray) -> Any:
        elements = []
        for index in indices.tolist():
            element = self.dataset[index]
            if element is None:
                raise ValueError(
                    f"BatchLoader: the Grain dataset has no element at index {index} "
                    "(filtered out); a map-style source must return every row. "
                    "Filter the data before building the dataset, or mask rows in "
                    "the loss instead."
                )
            elements.append(element)
        return jax.tree.map(lambda *rows: np.stack(rows), *elements)


def grain_source(source: Any) -> GrainSource | None:
    """`source` wrapped in a `GrainSource` if it is a Grain `MapDataset`, else
    `None`. Grain is not imported here: whoever built a `MapDataset` has."""
    grain = sys.modules.get("grain")
    map_dataset = getattr(grain, "MapDataset", None)
    if map_dataset is not None and isinstance(source, map_dataset):
        return GrainSource(source)
    return None
