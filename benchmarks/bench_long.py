"""Long sequences and large vocabularies: context-parallel attention and the two
cross-entropies, against what a user writes without them.

On 8 simulated CPU devices, one process, interleaved repeats, median times:

1. `attention`: the forward and backward pass (`jax.value_and_grad`) of causal
   (and, with `--full`, non-causal) attention of one sequence of growing length
   T, 8 heads of 64, sharded over a context axis of cp = 1, 2, 4, 8 devices:
   cp = 1 is `ed.attention` without `context_axis`
   (`jax.nn.dot_product_attention`); `ring` is `ed.attention(...,
   context_axis="context")` in the global view; `gather` all-gathers the keys
   and values over the axis and computes each device's queries against the
   whole sequence in one block (written here, with its own `custom_vjp` whose
   backward reduce-scatters the keys' and values' gradients): the alternative
   `ed.attention` does not take. Per-device peak bytes from
   `compiled.memory_analysis()` (arguments + outputs + temporaries).
2. `step`: a training step (`make_train_step(..., context_axis="context")`,
   device view, Adam) of a 2-layer transformer of plain `x @ W` arrays on one
   sequence of growing length, on cp = 1, 2, 4, 8 devices: step time and peak
   bytes per device.
3. `losses`: the cross-entropy of a linear head (`hidden @ weight.T`, 4096
   tokens, d_model 256, a vocabulary of 16384), forward and backward:
   Optax on the whole logits on one device; `ed.linear_cross_entropy` (chunks
   of 512 rows) on one device; over a vocabulary sharded on 8 devices,
   `ed.cross_entropy(..., vocab_axis=...)` of the column-parallel head's logits,
   `ed.linear_cross_entropy(..., vocab_axis=...)`, and Optax's loss on the same
   sharded head left to XLA's partitioner. Time, per-device temporaries and the
   collectives of the compiled program.

    python benchmarks/bench_long.py [--quick] [--full] [--repeats 3]

The script sets up 8 simulated CPU devices itself (before JAX starts).
"""

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxdist as ed
from eqxdist._long import blocks

ed.simulate_cpu_devices(8)  # before JAX starts its backend

HEADS, DIM = 8, 64
MiB = 2**20


def time_runs(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each run, interleaved, the order rotating,
    after one warm-up call each."""
    for run in runs.values():
        jax.block_until_ready(run())
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            jax.block_until_ready(runs[name]())
            times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def peak_bytes(compiled: Any) -> int:
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


# --- the all-gather variant -------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gathered(q: Any, k: Any, v: Any, causal: bool, axis: str) -> Any:
    return _gathered_fwd(q, k, v, causal, axis)[0]


def _gathered_parts(q: Any, k: Any, v: Any, causal: bool, axis: str) -> Any:
    keys = jax.lax.all_gather(k, axis, tiled=True)
    values = jax.lax.all_gather(v, axis, tiled=True)
    mask = None
    if causal:
        positions = ed.context_positions(q.shape[0], axis)
        every = jax.lax.all_gather(positions, axis, tiled=True)
        mask = positions[:, None] >= every[None, :]
    return keys, values, mask


def _gathered_fwd(q: Any, k: Any, v: Any, causal: bool, axis: str) -> Any:
    keys, values, mask = _gathered_parts(q, k, v, causal, axis)
    out, lse = blocks.forward(q, keys, values, mask, DIM**-0.5)
    out = out.astype(q.dtype)
    return out, (q, k, v, out, lse)


def _gathered_bwd(causal: bool, axis: str, saved: Any, d_out: Any) -> Any:
    q, k, v, out, lse = saved
    keys, values, mask = _gathered_parts(q, k, v, causal, axis)
    delta = jnp.sum(d_out * out, axis=-1)
    d_q, d_k, d_v = blocks.backward(q, keys, values, mask, DIM**-0.5, d_out, lse, delta)
    d_k = jax.lax.psum_scatter(d_k, axis, tiled=True)
    d_v = jax.lax.psum_scatter(d_v, axis, tiled=True)
    return d_q, d_k, d_v


gathered.defvjp(_gathered_fwd, _gathered_bwd)


def attention_program(length: int, cp: int, variant: str, causal: bool) -> Any:
    """`(run, compiled)`: the value and gradients of a weighted sum of the
    attention output, its inputs placed on the first `cp` devices."""
    mesh = ed.create_device_mesh({"context": cp}, devices=jax.devices()[:cp])
    rng = np.random.default_rng(0)
    shape = (length, HEADS, DIM)
    q, k, v, w = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(4))

    if variant == "one device":

        def attend(q: Any, k: Any, v: Any) -> Any:
            return ed.attention(q, k, v, causal=causal)

    elif variant == "ring":

        def attend(q: Any, k: Any, v: Any) -> Any:
            return ed.attention(q, k, v, causal=causal, context_axis="context")

    else:

        def device(q: Any, k: Any, v: Any) -> Any:
            order = [ed.to_context_order(x, cp) for x in (q, k, v)]
            spec = P("context")
            mapped = jax.shard_map(
                lambda q, k, v: gathered(q, k, v, causal, "context"),
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
            )
            return ed.from_context_order(mapped(*order), cp)

        attend = device

    def loss(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(attend(q, k, v) * w)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    with jax.set_mesh(mesh):
        placed = jax.device_put((q, k, v), NamedSharding(mesh, P("context")))
        compiled = step.lower(*placed).compile()

    def run() -> Any:
        with jax.set_mesh(mesh):
            return compiled(*placed)

    return run, compiled


def attention_rows(lengths: list[int], causal: bool, repeats: int) -> list[str]:
    rows = []
    for length in lengths:
        runs, memory, names = {}, {}, []
        for cp in (1, 2, 4, 8):
            for variant in ("one device",) if cp == 1 else ("ring", "gather"):
                name = f"cp={cp} {variant}"
                run, compiled = attention_program(length, cp, variant, causal)
                runs[name], memory[name] = run, peak_bytes(compiled)
                names.append(name)
        times = time_runs(runs, repeats)
        base = times["cp=1 one device"]
        for name in names:
            row = (
                f"{'causal' if causal else 'full':6s} T={length:5d} {name:18s} "
                f"{times[name] * 1e3:9.1f} ms ({times[name] / base:5.2f}x cp=1)  "
                f"peak {memory[name] / MiB:8.1f} MiB/device"
            )
            print(row, flush=True)
            rows.append(row)
    return rows


# --- a training step -------------------------------------------------------


class StepLM(eqx.Module):
    """Two pre-norm-free blocks of causal attention and an MLP, plain `x @ W`
    arrays, a linear head through `ed.linear_cross_entropy`."""

    embed: jax.Array
    pos: jax.Array
    qkv: jax.Array
    out: jax.Array
    up: jax.Array
    down: jax.Array
    head: jax.Array

    def __init__(self, length: int, vocab: int, width: int, layers: int) -> None:
        rng = np.random.default_rng(0)

        def normal(*shape: int) -> jax.Array:
            return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), jnp.float32)

        self.embed = normal(vocab, width)
        self.pos = normal(length, width)
        self.qkv = normal(layers, width, 3 * width)
        self.out = normal(layers, width, width)
        self.up = normal(layers, width, 4 * width)
        self.down = normal(layers, 4 * width, width)
        self.head = normal(vocab, width)

    def hidden(self, tokens: Any, positions: Any, axis: str) -> Any:
        x = self.embed[tokens] + self.pos[positions]
        width = x.shape[-1]
        heads = (*tokens.shape, width // DIM, DIM)

        @jax.vmap
        def attend(q: Any, k: Any, v: Any) -> Any:
            return ed.attention(q, k, v, causal=True, context_axis=axis)

        for qkv, out, up, down in zip(
            self.qkv, self.out, self.up, self.down, strict=True
        ):
            q, k, v = (a.reshape(heads) for a in jnp.split(x @ qkv, 3, axis=-1))
            x = x + attend(q, k, v).reshape(x.shape) @ out
            x = x + jax.nn.gelu(x @ up) @ down
        return x


def step_rows(lengths: list[int], repeats: int) -> list[str]:
    """A train step (`make_train_step(..., context_axis="context")`, device view,
    Adam) of `StepLM` on one sequence of each length, on cp = 1, 2, 4, 8 devices
    (the first cp of the 8): step time and peak bytes per device."""
    vocab, width, layers = 1024, 2 * DIM, 2

    def loss(model: Any, batch: Any, key: Any) -> Any:
        tokens = batch["tokens"]
        positions = ed.context_positions(tokens.shape[1], "context")
        h = model.hidden(tokens, positions, "context")
        return ed.linear_cross_entropy(h, model.head, batch["targets"]), {}

    rows = []
    for length in lengths:
        text = np.random.default_rng(1).integers(0, vocab, (1, length + 1))
        batch = {"tokens": text[:, :-1], "targets": text[:, 1:]}
        runs, memory = {}, {}
        for cp in (1, 2, 4, 8):
            mesh = ed.create_device_mesh({"context": cp}, devices=jax.devices()[:cp])
            optimizer = optax.adam(1e-3)
            step = ed.make_train_step(loss, optimizer, mesh, context_axis="context")
            model = StepLM(length, vocab, width, layers)
            state = step.place_state(
                ed.TrainState.create(model, optimizer, jax.random.key(0))
            )
            memory[cp] = peak_bytes(step.lower(state, batch).compile())
            holder = {"state": state}

            def run(step: Any = step, holder: Any = holder, batch: Any = batch) -> Any:
                holder["state"], _ = step(holder["state"], batch)
                return holder["state"]  # waited on: the metrics are empty

            runs[cp] = run
        times = time_runs(runs, repeats)
        for cp in runs:
            row = (
                f"step   T={length:5d} cp={cp}  {times[cp] * 1e3:9.1f} ms "
                f"({times[cp] / times[1]:5.2f}x cp=1)  peak "
                f"{memory[cp] / MiB:8.1f} MiB/device ({memory[cp] / memory[1]:4.2f}x)"
            )
            print(row, flush=True)
            rows.append(row)
    return rows


# --- the losses -------------------------------------------------------------


def loss_rows(quick: bool, repeats: int) -> list[str]:
    tokens, d_model, vocab = (1024, 128, 4096) if quick else (4096, 256, 16384)
    chunk = 128 if quick else 512
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(tokens, d_model)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(vocab, d_model)) * 0.05, jnp.float32)
    labels = jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32)
    mesh = ed.create_device_mesh({"model": 8})

    def optax_loss(h: Any, w: Any, y: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(h @ w.T, y).sum()

    def linear(h: Any, w: Any, y: Any, axis: Any = None) -> Any:
        return ed.linear_cross_entropy(h, w, y, vocab_axis=axis, chunk_size=chunk)[0]

    def sharded(h: Any, w: Any, y: Any) -> Any:
        return ed.cross_entropy(h @ w.T, y, vocab_axis="model")[0]

    variants = {
        "optax, whole logits, 1 device": (optax_loss, None),
        f"linear_cross_entropy, chunks of {chunk}, 1 device": (linear, None),
        "optax, head sharded on 8 (GSPMD)": (optax_loss, mesh),
        "cross_entropy, vocab-parallel on 8": (sharded, mesh),
        "linear_cross_entropy, vocab-parallel on 8": (
            functools.partial(linear, axis="model"),
            mesh,
        ),
    }
    runs, facts = {}, {}
    for name, (fn, on) in variants.items():
        step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
        if on is None:
            args: tuple[Any, ...] = (hidden, weight, labels)
            compiled = step.lower(*args).compile()
            runs[name] = functools.partial(compiled, *args)
        else:
            with jax.set_mesh(on):
                args = (
                    jax.device_put(hidden, NamedSharding(on, P())),
                    jax.device_put(weight, NamedSharding(on, P("model"))),
                    jax.device_put(labels, NamedSharding(on, P())),
                )
                compiled = step.lower(*args).compile()

            def run(compiled: Any = compiled, args: Any = args, on: Any = on) -> Any:
                with jax.set_mesh(on):
                    return compiled(*args)

            runs[name] = run
        counts = {k: n for k, n in ed.count_collectives(compiled).items() if n}
        temp = compiled.memory_analysis().temp_size_in_bytes
        facts[name] = (temp, counts)
    times = time_runs(runs, repeats)
    base = times["optax, whole logits, 1 device"]
    logits = tokens * vocab * 4
    rows = [f"logits: {tokens} x {vocab} float32 = {logits / MiB:.1f} MiB"]
    print(rows[0], flush=True)
    for name in variants:
        temp, counts = facts[name]
        row = (
            f"{name:45s} {times[name] * 1e3:8.1f} ms ({times[name] / base:4.2f}x "
            f"optax)  temporaries {temp / MiB:7.1f} MiB/device "
            f"({temp / logits:4.2f}x logits)  {counts or 'no collectives'}"
        )
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a minute")
    parser.add_argument("--full", action="store_true", help="non-causal too")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=("attention", "step", "losses"), default=None)
    args = parser.parse_args()
    lengths = [512, 1024] if args.quick else [1024, 2048, 4096]
    if args.only in (None, "attention"):
        for causal in (True, False) if args.full else (True,):
            attention_rows(lengths, causal, args.repeats)
    if args.only in (None, "step"):
        step_rows([1024, 2048] if args.quick else [2048, 4096, 8192], args.repeats)
    if args.only in (None, "losses"):
        loss_rows(args.quick, args.repeats)


if __name__ == "__main__":
    main()
