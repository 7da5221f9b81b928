"""`TrainStep.cost` against the analytic FLOPs of an MLP, a stacked model and a
CNN under every layout, the jaxpr count's loop rules, and `mfu` against the peak
of known device kinds."""

import dataclasses
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxdist as ed
from eqxdist._jaxpr import matmul_flops
from eqxdist._loop.run import auto_flops


@dataclasses.dataclass
class FakeDevice:
    device_kind: str
    platform: str = "gpu"


def _loss(model: eqx.nn.MLP, batch: dict[str, jax.Array], key: jax.Array) -> tuple:
    out = jax.vmap(model)(batch["x"])
    return jnp.mean((out - batch["y"]) ** 2), {}


@pytest.mark.parametrize("devices", [1, 8])
def test_cost_flops_match_six_params_rows(devices: int) -> None:
    model = eqx.nn.MLP(64, 16, 256, 2, key=jax.random.key(0))
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    mesh = ed.create_data_parallel_mesh(devices)
    step = ed.make_train_step(_loss, optax.sgd(0.1), mesh)
    state = ed.TrainState.create(model, optax.sgd(0.1), jax.random.key(1))
    flops = {}
    for rows in (64, 256):
        batch = {"x": jnp.ones((rows, 64)), "y": jnp.ones((rows, 16))}
        flops[rows] = step.cost(state, batch)["flops"]
        analytic = 6 * params * rows  # forward 2, backward 4 per weight and row
        assert analytic / 2 <= flops[rows] <= 2 * analytic, (rows, flops[rows])
    assert flops[256] / flops[64] == pytest.approx(4, rel=0.1)
    # An abstract state gives the same count without allocating anything.
    abstract = eqx.filter_eval_shape(lambda: state)
    batch = {"x": jnp.ones((64, 64)), "y": jnp.ones((64, 16))}
    assert step.cost(abstract, batch)["flops"] == flops[64]


def _mlp_flops(sizes: list[int], rows: int) -> int:
    """A training step's matrix-product FLOPs for an MLP of layer widths `sizes`:
    per row and weight, 2 forward, 2 for its gradient and 2 for the input's
    gradient, except the first layer's (the data is not differentiated)."""
    weights = [a * b for a, b in itertools.pairwise(sizes)]
    return rows * (6 * sum(weights) - 2 * weights[0])


LAYOUTS = {
    "dp": ({"data": 8}, {}),
    "fsdp": ({"data": 8}, {"strategy": "fsdp", "min_weight_size": 16}),
    "fsdp partitioned": (
        {"data": 8},
        {"strategy": "fsdp", "min_weight_size": 16, "fsdp_linears": "partition"},
    ),
    "zero1": ({"data": 8}, {"strategy": "zero1", "min_weight_size": 16}),
    "hsdp": (
        {"replica": 2, "data": 4},
        {"strategy": "fsdp", "min_weight_size": 16, "data_axis": ("replica", "data")},
    ),
    "fsdp x tp": (
        {"data": 4, "model": 2},
        {
            "strategy": "fsdp",
            "min_weight_size": 16,
            "param_rules": (
                (r"layers\[0\]\.weight$", P("model", None)),
                (r"layers\[1\]\.weight$", P(None, "model")),
            ),
        },
    ),
    "1 device": ({"data": 1}, {}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("minibatches", [1, 4])
def test_model_flops_count_every_product_of_the_step(layout, minibatches) -> None:
    mesh_shape, options = LAYOUTS[layout]
    mesh = ed.create_device_mesh(mesh_shape)
    model = eqx.nn.MLP(64, 16, 256, 2, key=jax.random.key(0))
    step = ed.make_train_step(
        _loss, optax.adam(0.1), mesh, num_minibatches=minibatches, **options
    )
    state = eqx.filter_eval_shape(
        ed.TrainState.create, model, optax.adam(0.1), jax.random.key(1)
    )
    batch = {"x": jnp.ones((64, 64)), "y": jnp.ones((64, 16))}
    cost = step.cost(state, batch)
    assert cost["model_flops"] == _mlp_flops([64, 256, 256, 16], 64)
    if minibatches > 1:
        # XLA counts the minibatch loop's body once (a quarter of the products,
        # plus the optimizer's elementwise work): the reason for model_flops.
        assert cost["flops"] < 0.7 * cost["model_flops"]


def test_the_loop_takes_mfu_from_the_model_flops() -> None:
    mesh = ed.create_data_parallel_mesh()
    model = eqx.nn.MLP(64, 16, 256, 2, key=jax.random.key(0))
    step = ed.make_train_step(_loss, optax.sgd(0.1), mesh, num_minibatches=4)
    state = ed.TrainState.create(model, optax.sgd(0.1), jax.random.key(1))
    batch = {"x": jnp.ones((64, 64)), "y": jnp.ones((64, 16))}
    h100 = [FakeDevice("NVIDIA H100 80GB HBM3")] * 8
    flops = auto_flops(step, state, batch, h100)
    assert flops == _mlp_flops([64, 256, 256, 16], 64)
    assert auto_flops(step, state, batch, jax.devices()) is None  # CPU


class _Block(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.linear(x))


class _Deep(eqx.Module):
    stack: ed.Stacked
    head: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.stack(x))


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_model_flops_count_a_stacked_model_per_layer(strategy) -> None:
    keys = jax.random.split(jax.random.key(0), 5)
    blocks = [_Block(eqx.nn.Linear(32, 32, key=k)) for k in keys[:4]]
    model = _Deep(ed.Stacked(blocks), eqx.nn.Linear(32, 16, key=keys[4]))
    mesh = ed.create_data_parallel_mesh()
    step = ed.make_train_step(
        _loss, optax.sgd(0.1), mesh, strategy=strategy, min_weight_size=16
    )
    state = eqx.filter_eval_shape(
        ed.TrainState.create, model, optax.sgd(0.1), jax.random.key(1)
    )
    batch = {"x": jnp.ones((32, 32)), "y": jnp.ones((32, 16))}
    # The scan's transpose computes every layer's input gradient, the first
    # layer's too (the same body runs for each layer): 6 per row and weight.
    expected = 32 * 6 * (4 * 32 * 32 + 32 * 16)
    assert step.cost(state, batch)["model_flops"] == expected


def test_model_flops_count_convolutions() -> None:
    class CNN(eqx.Module):
        conv: eqx.nn.Conv2d
        head: eqx.nn.Linear

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.head(jax.nn.relu(self.conv(x)).reshape(-1))

    k1, k2 = jax.random.split(jax.random.key(0))
    model = CNN(
        eqx.nn.Conv2d(3, 8, 3, padding=1, groups=1, key=k1),
        eqx.nn.Linear(8 * 6 * 6, 16, key=k2),
    )
    step = ed.make_train_step(_loss, optax.sgd(0.1), ed.create_data_parallel_mesh())
    state = eqx.filter_eval_shape(
        ed.TrainState.create, model, optax.sgd(0.1), jax.random.key(1)
    )
    rows = 16
    batch = {"x": jnp.ones((rows, 3, 6, 6)), "y": jnp.ones((rows, 16))}
    # The convolution: 2 FLOPs per output element and kernel weight of its input
    # features, forward and for the kernel's gradient (not the data's).
    conv = 2 * (8 * 6 * 6) * (3 * 3 * 3)
    head = 2 * (8 * 6 * 6) * 16
    assert step.cost(state, batch)["model_flops"] == rows * (2 * conv + 3 * head)


def test_matmul_flops_loop_rules() -> None:
    w = jnp.ones((8, 8))

    def scanned(x: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0]

    def branched(x: jax.Array) -> jax.Array:
        # The costlier branch: two products.
        return jax.lax.cond(x[0, 0] > 0, lambda: x @ w @ w, lambda: x @ w)

    def looped(x: jax.Array) -> jax.Array:
        return jax.lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ w), (0, x)
        )[1]

    one = 2 * 4 * 8 * 8  # a (4, 8) @ (8, 8) product
    x = jnp.ones((4, 8))
    assert matmul_flops(jax.make_jaxpr(scanned)(x)) == 5 * one
    assert matmul_flops(jax.make_jaxpr(branched)(x)) == 2 * one
    assert matmul_flops(jax.make_jaxpr(looped)(x)) == one  # trip count unknown


def test_mfu_of_known_devices() -> None:
    h100 = [FakeDevice("NVIDIA H100 80GB HBM3")] * 8
    assert ed.mfu(989e12 * 8 * 0.5, 1.0, h100) == pytest.approx(0.5)
    assert ed.mfu(756e12, 2.0, [FakeDevice("NVIDIA H100 PCIe")]) == pytest.approx(0.5)
    for kind, peak in [
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5p", 459e12),
    ]:
        devices = [FakeDevice(kind, "tpu" if "TPU" in kind else "gpu")] * 4
        assert ed.mfu(peak, 1.0, devices) == pytest.approx(0.25), kind


def test_mfu_is_none_on_cpu_and_unknown_kinds() -> None:
    assert jax.devices()[0].platform == "cpu"
    assert ed.mfu(1e12, 1.0) is None
    assert ed.mfu(1e12, 1.0, [FakeDevice("NVIDIA H100", "cpu")]) is None
    assert ed.mfu(1e12, 1.0, [FakeDevice("Mystery accelerator")]) is None
    # One unknown device makes the whole mesh's peak unknown.
    mixed = [FakeDevice("NVIDIA H100"), FakeDevice("Mystery")]
    assert ed.mfu(1e12, 1.0, mixed) is None


def test_mfu_bad_arguments() -> None:
    h100 = [FakeDevice("NVIDIA H100")]
    with pytest.raises(ValueError, match=r"mfu: `seconds_per_step` must be > 0; got 0"):
        ed.mfu(1e12, 0.0, h100)
    with pytest.raises(ValueError, match=r"`flops_per_step` must be >= 0; got -1"):
        ed.mfu(-1.0, 1.0, h100)
    with pytest.raises(ValueError, match="`devices` is empty"):
        ed.mfu(1.0, 1.0, [])
