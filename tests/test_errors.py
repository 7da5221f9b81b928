"""Caller mistakes across the public API (meshes, placement, reductions,
multi-process start-up, checkpoints): each is a `ValueError`/`TypeError` whose
message names the argument or leaf path, the value seen and what was expected --
never a raw JAX, NumPy, Orbax or OS error.

One table: (id, call, exception type, pattern the message must match). The metric
and train-step mistakes are tested with their modules (tests/metrics/test_metrics.py,
tests/step/test_train_step.py)."""

import contextlib
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxdist as ed

STRINGS = np.array(["cat", "dog"])
OBJECTS = np.array([None, 1], dtype=object)
KEYS = jax.random.split(jax.random.key(0), 8)


SGD = optax.sgd(0.1)


def no_loss(model, batch, key):
    return jnp.zeros(()), {}


def mesh():
    return ed.create_data_parallel_mesh()


def in_shard_map(fn, x):
    return jax.shard_map(fn, mesh=mesh(), in_specs=P("data"), out_specs=P())(x)


@contextlib.contextmanager
def launch_environment(coordinator):
    names = ("EQXDIST_COORDINATOR", "EQXDIST_NUM_PROCESSES", "EQXDIST_PROCESS_ID")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(dict(zip(names, (coordinator, "2", "0"), strict=True)))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def initialize_with(coordinator):
    with launch_environment(coordinator):
        ed.initialize_distributed()


def train_with(loss_fn):
    """One train step of a small linear model with `loss_fn`."""
    model = eqx.nn.Linear(4, 1, key=jax.random.key(0))
    step = ed.make_train_step(loss_fn, SGD, mesh())
    state = ed.TrainState.create(model, SGD, jax.random.key(1))
    return step(state, {"x": jnp.ones((8, 4))})


def squares(model, batch, key):
    return jnp.mean(jax.vmap(model)(batch["x"]) ** 2)


def stacked(blocks):
    return ed.Stacked(blocks)


LINEAR = eqx.nn.Linear(4, 4, key=jax.random.key(0))


def save_into(tmp, state, **kwargs):
    return ed.save_checkpoint(tmp, state, step=1, **kwargs)


LEAF = r"leaf \['x'\] is a NumPy array of dtype"
CASES = [
    # -- meshes
    (
        "duplicate devices",
        lambda t: ed.create_device_mesh({"data": 2}, devices=[jax.devices()[0]] * 2),
        ValueError,
        r"create_device_mesh: `devices` lists cpu:0 twice \(at positions 0 and 1\)",
    ),
    (
        "duplicate devices in a manager",
        lambda t: ed.compat.DeviceMeshManager([jax.devices()[1], jax.devices()[1]]),
        ValueError,
        r"DeviceMeshManager: `devices` lists cpu:1 twice",
    ),
    (
        "a manager of non-devices",
        lambda t: ed.compat.DeviceMeshManager([0, 1]),
        TypeError,
        # (Under pytest, jaxtyping's import hook checks the annotation first.)
        r"(?s)(`devices\[0\]` is 0 of type int; expected a `jax.Device`|"
        r"parameter 'devices'.*\[0, 1\].*Device)",
    ),
    (
        "a bool axis size",
        lambda t: ed.create_device_mesh({"data": True}),
        TypeError,
        r"size of axis 'data' must be an int; got True",
    ),
    (
        "a string for a mesh",
        lambda t: ed.get_mesh_info("mesh"),
        TypeError,
        r"(?s)parameter 'mesh'.*'mesh'.*Mesh",
    ),
    # -- the steps' and the loader's first arguments (v0.3's checks, kept)
    (
        "a number for loss_fn",
        lambda t: ed.make_train_step(1, SGD, mesh()),
        TypeError,
        r"make_train_step: `loss_fn` must be a function `loss_fn\(model, batch, "
        r"key\) -> \(loss, metrics\)`; got int 1\.",
    ),
    (
        "an axis name for the train step's mesh",
        lambda t: ed.make_train_step(no_loss, SGD, "data"),
        TypeError,
        r"make_train_step: `layout` must be an ed.Layout or a jax.sharding.Mesh; got "
        r"str 'data'\. Build one, e.g. `ed.Layout\(ed.create_device_mesh\(\{'data': "
        r"8\}\)",
    ),
    (
        "a number for an optimizer",
        lambda t: ed.make_train_step(no_loss, 1, mesh()),
        TypeError,
        r"make_train_step: `optimizer` must be an Optax gradient transformation.*"
        r"optax.adamw\(1e-3\).*got int 1\.",
    ),
    (
        "a dict of optimizers without a part",
        lambda t: ed.make_train_step(no_loss, {"g": SGD}, mesh()),
        TypeError,
        r"make_train_step: `optimizer` is a dict of parts \(\['g'\]\).*part='g'",
    ),
    (
        "a number for eval_fn",
        lambda t: ed.make_eval_step(1, mesh()),
        TypeError,
        r"make_eval_step: `eval_fn` must be a function `eval_fn\(model, batch, "
        r"mask\) -> metrics`; got int 1\.",
    ),
    (
        "an axis name for the eval step's mesh",
        lambda t: ed.make_eval_step(no_loss, "data"),
        TypeError,
        r"make_eval_step: `layout` must be an ed.Layout or a jax.sharding.Mesh; got "
        r"str 'data'\.",
    ),
    (
        "a mesh given by keyword as None",
        lambda t: ed.make_eval_step(no_loss, mesh=None),
        TypeError,
        r"make_eval_step: `mesh` must be an ed.Layout or a jax.sharding.Mesh; got "
        r"NoneType None",
    ),
    (
        "an axis name for the loader's mesh",
        lambda t: ed.BatchLoader({"x": np.zeros((8, 2))}, 8, "rows"),
        TypeError,
        r"BatchLoader: `layout` must be an ed.Layout or a jax.sharding.Mesh; got str "
        r"'rows'\. Build one, e.g. `ed.Layout\(ed.create_device_mesh\(\{'rows': "
        r"8\}\)",
    ),
    (
        "a typo of the data axis",
        lambda t: ed.make_train_step(no_loss, SGD, mesh(), data_axis="dta"),
        ValueError,
        r"make_train_step: `data_axis`='dta' is not an axis of the mesh; the mesh's "
        r"axes are \('data',\); did you mean 'data'\?",
    ),
    # -- placement
    (
        "strings in shard_batch",
        lambda t: ed.shard_batch(
            {"x": STRINGS[[0, 1] * 4]}, ed.create_data_parallel_sharding(mesh())
        ),
        TypeError,
        r"shard_batch: `batch` " + LEAF + r" <U3 \(\['cat', 'dog', 'cat', \.\.\.\]\); "
        r"expected a numeric or bool array",
    ),
    (
        "objects in shard_batch",
        lambda t: ed.shard_batch(
            {"x": OBJECTS}, ed.create_data_parallel_sharding(mesh())
        ),
        TypeError,
        r"shard_batch: `batch` " + LEAF + r" object \(\[None, 1\]\)",
    ),
    (
        "strings in replicate_params",
        lambda t: ed.replicate_params({"x": STRINGS}, mesh()),
        TypeError,
        r"replicate_params: `params` " + LEAF + " <U3",
    ),
    (
        "objects in shard_model_state",
        lambda t: ed.shard_model_state({"x": OBJECTS}, mesh(), "shard"),
        TypeError,
        r"shard_model_state: `state` " + LEAF + " object",
    ),
    (
        "a string for a mesh in replicate_params",
        lambda t: ed.replicate_params({"x": jnp.ones(2)}, "mesh"),
        TypeError,
        r"parameter 'mesh'",
    ),
    (
        "a non-string data axis",
        lambda t: ed.compat.DataParallel(data_axis=3),
        TypeError,
        r"(?s)(DataParallel: `data_axis` must be a mesh axis name .*; got 3|"
        r"parameter 'data_axis'.*Actual value: 3.*str)",
    ),
    (
        "keys in all_reduce_gradients",
        lambda t: in_shard_map(lambda k: ed.all_reduce_gradients({"x": k})["x"], KEYS),
        TypeError,
        r"all_reduce_gradients: `gradients` leaf \['x'\] is an array of PRNG keys "
        r"\(key<fry>\); keys cannot be reduced",
    ),
    # -- reductions
    *[
        (
            f"strings in global {name}",
            lambda t, name=name: getattr(ed, name)({"x": STRINGS}, axis_name=None),
            TypeError,
            rf"{name}: `metrics` " + LEAF + " <U3",
        )
        for name in ("reduce_mean", "reduce_sum", "reduce_max", "reduce_min")
    ],
    (
        "objects in global reduce_custom",
        lambda t: ed.reduce_custom({"x": OBJECTS}, {"x": "sum"}, axis_name=None),
        TypeError,
        r"reduce_custom: `metrics` leaf \['x'\] is a NumPy array of dtype object",
    ),
    (
        "keys in reduce_mean",
        lambda t: in_shard_map(lambda k: ed.reduce_mean({"x": k})["x"], KEYS),
        TypeError,
        r"reduce_mean: `metrics` leaf \['x'\] is an array of PRNG keys \(key<fry>\); "
        "keys cannot be averaged",
    ),
    (
        "keys in global reduce_mean",
        lambda t: ed.reduce_mean({"x": KEYS}, axis_name=None),
        TypeError,
        r"keys cannot be averaged",
    ),
    (
        "keys in all_gather",
        lambda t: in_shard_map(lambda k: ed.all_gather({"x": k})["x"], KEYS),
        TypeError,
        r"all_gather: `metrics` leaf \['x'\] is an array of PRNG keys",
    ),
    *[
        (
            f"a zero-size leaf in global {name}",
            lambda t, name=name: getattr(ed, name)(
                {"ok": jnp.ones(3), "x": jnp.zeros((0, 2))}, axis_name=None
            ),
            ValueError,
            rf"{name}: `metrics` leaf \['x'\] has no elements \(shape \(0, 2\)\), so "
            rf"its {name[7:]}imum is undefined",
        )
        for name in ("reduce_max", "reduce_min")
    ],
    (
        "a list where reduce_custom wants a mapping",
        lambda t: ed.reduce_custom([jnp.ones(2)], axis_name=None),
        TypeError,
        r"parameter 'metrics'",
    ),
    # -- multi-process start-up
    *[
        (
            f"EQXDIST_COORDINATOR={value!r}",
            lambda t, value=value: initialize_with(value),
            ValueError,
            rf"EQXDIST_COORDINATOR={value!r} {problem}; expected 'host:port'",
        )
        for value, problem in [
            (":1234", "has no host"),
            ("localhost", "has no host"),
            ("localhost:", "has port '', not a number"),
            ("localhost:http", "has port 'http', not a number"),
            ("localhost:70000", "has port 70000, outside 1..65535"),
            ("localhost:0", "has port 0, outside 1..65535"),
            ("local host:1234", "has host 'local host', not a host name or address"),
        ]
    ],
    # -- checkpoints
    (
        "strings in a saved state",
        lambda t: save_into(t, {"x": STRINGS}),
        TypeError,
        r"save_checkpoint: `state` " + LEAF + " <U3",
    ),
    (
        "a consumed state",
        lambda t: save_into(t, {"x": consumed()}),
        ValueError,
        r"save_checkpoint: `state` was consumed by an earlier step .*\['x'\]",
    ),
    (
        "a float step",
        lambda t: ed.save_checkpoint(t, {"x": jnp.ones(2)}, step=1.0),
        TypeError,
        r"parameter 'step'",
    ),
    (
        "a negative step",
        lambda t: ed.save_checkpoint(t, {"x": jnp.ones(2)}, step=-1),
        ValueError,
        r"`step` must be >= 0; got -1",
    ),
    (
        "a file for a checkpoint directory",
        lambda t: ed.latest_step(a_file(t)),
        ValueError,
        r"latest_step: `directory` '.*file' is a file, not a directory",
    ),
    (
        "restoring a step that is not there",
        lambda t: ed.restore_checkpoint(t, {"x": jnp.ones(2)}, step=3),
        FileNotFoundError,
        r"checkpoint directory '.*' does not exist",
    ),
    (
        "a negative max_to_keep",
        lambda t: ed.CheckpointManager(t, max_to_keep=-1),
        ValueError,
        r"`max_to_keep` must be >= 1 or None \(keep all\); got -1",
    ),
    (
        "a string save interval",
        lambda t: ed.CheckpointManager(t, save_interval_steps="10"),
        TypeError,
        r"parameter 'save_interval_steps'",
    ),
    # -- what a loss returns, what a Stacked holds and is called on
    (
        "a loss without metrics",
        lambda t: train_with(squares),
        TypeError,
        r"make_train_step: `loss_fn` returned the loss alone \(an array of shape "
        r"\(\)\); it must return a tuple `\(loss, metrics\)`.*Return `\(loss, \{\}\)`",
    ),
    (
        "metrics and loss swapped",
        lambda t: train_with(lambda m, b, k: ({}, squares(m, b, k))),
        TypeError,
        r"`loss_fn` returned a dict first and an array of shape \(\) second: the "
        r"loss comes first.*looks swapped",
    ),
    (
        "a Stacked of two module types",
        lambda t: stacked([eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0)), LINEAR]),
        ValueError,
        r"^Stacked: `blocks\[1\]` is a Linear where `blocks\[0\]` is an? MLP; .* "
        r"keep blocks of several types in a list\.$",
    ),
    (
        "a Stacked whose blocks differ in a field",
        lambda t: stacked([LINEAR, eqx.nn.Linear(4, 4, use_bias=False, key=KEYS[0])]),
        ValueError,
        r"`blocks\[1\]\.bias` is None where `blocks\[0\]\.bias` is an array of "
        r"shape \(4,\)",
    ),
    (
        "a per-row Stacked called on a batch",
        lambda t: stacked([LINEAR, LINEAR])(jnp.ones((8, 4))),
        ValueError,
        r"Stacked: called on `x` of shape \(8, 4\), its block \(Linear\) fails "
        r"\(dot_general.*call the Stacked under `jax.vmap`.*or write the block "
        r"for a batch",
    ),
]


def consumed():
    x = jax.device_put(jnp.ones(8), ed.create_data_parallel_sharding(mesh()))
    x.delete()
    return x


def a_file(tmp):
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "file").write_text("")
    return tmp / "file"


@pytest.mark.parametrize(
    ("call", "kind", "pattern"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_caller_mistake_is_a_clear_error(tmp_path, call, kind, pattern):
    with pytest.raises(kind, match=pattern) as info:
        call(tmp_path / "ckpt")
    assert type(info.value).__module__.split(".")[0] in (
        "builtins",
        "eqxdist",
        "jaxtyping",
    )
