"""A DCGAN on scikit-learn's digits with eqxdist's parts, on 8 simulated CPU devices.

Equinox's deep-convolutional GAN example, ported: a generator and a discriminator
(transposed and plain convolutions with BatchNorm) in one model, each with an
optimizer of its own (`TrainState.create(..., parts=...)`), trained by two steps
that alternate on one state (`make_train_step(..., part="disc")` and
`part="gen"`), both driven by `ed.train_loop`, with checkpoints. The losses draw
noise of the batch's shape from the step's key and the BatchNorm layers name only
the loss's own `vmap` axis: written as for one device, they run in the global
view (`view="global"`), where they mean what they mean on one device. `--check`
trains the same steps with plain Equinox and Optax on one device, prints how far
the parameters are apart, the tolerance and whether they agree (exit status 1
if not). They are not bit-identical: sums in another order round differently,
and a GAN's training grows the difference. With `--optimizer sgd` it is about
1e-7 after 3 steps and 4.8e-5 after the default 60 (tolerance 5e-4; the device
view, another program, ends 3.2e-3 away). Adam's first steps move every
parameter by about the learning rate whatever the gradient's size, so a rounding
difference in a gradient element near zero flips its step: after 60 steps the
two are 2.7e-2 apart, 13 learning rates (tolerance 25 learning rates; the device
view ends 0.15 away). The difference grows with the steps: the tolerances are
for the default 60 or fewer.

    python examples/dcgan.py [--steps 60] [--strategy fsdp] [--check]
"""

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqxdist as ed

LATENT = 16


class Generator(eqx.Module):
    layers: list[Any]

    def __init__(self, key: Any) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.ConvTranspose2d(LATENT, 64, 2, key=k1),  # (64, 2, 2)
            eqx.nn.BatchNorm(64, axis_name="batch", mode="batch"),
            eqx.nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1, key=k2),
            eqx.nn.BatchNorm(32, axis_name="batch", mode="batch"),  # (32, 4, 4)
            eqx.nn.ConvTranspose2d(32, 1, 4, stride=2, padding=1, key=k3),
        ]

    def __call__(self, z: Any, state: Any) -> tuple[Any, Any]:
        x = z.reshape(LATENT, 1, 1)
        for layer in self.layers[:-1]:
            if isinstance(layer, eqx.nn.BatchNorm):
                x, state = layer(x, state)
                x = jax.nn.relu(x)
            else:
                x = layer(x)
        return jnp.tanh(self.layers[-1](x)), state  # (1, 8, 8), in [-1, 1]


class Discriminator(eqx.Module):
    layers: list[Any]

    def __init__(self, key: Any) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.Conv2d(1, 32, 4, stride=2, padding=1, key=k1),  # (32, 4, 4)
            eqx.nn.Conv2d(32, 64, 4, stride=2, padding=1, key=k2),  # (64, 2, 2)
            eqx.nn.BatchNorm(64, axis_name="batch", mode="batch"),
            eqx.nn.Conv2d(64, 1, 2, key=k3),  # (1, 1, 1)
        ]

    def __call__(self, image: Any, state: Any) -> tuple[Any, Any]:
        x = jax.nn.leaky_relu(self.layers[0](image), 0.2)
        x, state = self.layers[2](self.layers[1](x), state)
        return self.layers[3](jax.nn.leaky_relu(x, 0.2)).reshape(()), state


class GAN(eqx.Module):
    generator: Generator
    discriminator: Discriminator

    def __init__(self, key: Any) -> None:
        k1, k2 = jax.random.split(key)
        self.generator = Generator(k1)
        self.discriminator = Discriminator(k2)


PARTS = {"gen": lambda m: m.generator, "disc": lambda m: m.discriminator}


def _batched(module: Any, x: Any, state: Any) -> tuple[Any, Any]:
    """`module` over the rows of `x`; BatchNorm statistics over all of them."""
    return jax.vmap(module, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x, state
    )


def disc_loss(model: GAN, state: Any, batch: Any, key: Any) -> Any:
    """The discriminator's loss: real digits as 1, generated ones as 0."""
    noise = jax.random.normal(key, (batch["image"].shape[0], LATENT))
    fake, state = _batched(model.generator, noise, state)
    real_logits, state = _batched(model.discriminator, batch["image"], state)
    fake_logits, state = _batched(
        model.discriminator, jax.lax.stop_gradient(fake), state
    )
    loss = (
        optax.sigmoid_binary_cross_entropy(real_logits, 1.0).mean()
        + optax.sigmoid_binary_cross_entropy(fake_logits, 0.0).mean()
    )
    return loss, {"loss": ed.metrics.Mean().update(loss)}, state


def gen_loss(model: GAN, state: Any, batch: Any, key: Any) -> Any:
    """The generator's loss: generated digits the discriminator takes as real."""
    noise = jax.random.normal(key, (batch["image"].shape[0], LATENT))
    fake, state = _batched(model.generator, noise, state)
    logits, state = _batched(model.discriminator, fake, state)
    loss = optax.sigmoid_binary_cross_entropy(logits, 1.0).mean()
    return loss, {"loss": ed.metrics.Mean().update(loss)}, state


def optimizers(args: argparse.Namespace) -> dict[str, Any]:
    if args.optimizer == "sgd":
        return {name: optax.sgd(args.lr) for name in PARTS}
    return {name: optax.adam(args.lr, b1=0.5) for name in PARTS}


def digits() -> np.ndarray:
    from sklearn.datasets import load_digits

    images = load_digits().images.astype(np.float32)  # (1797, 8, 8), 0..16
    return (images[:, None] / 8.0 - 1.0).astype(np.float32)  # (1797, 1, 8, 8)


def single_device(args: argparse.Namespace, images: np.ndarray) -> GAN:
    """The same training in plain Equinox and Optax on one device: step `s`'s
    batch, the discriminator's key `fold_in(key, 2s)`, the generator's
    `fold_in(key, 2s + 1)` (each step of a part advances `state.step`)."""
    model, state = eqx.nn.make_with_state(GAN)(jax.random.key(args.seed))
    opts = optimizers(args)
    parts = {name: where(model) for name, where in PARTS.items()}
    opt_states = {
        name: opts[name].init(eqx.filter(part, eqx.is_inexact_array))
        for name, part in parts.items()
    }
    key = jax.random.key(args.seed + 1)
    loader = ed.BatchLoader(
        {"image": images}, args.batch_size, ed.create_data_parallel_mesh(1), seed=0
    )

    @eqx.filter_jit
    def part_step(model, state, opt_state, batch, key, name, loss_fn):  # type: ignore[no-untyped-def]
        where = PARTS[name]

        def loss(part: Any) -> Any:
            value, _, new_state = loss_fn(
                eqx.tree_at(where, model, part), state, batch, key
            )
            return value, new_state

        grads, state = eqx.filter_grad(loss, has_aux=True)(where(model))
        params = eqx.filter(where(model), eqx.is_inexact_array)
        updates, opt_state = opts[name].update(grads, opt_state, params)
        return (
            eqx.tree_at(where, model, eqx.apply_updates(where(model), updates)),
            state,
            opt_state,
        )

    for s in range(args.steps):
        batch = jax.device_get(loader.batch(s))
        for i, (name, loss_fn) in enumerate([("disc", disc_loss), ("gen", gen_loss)]):
            model, state, opt_states[name] = part_step(
                model, state, opt_states[name], batch,
                jax.random.fold_in(key, 2 * s + i), name, loss_fn,
            )  # fmt: skip
    return model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=60, help="loop steps (D then G)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate")
    parser.add_argument(
        "--optimizer", choices=["adam", "sgd"], default="adam",
        help="adam (b1 0.5, as the original) or plain SGD",
    )  # fmt: skip
    parser.add_argument("--strategy", choices=["dp", "fsdp"], default="dp")
    parser.add_argument(
        "--view", choices=["global", "device"], default="global",
        help="the loss on the whole batch, or per device (then noise and BatchNorm "
        "statistics are per device: not the single-device program)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/dcgan", help="checkpoints and logs")
    parser.add_argument(
        "--check", action="store_true", help="compare with one device, plain Equinox"
    )
    args = parser.parse_args()

    ed.simulate_cpu_devices(8)
    mesh = ed.create_data_parallel_mesh()
    images = digits()
    opts = optimizers(args)
    layout = {"strategy": args.strategy, "view": args.view}
    if args.strategy == "fsdp":
        layout["min_weight_size"] = 2**10
    steps = {
        "disc": ed.make_train_step(disc_loss, opts, mesh, part="disc", **layout),
        "gen": ed.make_train_step(gen_loss, opts, mesh, part="gen", **layout),
    }
    model, model_state = eqx.nn.make_with_state(GAN)(jax.random.key(args.seed))
    state = ed.TrainState.create(
        model, opts, jax.random.key(args.seed + 1), model_state=model_state, parts=PARTS
    )
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    loader = ed.BatchLoader({"image": images}, args.batch_size, mesh, seed=0)
    with (
        ed.CheckpointManager(out / "checkpoints", max_to_keep=2) as checkpoints,
        ed.JsonlWriter(out / "metrics.jsonl") as writer,
    ):
        result = ed.train_loop(
            steps, state, loader, args.steps, writer=writer, log_every=10,
            checkpoints=checkpoints, progress=False,  # shows disc/loss, gen/loss
        )  # fmt: skip
    last = result.logs[-1][1]
    print(
        f"after {result.step} steps ({int(result.state.step)} part steps): "
        f"discriminator loss {last['disc/loss']:.4f}, "
        f"generator loss {last['gen/loss']:.4f}"
    )
    if args.check and not check(args, result.state.model, images):
        sys.exit(1)


def check(args: argparse.Namespace, model: GAN, images: np.ndarray) -> bool:
    """Whether `model` agrees with the same training on one device, within the
    rounding drift the docstring measures (SGD: 5e-4; Adam: 25 learning rates)."""
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(
            jax.tree.leaves(eqx.filter(model, eqx.is_array)),
            jax.tree.leaves(eqx.filter(single_device(args, images), eqx.is_array)),
            strict=True,
        )
    )
    tolerance = 5e-4 if args.optimizer == "sgd" else 25 * args.lr
    agree = diff <= tolerance
    print(
        f"largest parameter difference from one device: {diff:.2e} (tolerance "
        f"{tolerance:.0e}, {args.optimizer}): "
        + ("parameters agree" if agree else "parameters DISAGREE")
    )
    return agree


if __name__ == "__main__":
    main()
