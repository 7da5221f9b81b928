"""How a piece of metric state is held: the representations behind
`MetricAccumulator`.

Every representation keeps the state as a tuple of *words* (arrays of the state's
shape and dtype, the main word first) and answers the same few questions:
`start` (the words of an initial value), `encode` (the words of one value to add),
`add` (two states combined), `value`/`value_as` (the state as one array),
`sync_parts`/`from_sync_parts` (what the all-reduces carry, and the state rebuilt
from their results) and `load` (words from a state dict).

- `Plain`: one word, combined by the reduce op (sum, max or min).
- `Compensated`: a float sum and the rounding error of every addition (Knuth's
  TwoSum), so that the pair holds about twice the dtype's precision.
- `Carried`: an integer sum as a low word in `[0, 2**CARRY_BITS)` and a word of
  carries, so that a count never wraps past 2**31 (exact to 2**47 in int32 words).
- `Folded`: one word combined by an associative function that is not a sum (e.g.
  Chan's merge of moments); synced as one row per device.
"""

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array

Words = tuple[Array, ...]


class ReduceOp(enum.StrEnum):
    """How an accumulator folds new values in and combines devices' states.

    `SUM = "sum"` (add), `MAX = "max"` (elementwise maximum), `MIN = "min"`
    (elementwise minimum). Wherever a `ReduceOp` is expected its string also works.
    """

    SUM = "sum"
    MAX = "max"
    MIN = "min"


COMBINE: dict[ReduceOp, Callable[[Array, Array], Array]] = {
    ReduceOp.SUM: jnp.add,
    ReduceOp.MAX: jnp.maximum,
    ReduceOp.MIN: jnp.minimum,
}

CARRY_BITS = 16
"""A carried integer sum keeps its low word in `[0, 2**CARRY_BITS)` and counts
carries in its high word. 16 bits: the low words of up to 32767 devices add up
in one int32 all-reduce without overflow, and int32 high words reach 2**47."""

_LOW_MASK = (1 << CARRY_BITS) - 1


def two_sum(a: Array, b: Array) -> tuple[Array, Array]:
    """`a + b` rounded, and its rounding error, exactly (Knuth's TwoSum: the two add
    up to `a + b` with no rounding at all). A non-finite sum has error 0, where the
    formula would give NaN."""
    total = a + b
    b_part = total - a
    error = (a - (total - b_part)) + (b - b_part)
    return total, jnp.where(jnp.isfinite(total), error, jnp.zeros_like(error))


def add_pairs(
    hi: Array, lo: Array, other_hi: Array, other_lo: Array
) -> tuple[Array, Array]:
    """The sum of two double-word numbers `hi + lo`, renormalised so that `lo` is
    within half a unit in the last place of `hi` (then `hi` is the sum rounded)."""
    total, error = two_sum(hi, other_hi)
    return two_sum(total, error + (lo + other_lo))


def split_for_psum(hi: Array) -> tuple[Array, Array]:
    """`hi` as `top + bottom` exactly, `top` a multiple of `q = 2**ceil(p / 2)` (`p`
    the dtype's significand bits) and `|bottom| < q`.

    A collective sum of `hi`s rounds as soon as the total outgrows the precision of
    the parts (8 devices holding 16777218.0 and 16777216.0 do not add up exactly in
    float32). Summed separately, multiples of `q` stay exact up to `2**p * q` and
    integers below `q` stay exact for up to `2**p / q` devices: in float32, integer
    totals below 2**36 on up to 4096 devices are summed exactly.
    """
    precision = jnp.finfo(hi.dtype).nmant + 1
    q = jnp.asarray(2.0 ** -(-precision // 2), hi.dtype)
    finite = jnp.isfinite(hi)
    top = jnp.where(finite, jnp.trunc(hi / q) * q, hi)
    return top, jnp.where(finite, hi - top, jnp.zeros_like(hi))


def can_carry(dtype: jnp.dtype) -> bool:
    """Whether `dtype` can hold the words of a carried integer sum."""
    return jnp.issubdtype(dtype, jnp.signedinteger) and jnp.iinfo(dtype).bits >= 32


def carry(lo: Array, hi: Array) -> tuple[Array, Array]:
    """Renormalise a carried integer `hi * 2**CARRY_BITS + lo` so that `lo` is in
    `[0, 2**CARRY_BITS)` (an arithmetic shift and a mask: right for negative `lo`
    too)."""
    return jnp.bitwise_and(lo, _LOW_MASK), hi + jnp.right_shift(lo, CARRY_BITS)


def carried_total(x: Array, dtype: jnp.dtype) -> tuple[Array, Array]:
    """The exact sum of every entry of the integer (or boolean) array `x`, as the
    words `(lo, hi)` of a carried sum in `dtype`.

    `jnp.sum` wraps as soon as the total passes 2**31 (four weights of 2**30 sum to
    0). Each entry is split into its low 16 bits and the rest; the low parts are
    summed in blocks small enough not to overflow and carried, the high parts add
    up modulo 2**32, which is exact whenever the total itself is below 2**47.
    """
    x = jnp.ravel(x)
    if x.dtype == jnp.bool_ or jnp.iinfo(x.dtype).bits < jnp.iinfo(dtype).bits:
        x = x.astype(dtype)
    # Split in the input's own dtype: a logical shift for unsigned words.
    lo = jnp.bitwise_and(x, _LOW_MASK).astype(dtype)
    hi = jnp.right_shift(x, CARRY_BITS).astype(dtype)
    block = 1 << (jnp.iinfo(dtype).bits - 2 - CARRY_BITS)
    lo = jnp.pad(lo, (0, -lo.size % block)).reshape(-1, block).sum(axis=1)
    lo, carries = carry(lo, jnp.zeros_like(lo))
    return carry(jnp.sum(lo), jnp.sum(hi) + jnp.sum(carries))


@dataclasses.dataclass(frozen=True)
class Plain:
    """One word, combined with `op`."""

    op: ReduceOp
    second: ClassVar[str] = ""
    """The suffix of the second word's state-dict keys (`""`: no second word)."""

    def start(self, initial: Array) -> Words:
        return (initial,)

    def encode(self, value: Array) -> Words:
        return (value,)

    def add(self, a: Words, b: Words) -> Words:
        return (COMBINE[self.op](a[0], b[0]),)

    def value(self, words: Words) -> Array:
        return words[0]

    def value_as(self, words: Words, dtype: jnp.dtype) -> Array:
        return words[0].astype(dtype)

    def sync_parts(self, words: Words, names: tuple[str, ...]) -> list[Array]:
        return list(words)

    def from_sync_parts(self, parts: Sequence[Array]) -> Words:
        return tuple(parts)

    def load(self, main: Array, second: Array | None) -> Words:
        return (main,)


@dataclasses.dataclass(frozen=True)
class Compensated(Plain):
    """A float sum `hi + lo`, `lo` the rounding errors of every addition.

    Synced in three parts (a coarse and a fine part of `hi`, and `lo`), so that
    integer-valued float32 totals below 2**36 stay exact on up to 4096 devices.
    """

    op: ReduceOp = ReduceOp.SUM
    second: ClassVar[str] = "lo"

    def start(self, initial: Array) -> Words:
        return initial, jnp.zeros_like(initial)

    def encode(self, value: Array) -> Words:
        return value, jnp.zeros_like(value)

    def add(self, a: Words, b: Words) -> Words:
        return add_pairs(*a, *b)

    def value(self, words: Words) -> Array:
        return words[0] + words[1]

    def value_as(self, words: Words, dtype: jnp.dtype) -> Array:
        wide = jnp.promote_types(dtype, words[0].dtype)
        return (words[0].astype(wide) + words[1].astype(wide)).astype(dtype)

    def sync_parts(self, words: Words, names: tuple[str, ...]) -> list[Array]:
        return [*split_for_psum(words[0]), words[1]]

    def from_sync_parts(self, parts: Sequence[Array]) -> Words:
        top, bottom, lo = parts
        return add_pairs(top, jnp.zeros_like(lo), bottom, lo)

    def load(self, main: Array, second: Array | None) -> Words:
        return main, jnp.zeros_like(main) if second is None else second


@dataclasses.dataclass(frozen=True)
class Carried(Plain):
    """An integer sum `hi * 2**CARRY_BITS + lo`, `lo` in `[0, 2**CARRY_BITS)`.

    Both words join the (sum, int) all-reduce; the low words of up to 32767 devices
    cannot overflow it.
    """

    op: ReduceOp = ReduceOp.SUM
    second: ClassVar[str] = "hi"

    def start(self, initial: Array) -> Words:
        return carry(initial, jnp.zeros_like(initial))

    def encode(self, value: Array) -> Words:
        return carry(value, jnp.zeros_like(value))

    def add(self, a: Words, b: Words) -> Words:
        # Both low words are below 2**CARRY_BITS, so their sum cannot overflow.
        return carry(a[0] + b[0], a[1] + b[1])

    def value(self, words: Words) -> Array:
        """The total, saturated where it leaves the dtype's range (never wrapped)."""
        lo, hi = words
        info = jnp.iinfo(lo.dtype)
        limit = 1 << (info.bits - 1 - CARRY_BITS)
        highest, lowest = (jnp.asarray(v, lo.dtype) for v in (info.max, info.min))
        exact = (hi << CARRY_BITS) + lo
        return jnp.where(hi >= limit, highest, jnp.where(hi < -limit, lowest, exact))

    def value_as(self, words: Words, dtype: jnp.dtype) -> Array:
        # A narrow float (float16 reaches 65504) cannot hold the scale 2**16, let
        # alone the total: compute in at least float32 and round once.
        wide = dtype
        if jnp.issubdtype(dtype, jnp.floating):
            wide = jnp.promote_types(dtype, jnp.float32)
        lo, hi = (w.astype(wide) for w in words)
        return (hi * jnp.asarray(2**CARRY_BITS, wide) + lo).astype(dtype)

    def sync_parts(self, words: Words, names: tuple[str, ...]) -> list[Array]:
        return list(words)

    def from_sync_parts(self, parts: Sequence[Array]) -> Words:
        return carry(*parts)

    def load(self, main: Array, second: Array | None) -> Words:
        # States saved without a carry word (or by hand) are renormalised.
        lo, extra = carry(main, jnp.zeros_like(main))
        return lo, extra if second is None else second + extra

    def encode_int(self, total: int, dtype: jnp.dtype, caller: str) -> Words:
        """The words of a Python integer (e.g. an exact host-side total)."""
        limit = 1 << (jnp.iinfo(dtype).bits - 1 + CARRY_BITS)
        if not -limit <= total < limit:
            raise ValueError(
                f"{caller}: a total of {total} is beyond what a carried {dtype} sum "
                f"holds exactly, [-2**{limit.bit_length() - 1}, "
                f"2**{limit.bit_length() - 1})."
            )
        return (
            jnp.asarray(total & _LOW_MASK, dtype),
            jnp.asarray(total >> CARRY_BITS, dtype),
        )


@dataclasses.dataclass(frozen=True)
class Folded(Plain):
    """One word combined by an associative `fold(earlier, later)`.

    Synced by placing each device's state in its row of an `(axis_size, *shape)`
    array of zeros, added up in the (sum, dtype) all-reduce that the other sums of
    that dtype use (adding zeros is exact), and folding the rows in device order on
    every device, so the result is replicated and the same everywhere.
    """

    op: ReduceOp = ReduceOp.SUM
    fold: Callable[[Array, Array], Array] = jnp.add

    def add(self, a: Words, b: Words) -> Words:
        return (self.fold(a[0], b[0]),)

    def sync_parts(self, words: Words, names: tuple[str, ...]) -> list[Array]:
        size = 1
        for name in names:
            size *= jax.lax.axis_size(name)
        (state,) = words
        rows = jnp.zeros((size, *state.shape), state.dtype)
        return [rows.at[jax.lax.axis_index(names)].set(state)]

    def from_sync_parts(self, parts: Sequence[Array]) -> Words:
        (rows,) = parts

        def body(carry: Array, row: Array) -> tuple[Array, None]:
            return self.fold(carry, row), None

        folded, _ = jax.lax.scan(body, rows[0], rows[1:])
        return (folded,)


Representation = Plain | Compensated | Carried | Folded
