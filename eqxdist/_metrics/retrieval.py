"""Retrieval metrics per query, averaged over queries: `PrecisionAtK`,
`RecallAtK`, `NDCGAtK`, `MRR`.

All take `update(scores, relevance, mask=None)`: `scores` `(Q, N)` (the score of
each of N candidate items for each of Q queries; higher ranks first),
`relevance` `(Q, N)` (non-negative; an item is relevant when its relevance is
> 0, and `NDCGAtK` uses the values as graded gains) and `mask` `(Q,)` boolean
(the queries to count). Each holds a `Mean` of the per-query values (a
compensated float sum and a carried integer count of queries).

Ties: items with equal scores are ranked in every order with equal probability
and the metric is the expected value over those orders. For `NDCGAtK` this is
scikit-learn's `ndcg_score` (`ignore_ties=False`); for `PrecisionAtK` and
`RecallAtK` it counts a tied group that straddles rank `k` in proportion; for
`MRR` it is the expected reciprocal rank of the first relevant item. A NaN score
ranks last.
"""

import abc
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .aggregation import Mean
from .base import Metric
from .checks import float_input, positive_int, same_shape
from .inputs import check_range, counted_mask, float_dtype

_Q = TypeVar("_Q", bound="_PerQuery")


def _ranks(scores: Array) -> tuple[Array, Array]:
    """For each item, how many items of its query score strictly higher, and how
    many score the same (itself included)."""
    ordered = jnp.sort(scores, axis=-1)
    search = jax.vmap(jnp.searchsorted, in_axes=(0, 0, None))
    left, right = search(ordered, scores, "left"), search(ordered, scores, "right")
    return scores.shape[-1] - right, right - left


def _expected_gain(scores: Array, gains: Array, discount: Array) -> Array:
    """`sum_i gains_i * discount(rank_i)` per query, averaged over the orders of
    tied items: a tied group occupying ranks `[a, a + t)` shares the discounts of
    those ranks equally."""
    above, tied = _ranks(scores)
    cumulative = jnp.concatenate([jnp.zeros(1, discount.dtype), jnp.cumsum(discount)])
    shared = (cumulative[above + tied] - cumulative[above]) / tied
    return jnp.sum(gains * shared, axis=-1)


def _top_k_discount(n: int, k: int, dtype: jnp.dtype) -> Array:
    return (jnp.arange(n) < k).astype(dtype)


class _PerQuery(Metric):
    """The mean over queries of a per-query value."""

    per_query: Mean

    def __init__(self) -> None:
        self.per_query = Mean()

    def update(
        self: _Q,
        scores: ArrayLike,
        relevance: ArrayLike,
        mask: ArrayLike | None = None,
    ) -> _Q:
        """Add a batch of queries: `scores` and `relevance` `(Q, N)`, `mask`
        `(Q,)` boolean (`None`: every query).

        **Raises:**

        `TypeError` for non-numeric input or a non-boolean `mask`; `ValueError`
        for shapes other than `(Q, N)` alike, or negative relevance known at
        trace time.
        """
        caller = f"{type(self).__name__}.update"
        scores = float_input(scores, caller, "scores")
        relevance = float_input(relevance, caller, "relevance")
        if scores.ndim != 2 or scores.shape[1] == 0:
            raise ValueError(
                f"{caller}: `scores` must be (queries, items) with at least one "
                f"item, got shape {scores.shape}."
            )
        same_shape(scores, relevance, caller, ("scores", "relevance"), "(Q, N)")
        counted = counted_mask(
            mask, scores.shape[:1], caller, has_weights=False, target="the rows"
        )
        check_range(
            relevance,
            counted[:, None],
            0,
            float("inf"),
            caller,
            "relevance",
            "relevance must be >= 0 (0: not relevant).",
        )
        scores = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
        values = self._per_query_values(scores, relevance).astype(float_dtype())
        update = self.per_query.update(values, None if mask is None else counted)
        return self._with_children({"per_query": update})

    @abc.abstractmethod
    def _per_query_values(self, scores: Array, relevance: Array) -> Array:
        """The `(Q,)` values of a batch of queries."""

    def compute(self) -> Array:
        """The mean over the counted queries; NaN while none was counted."""
        return self.per_query.compute()


class _AtK(_PerQuery):
    k: int = eqx.field(static=True)

    def __init__(self, k: int):
        super().__init__()
        self.k = positive_int(k, type(self).__name__, "k")


class PrecisionAtK(_AtK):
    """Precision at `k`: the fraction of the `k` highest-scored items that are
    relevant, averaged over queries. A list shorter than `k` still divides by
    `k` (the missing items count as not relevant; torchmetrics'
    `RetrievalPrecision(adaptive_k=False)`).

    **Arguments:**

    - `k`: how many of the top items to look at (>= 1).

    !!! Example

        ```python
        ed.metrics.PrecisionAtK(10).update(scores, clicked).compute()
        ```
    """

    def _per_query_values(self, scores: Array, relevance: Array) -> Array:
        hits = _expected_gain(
            scores,
            (relevance > 0).astype(scores.dtype),
            _top_k_discount(scores.shape[-1], self.k, scores.dtype),
        )
        return hits / self.k


class RecallAtK(_AtK):
    """Recall at `k`: the fraction of a query's relevant items among its `k`
    highest-scored ones, averaged over queries; a query without a relevant item
    counts 0 (torchmetrics' `RetrievalRecall` with `empty_target_action="neg"`).

    **Arguments:**

    - `k`: how many of the top items to look at (>= 1).

    !!! Example

        ```python
        recall = ed.metrics.RecallAtK(100)
        recall.update(scores, relevance, mask=has_candidates).compute()
        ```
    """

    def _per_query_values(self, scores: Array, relevance: Array) -> Array:
        relevant = (relevance > 0).astype(scores.dtype)
        hits = _expected_gain(
            scores, relevant, _top_k_discount(scores.shape[-1], self.k, scores.dtype)
        )
        total = relevant.sum(axis=-1)
        return jnp.where(total == 0, 0, hits / jnp.where(total == 0, 1, total))


class NDCGAtK(_AtK):
    """Normalized discounted cumulative gain at `k`, with graded relevance as the
    gains: `DCG@k / IDCG@k`, `DCG@k = sum_(rank r < k) gain_r / log2(r + 2)`,
    averaged over queries; scikit-learn's `ndcg_score(relevance, scores, k=k)`
    (ties averaged). A query without a relevant item counts 0.

    **Arguments:**

    - `k`: how many of the top items to look at (>= 1; larger than the list
      means the whole list).

    !!! Example

        ```python
        ed.metrics.NDCGAtK(10).update(scores, graded_relevance).compute()
        ```
    """

    def _per_query_values(self, scores: Array, relevance: Array) -> Array:
        n = scores.shape[-1]
        ranks = jnp.arange(n, dtype=scores.dtype)
        discount = jnp.where(ranks < self.k, 1 / jnp.log2(ranks + 2), 0)
        dcg = _expected_gain(scores, relevance, discount)
        ideal = jnp.sum(-jnp.sort(-relevance, axis=-1) * discount, axis=-1)
        return jnp.where(ideal == 0, 0, dcg / jnp.where(ideal == 0, 1, ideal))


class MRR(_PerQuery):
    """Mean reciprocal rank: `1 / rank` of the first relevant item (rank 1 is the
    highest score), averaged over queries; a query without a relevant item counts
    0. With ties, the expected reciprocal rank over the orders of the tied items.

    !!! Example

        ```python
        ed.metrics.MRR().update(scores, relevance).compute()
        ```
    """

    def _per_query_values(self, scores: Array, relevance: Array) -> Array:
        relevant = relevance > 0
        first = jnp.max(jnp.where(relevant, scores, -jnp.inf), axis=-1, keepdims=True)
        group = scores == first
        above = jnp.sum(scores > first, axis=-1, keepdims=True)
        tied = jnp.sum(group, axis=-1, keepdims=True)
        hits = jnp.sum(group & relevant, axis=-1, keepdims=True)
        # P(the first relevant item of the group is at place >= j of it), for
        # j = 1, 2, ...: every earlier place held one of the non-relevant items.
        places = jnp.arange(1, scores.shape[-1] + 1, dtype=scores.dtype)
        left = tied - places + 1
        ratio = jnp.clip(left - hits, 0, None) / jnp.maximum(left, 1)
        survive = jnp.cumprod(
            jnp.concatenate([jnp.ones_like(ratio[:, :1]), ratio], axis=-1), axis=-1
        )
        chance = survive[:, :-1] - survive[:, 1:]
        value = jnp.sum(chance / (above + places), axis=-1)
        return jnp.where(hits[:, 0] == 0, 0, value)
