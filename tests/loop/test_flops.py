"""`TrainStep.cost` against the analytic FLOPs of an MLP, and `mfu` against the
peak of known device kinds."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqxdist as ed


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
