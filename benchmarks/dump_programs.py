"""Dump the lowered programs of a fixed set of train and eval steps, to diff them
across a refactor that must not change what the steps compute.

Each case builds a small model (an MLP of `eqx.nn.Linear`s, a `Stacked` model, a
BatchNorm model), lowers `make_train_step(...)` (or `make_eval_step`) on 8
simulated CPU devices and writes `<out>/<case>.txt`: the StableHLO text with
source locations stripped (they name lines of eqxdist's files, which a move
changes without changing the program) and the results' pytree paths.

    python benchmarks/dump_programs.py OUT_DIR [--mesh auto|explicit] [--case NAME]
        [--layout]
    diff -r BEFORE_DIR AFTER_DIR

Run it on the commit before and after the change; an empty `diff -r` says the
programs are byte-identical. `--mesh explicit` builds every mesh with
`jax.make_mesh`'s default (Explicit) axes: its programs equal the Auto ones.
`--layout` passes each case's layout keywords as one `ed.Layout` instead of
v0.4's mesh and keywords: its programs equal the shorthand's
(`tests/layout/test_layout_value.py` checks every case).
"""

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, PartitionSpec as P

import eqxdist as ed

ed.simulate_cpu_devices(8)  # before JAX starts its backend

OPTIMIZER = optax.adamw(1e-3)
TP_RULES = [
    (r"layers\[0\]\.weight", P("model", None)),
    (r"layers\[1\]\.weight", P(None, "model")),
]


class _Block(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key: Any) -> None:
        self.linear = eqx.nn.Linear(64, 64, key=key)

    def __call__(self, x: Any) -> Any:
        return x + jax.nn.gelu(self.linear(x))


def _stack(
    key: Any, features: int, block: Callable[[Any], Any]
) -> tuple[eqx.nn.Linear, ed.Stacked, eqx.nn.Linear]:
    """An embedding of `features` to 64, 4 `block`s stacked, a head to 4."""
    k1, k2, k3 = jax.random.split(key, 3)
    embed = eqx.nn.Linear(features, 64, key=k1)
    blocks = ed.Stacked([block(k) for k in jax.random.split(k2, 4)])
    return embed, blocks, eqx.nn.Linear(64, 4, key=k3)


class _StackedNet(eqx.Module):
    embed: eqx.nn.Linear
    blocks: ed.Stacked
    head: eqx.nn.Linear

    def __init__(self, key: Any) -> None:
        self.embed, self.blocks, self.head = _stack(key, 16, _Block)

    def __call__(self, x: Any) -> Any:
        return self.head(self.blocks(self.embed(x)))


class _BNNet(eqx.Module):
    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, key: Any) -> None:
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(16, 64, key=k1)
        self.bn = eqx.nn.BatchNorm(64, axis_name=("batch", "data"), mode="batch")
        self.l2 = eqx.nn.Linear(64, 4, key=k2)

    def __call__(self, x: Any, state: Any) -> Any:
        h, state = self.bn(jax.nn.relu(self.l1(x)), state)
        return self.l2(h), state


class _MoENet(eqx.Module):
    """An embedding, one `ed.MoE` (top-2 of 8 experts) and a head: the expert
    cases (its experts over an expert axis)."""

    embed: eqx.nn.Linear
    moe: ed.MoE
    head: eqx.nn.Linear

    def __init__(self, key: Any, dispatch: str = "all_gather") -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(16, 32, key=k1)
        self.moe = ed.MoE(32, 64, 8, top_k=2, key=k2, dispatch=dispatch)
        self.head = eqx.nn.Linear(32, 4, key=k3)

    def __call__(self, x: Any) -> Any:
        h = jax.vmap(self.embed)(x)
        y, aux = self.moe(h)
        return jax.vmap(self.head)(h + y), aux["load_balance_loss"]


class _MoEBlock(eqx.Module):
    moe: ed.MoE

    def __init__(self, key: Any) -> None:
        self.moe = ed.MoE(64, 64, 8, top_k=2, key=key)

    def __call__(self, x: Any) -> Any:
        y, aux = self.moe(x)
        return x + y, aux["load_balance_loss"]


class _StackedMoENet(eqx.Module):
    """A `Stacked` of MoE blocks over a row's 4 tokens (a row of 16 features),
    their load-balancing loss the stack's aux."""

    embed: eqx.nn.Linear
    blocks: ed.Stacked
    head: eqx.nn.Linear

    def __init__(self, key: Any) -> None:
        self.embed, self.blocks, self.head = _stack(key, 4, _MoEBlock)

    def __call__(self, x: Any) -> Any:
        h, aux = self.blocks(jax.vmap(self.embed)(x.reshape(4, 4)))
        return jax.vmap(self.head)(h).mean(0), aux.mean()


def _moe_loss(model: Any, batch: Any, key: Any) -> Any:
    # The batch's rows as one token set (the MoE routes them together).
    logits, balance = model(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean() + 0.01 * balance, {"loss": ed.metrics.Mean().update(losses)}


def _stacked_moe_loss(model: Any, batch: Any, key: Any) -> Any:
    logits, balance = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean() + 0.01 * balance.mean(), {}


def _token_loss(model: Any, batch: Any, key: Any) -> Any:
    logits = jax.vmap(jax.vmap(model))(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses.reshape(-1))}


def _mlp(key: Any) -> Any:
    return eqx.nn.MLP(16, 4, 64, 2, key=key)


def _loss(model: Any, batch: Any, key: Any) -> Any:
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {"loss": ed.metrics.Mean().update(losses)}


def _weighted_loss(model: Any, batch: Any, key: Any) -> Any:
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return (losses.sum(), jnp.asarray(losses.shape[0], jnp.float32)), {}


def _bn_loss(model: Any, state: Any, batch: Any, key: Any) -> Any:
    logits, state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(batch["x"], state)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), {}, state


def _eval_fn(model: Any, batch: Any, mask: Any) -> Any:
    logits = jax.vmap(model)(batch["x"])
    return {"accuracy": ed.metrics.Accuracy().update(logits, batch["y"], mask)}


# name: (mesh shape, model, loss, make_train_step options)
CASES: dict[str, tuple[dict[str, int], Callable[[Any], Any], Any, dict[str, Any]]] = {
    "dp": ({"data": 8}, _mlp, _loss, {}),
    "fsdp_gather": (
        {"data": 8},
        _mlp,
        _loss,
        {"strategy": "fsdp", "min_weight_size": 16, "fsdp_linears": "gather"},
    ),
    "fsdp_partition": (
        {"data": 8},
        _mlp,
        _loss,
        {"strategy": "fsdp", "min_weight_size": 16, "fsdp_linears": "partition"},
    ),
    "fsdp_2mb": (
        {"data": 8},
        _mlp,
        _loss,
        {"strategy": "fsdp", "min_weight_size": 16, "num_minibatches": 2},
    ),
    "hsdp": (
        {"replica": 2, "data": 4},
        _mlp,
        _loss,
        {"strategy": "fsdp", "min_weight_size": 16, "data_axis": ("replica", "data")},
    ),
    "tp_dp": ({"data": 4, "model": 2}, _mlp, _loss, {"param_rules": TP_RULES}),
    "tp_fsdp": (
        {"data": 4, "model": 2},
        _mlp,
        _loss,
        {"strategy": "fsdp", "min_weight_size": 16, "param_rules": TP_RULES},
    ),
    "zero1": ({"data": 8}, _mlp, _loss, {"strategy": "zero1", "min_weight_size": 16}),
    "stacked_fsdp": (
        {"data": 8},
        _StackedNet,
        _loss,
        {"strategy": "fsdp", "min_weight_size": 16},
    ),
    "stacked_tp": (
        {"data": 4, "model": 2},
        _StackedNet,
        _loss,
        {"param_rules": [(r"blocks\.layers\.linear\.weight", P(None, "model"))]},
    ),
    "weighted_info_skip": (
        {"data": 8},
        _mlp,
        _weighted_loss,
        {
            "strategy": "fsdp",
            "min_weight_size": 16,
            "step_info": True,
            "skip_nonfinite": True,
        },
    ),
    "batchnorm_fsdp": (
        {"data": 8},
        _BNNet,
        _bn_loss,
        {"strategy": "fsdp", "min_weight_size": 16, "num_minibatches": 2},
    ),
    "gpipe_fsdp": (
        {"stage": 2, "data": 4},
        _StackedNet,
        _loss,
        {
            "strategy": "fsdp",
            "min_weight_size": 16,
            "pipeline": ed.Pipeline("stage", microbatches=4),
        },
    ),
    "one_f_one_b": (
        {"stage": 2, "data": 4},
        _StackedNet,
        _loss,
        {"pipeline": ed.Pipeline("stage", microbatches=4, schedule="1f1b")},
    ),
    "context": (
        {"data": 4, "context": 2},
        _mlp,
        _token_loss,
        {"context_axis": "context"},
    ),
    "experts_dp": ({"data": 8}, _MoENet, _moe_loss, {"expert_axis": "data"}),
    "experts_all_to_all_fsdp": (
        {"data": 8},
        lambda key: _MoENet(key, dispatch="all_to_all"),
        _moe_loss,
        {"expert_axis": "data", "strategy": "fsdp", "min_weight_size": 16},
    ),
    "experts_global": (
        {"data": 8},
        _MoENet,
        _moe_loss,
        {"expert_axis": "data", "view": "global"},
    ),
    "experts_own_axis": (
        {"data": 4, "expert": 2},
        _MoENet,
        _moe_loss,
        {"expert_axis": "expert"},
    ),
    "experts_stacked_1f1b": (
        {"stage": 2, "data": 4},
        _StackedMoENet,
        _stacked_moe_loss,
        {
            "expert_axis": "data",
            "pipeline": ed.Pipeline("stage", microbatches=2, schedule="1f1b"),
        },
    ),
    "experts_stacked_gpipe_global": (
        {"stage": 2, "data": 4},
        _StackedMoENet,
        _stacked_moe_loss,
        {
            "expert_axis": "data",
            "pipeline": ed.Pipeline("stage", microbatches=2),
            "view": "global",
        },
    ),
}

# Cases whose batch is not `_batch()`'s rows: sequences of 8 tokens.
SEQUENCE_CASES = ("context",)


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(32, 16)).astype(np.float32),
        "y": rng.integers(0, 4, 32).astype(np.int32),
    }


def _sequences() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(8, 8, 16)).astype(np.float32),
        "y": rng.integers(0, 4, (8, 8)).astype(np.int32),
    }


# The keywords of `ed.Layout`; a case's other options are the step's.
LAYOUT_KEYWORDS = (
    "strategy",
    "data_axis",
    "param_rules",
    "min_weight_size",
    "fsdp_axis",
    "fsdp_layout",
    "fsdp_gather",
    "fsdp_linears",
    "pipeline",
    "context_axis",
    "expert_axis",
)


def _strip(text: str) -> str:
    """The program without what names Python rather than computes: source
    locations (`loc(...)` and `#loc` lines) and the results' `jax.result_info`
    (the pytree path of each result, e.g. `result[1]['loss']`)."""
    text = re.sub(r"^#loc.*\n", "", text, flags=re.MULTILINE)
    text = re.sub(r'jax\.result_info = "[^"]*", ', "", text)
    return re.sub(r" loc\(#loc\d*\)", "", text)


def lower_case(name: str, explicit: bool, layout: bool = False) -> str:
    shape, make_model, loss, options = CASES[name]
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh(
        tuple(shape.values()), tuple(shape), axis_types=(kind,) * len(shape)
    )
    key = jax.random.key(0)
    if make_model is _BNNet:
        model, model_state = eqx.nn.make_with_state(_BNNet)(key)
    else:
        model, model_state = make_model(key), None
    state = ed.TrainState.create(model, OPTIMIZER, key, model_state=model_state)
    if layout:
        where = {k: v for k, v in options.items() if k in LAYOUT_KEYWORDS}
        rest = {k: v for k, v in options.items() if k not in LAYOUT_KEYWORDS}
        step = ed.make_train_step(loss, OPTIMIZER, ed.Layout(mesh, **where), **rest)
    else:
        step = ed.make_train_step(loss, OPTIMIZER, mesh, **options)
    batch = _sequences() if name in SEQUENCE_CASES else _batch()
    return _strip(step.lower(state, batch).as_text())


def lower_eval(explicit: bool, layout: bool = False) -> str:
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    where = {"strategy": "fsdp", "min_weight_size": 16}
    if layout:
        step = ed.make_eval_step(_eval_fn, ed.Layout(mesh, **where))
    else:
        step = ed.make_eval_step(_eval_fn, mesh, **where)
    return _strip(step.lower(_mlp(jax.random.key(0)), _batch()).as_text())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--mesh", choices=["auto", "explicit"], default="auto")
    parser.add_argument("--case", action="append", choices=[*CASES, "eval"])
    parser.add_argument("--layout", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    explicit = args.mesh == "explicit"
    for name in args.case or [*CASES, "eval"]:
        if name == "eval":
            text = lower_eval(explicit, args.layout)
        else:
            text = lower_case(name, explicit, args.layout)
        (args.out / f"{name}.txt").write_text(text)
        print(f"{name}: {len(text.splitlines())} lines")


if __name__ == "__main__":
    main(sys.argv[1:])
