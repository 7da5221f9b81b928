"""Parts of a model with optimizers of their own (`TrainState.create(...,
parts=...)`, `make_train_step(..., part=...)`): a small GAN's discriminator and
generator steps alternating on one state on 8 simulated devices, under every
strategy and either view, against the single-device program in plain Equinox
and Optax with one optimizer per part (float32, 1e-5); the part a step does
not train, and its optimizer state, left bit-identical; donation and
checkpoints across the parts; the mistakes a user can make."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import max_diff

import eqxdist as ed

LATENT = 4
PARTS = {"gen": lambda m: m.gen, "disc": lambda m: m.disc}
OPTIMIZERS = {"disc": optax.sgd(0.1, momentum=0.9), "gen": optax.sgd(0.05)}


class Pair(eqx.Module):
    gen: eqx.nn.MLP
    disc: eqx.nn.MLP

    def __init__(self, key=jax.random.key(0)):
        k1, k2 = jax.random.split(key)
        self.gen = eqx.nn.MLP(LATENT, 8, 16, 1, key=k1)
        self.disc = eqx.nn.MLP(8, "scalar", 16, 1, key=k2)


def _data(steps=3, rows=32):
    rng = np.random.default_rng(3)
    return [
        {
            "x": rng.normal(size=(rows, 8)).astype(np.float32),
            "z": rng.normal(size=(rows, LATENT)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def _noise(batch, key):
    """The batch's noise, or with `key` noise of the batch's shape from it (the
    global view: one key for every row, as on one device)."""
    if key is None:
        return batch["z"]
    return jax.random.normal(key, batch["z"].shape)


def disc_loss(model, batch, key, *, keyed=False):
    fake = jax.vmap(model.gen)(_noise(batch, key if keyed else None))
    real_logits = jax.vmap(model.disc)(batch["x"])
    fake_logits = jax.vmap(model.disc)(jax.lax.stop_gradient(fake))
    loss = jnp.mean(jax.nn.softplus(-real_logits)) + jnp.mean(
        jax.nn.softplus(fake_logits)
    )
    return loss, {"loss": ed.metrics.Mean().update(loss)}


def gen_loss(model, batch, key, *, keyed=False):
    fake = jax.vmap(model.gen)(_noise(batch, key if keyed else None))
    loss = jnp.mean(jax.nn.softplus(-jax.vmap(model.disc)(fake)))
    return loss, {"loss": ed.metrics.Mean().update(loss)}


def keyed(loss):
    return lambda model, batch, key: loss(model, batch, key, keyed=True)


def one_device(data, losses, key=jax.random.key(1)):
    """Plain Equinox and Optax: for each batch, each part's step in turn, part
    step `i` with the key `fold_in(key, i)` (each part step advances
    `state.step`)."""
    model = Pair()
    opt_states = {
        name: OPTIMIZERS[name].init(eqx.filter(where(model), eqx.is_inexact_array))
        for name, where in PARTS.items()
    }
    i = 0
    for batch in data:
        for name, loss in losses:
            where, step_key = PARTS[name], jax.random.fold_in(key, i)

            def part_loss(part, model, batch, where=where, loss=loss, key=step_key):
                return loss(eqx.tree_at(where, model, part), batch, key)[0]

            grads = eqx.filter_grad(part_loss)(where(model), model, batch)
            params = eqx.filter(where(model), eqx.is_inexact_array)
            updates, opt_states[name] = OPTIMIZERS[name].update(
                grads, opt_states[name], params
            )
            model = eqx.tree_at(where, model, eqx.apply_updates(where(model), updates))
            i += 1
    return model, opt_states


LAYOUTS = {
    "dp": ({"data": 8}, {}),
    "zero1": ({"data": 8}, {"strategy": "zero1", "min_weight_size": 16}),
    "fsdp": ({"data": 8}, {"strategy": "fsdp", "min_weight_size": 16}),
    "hsdp": (
        {"replica": 2, "data": 4},
        {"strategy": "fsdp", "min_weight_size": 16, "data_axis": ("replica", "data")},
    ),
}


def _steps(layout, view, losses=(disc_loss, gen_loss), axis_types="auto"):
    shape, options = LAYOUTS[layout]
    mesh = ed.create_device_mesh(shape, axis_types=axis_types)
    return [
        ed.make_train_step(loss, OPTIMIZERS, mesh, part=name, view=view, **options)
        for name, loss in zip(("disc", "gen"), losses, strict=True)
    ]


def _state():
    return ed.TrainState.create(Pair(), OPTIMIZERS, jax.random.key(1), parts=PARTS)


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _host(tree):
    return jax.tree.map(np.array, eqx.filter(tree, eqx.is_array))


def _same_bits(a, b):
    return all(
        np.array_equal(x, y, equal_nan=True)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("view", ["device", "global"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_alternating_parts_equal_one_device(layout, view):
    data = _data()
    model, opt_states = one_device(data, [("disc", disc_loss), ("gen", gen_loss)])
    step_d, step_g = _steps(layout, view)
    state = _state()
    for batch in data:
        for step, name, other in ((step_d, "disc", "gen"), (step_g, "gen", "disc")):
            before = _host((PARTS[other](state.model), state.opt_state[other]))
            state, metrics = step(state, batch)
            after = _host((PARTS[other](state.model), state.opt_state[other]))
            # The part the step does not train, and its optimizer's state,
            # come back bit-identical.
            assert _same_bits(before, after), (name, other)
            assert np.isfinite(float(metrics["loss"].compute()))
    assert int(state.step) == 2 * len(data)
    assert max_diff(state.model, model) < 1e-5
    assert max_diff(state.opt_state, opt_states) < 1e-5  # the momentum's trace


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
def test_noise_from_the_key_in_the_global_view(layout):
    """Noise of the batch's shape from the step's key: one key for every row, as
    on one device, only in the global view."""
    data = _data(steps=2)
    losses = [("disc", keyed(disc_loss)), ("gen", keyed(gen_loss))]
    model, _ = one_device(data, losses)
    step_d, step_g = _steps(layout, "global", (keyed(disc_loss), keyed(gen_loss)))
    state = _state()
    for batch in data:
        state, _ = step_d(state, batch)
        state, _ = step_g(state, batch)
    assert max_diff(state.model, model) < 1e-5


def test_explicit_mesh_parts_equal_one_device():
    data = _data(steps=2)
    model, _ = one_device(data, [("disc", disc_loss), ("gen", gen_loss)])
    step_d, step_g = _steps("fsdp", "device", axis_types="explicit")
    state = _state()
    for batch in data:
        state, _ = step_d(state, batch)
        state, _ = step_g(state, batch)
    assert max_diff(state.model, model) < 1e-5


def test_part_steps_donate_each_others_states_and_checkpoint(tmp_path):
    data = _data(steps=2)
    step_d, step_g = _steps("fsdp", "device")
    state = _state()
    state, _ = step_d(state, data[0])
    # A state that came out of the discriminator's step goes into the
    # generator's as it is, and back: the trained part's buffers and its
    # optimizer state's are donated, the other part's come back as the same
    # arrays; nothing is copied first.
    turns = ((step_g, "gen", "disc", data[0]), (step_d, "disc", "gen", data[1]))
    for step, name, other, batch in turns:
        trained = _arrays((PARTS[name](state.model), state.opt_state[name]))
        kept = _arrays((PARTS[other](state.model), state.opt_state[other]))
        state, _ = step(state, batch)
        assert trained and all(leaf.is_deleted() for leaf in trained)
        now = _arrays((PARTS[other](state.model), state.opt_state[other]))
        assert all(a is b for a, b in zip(kept, now, strict=True))

    # One checkpoint holds every part and its optimizer state; a restored state
    # trains on as the one saved.
    ed.save_checkpoint(tmp_path, state, step=3)
    target = step_g.place_state(_state())  # a fresh state, laid out as trained
    restored = ed.restore_checkpoint(tmp_path, target)
    assert restored.parts == state.parts
    assert max_diff(restored, state) == 0.0
    state, _ = step_g(state, data[1])
    restored, _ = step_g(restored, data[1])
    assert max_diff(restored, state) == 0.0
    model, _ = one_device(data, [("disc", disc_loss), ("gen", gen_loss)])
    assert max_diff(state.model, model) < 1e-5


def test_mistakes_with_parts_are_clear_errors():
    mesh = ed.create_data_parallel_mesh()
    with pytest.raises(TypeError, match=r"`part`='disc' is given with a single"):
        ed.make_train_step(disc_loss, optax.sgd(0.1), mesh, part="disc")
    with pytest.raises(TypeError, match=r"dict of parts \(\['disc', 'gen'\]\) but no"):
        ed.make_train_step(disc_loss, OPTIMIZERS, mesh)
    with pytest.raises(ValueError, match=r"`part`='critic' is not one of"):
        ed.make_train_step(disc_loss, OPTIMIZERS, mesh, part="critic")

    create = ed.TrainState.create
    with pytest.raises(ValueError, match=r"parts 'gen' and 'all' overlap"):
        create(
            Pair(), {"gen": optax.sgd(0.1), "all": optax.sgd(0.1)}, jax.random.key(0),
            parts={"gen": lambda m: m.gen, "all": lambda m: m},
        )  # fmt: skip
    with pytest.raises(TypeError, match=r"one optimizer per part"):
        create(Pair(), optax.sgd(0.1), jax.random.key(0), parts=PARTS)
    with pytest.raises(TypeError, match=r"`optimizer` is a dict .* but no parts"):
        create(Pair(), OPTIMIZERS, jax.random.key(0))
    with pytest.raises(ValueError, match=r"part 'gen': `where` does not select"):
        create(
            Pair(), OPTIMIZERS, jax.random.key(0),
            parts={"gen": lambda m: m.generator, "disc": lambda m: m.disc},
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"part 'gen' holds no array"):
        create(
            Pair(), OPTIMIZERS, jax.random.key(0),
            parts={"gen": lambda m: m.gen.activation, "disc": lambda m: m.disc},
        )  # fmt: skip

    # A step of parts and a state without them, or with other parts.
    step_d = ed.make_train_step(disc_loss, OPTIMIZERS, mesh, part="disc")
    plain = ed.TrainState.create(Pair(), optax.sgd(0.1), jax.random.key(0))
    with pytest.raises(ValueError, match=r"step has the parts \['disc', 'gen'\].*"):
        step_d(plain, _data(steps=1)[0])
    other = {"disc": optax.sgd(0.1), "critic": optax.sgd(0.1)}
    state = ed.TrainState.create(
        Pair(), other, jax.random.key(0),
        parts={"disc": lambda m: m.disc, "critic": lambda m: m.gen},
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"the state \['critic', 'disc'\]"):
        step_d(state, _data(steps=1)[0])
    with pytest.raises(ValueError, match=r"part 'gen' is asked for, but this state"):
        plain.params("gen")


def test_train_loop_runs_the_part_steps_in_turn_and_resumes(tmp_path):
    """`ed.train_loop` with `{"disc": step_d, "gen": step_g}`: each loop step
    calls both in turn; their metrics logged apart; stopped and resumed from its
    checkpoint, it ends where one device does."""
    data = _data(steps=3)
    model, _ = one_device(data, [("disc", disc_loss), ("gen", gen_loss)])
    step_d, step_g = _steps("fsdp", "device")
    steps = {"disc": step_d, "gen": step_g}
    with ed.CheckpointManager(tmp_path, save_interval_steps=100) as manager:
        first = ed.train_loop(
            steps, _state(), lambda s: data[s], 3, checkpoints=manager, stop_at=2,
            log_every=1, progress=False,
        )  # fmt: skip
        assert first.step == 2 and int(first.state.step) == 4
        assert set(first.logs[-1][1]) >= {"disc/loss", "gen/loss"}
    with ed.CheckpointManager(tmp_path, save_interval_steps=100) as manager:
        second = ed.train_loop(
            steps, _state(), lambda s: data[s], 3, checkpoints=manager, progress=False
        )
    assert second.start_step == 2 and second.step == 3
    assert int(second.state.step) == 6
    assert max_diff(second.state.model, model) < 1e-5
