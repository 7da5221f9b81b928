"""Input pipeline: `BatchLoader` over map-style sources (pytrees of arrays,
`np.memmap`s, indexable objects, Grain `MapDataset`s). It sits above the step and
imports only core modules (`_utils`, `_data_parallel`)."""

from .loader import BatchLoader as BatchLoader
