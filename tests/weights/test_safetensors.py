"""`ed.save_safetensors` / `ed.load_safetensors`: Hugging Face's file layout, the
default names (a `Stacked` named as its list of blocks), renaming rules, bit-exact
round trips of every dtype, loading into one device, FSDP and tensor rules with
the values of a plain NumPy forward pass, the errors, and two processes."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import MP_SCRIPTS, launch
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import eqxdist as ed

WIDTH, LAYERS, OUT = 16, 4, 8


class Block(eqx.Module):
    lin: eqx.nn.Linear

    def __init__(self, key):
        self.lin = eqx.nn.Linear(WIDTH, WIDTH, key=key)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x))


class StackNet(eqx.Module):
    layers: ed.Stacked
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, LAYERS + 1)
        self.layers = ed.Stacked([Block(k) for k in keys[:LAYERS]])
        self.head = eqx.nn.Linear(WIDTH, OUT, use_bias=False, key=keys[-1])

    def __call__(self, x):
        return self.head(self.layers(x))


class ListNet(eqx.Module):
    layers: list
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, LAYERS + 1)
        self.layers = [Block(k) for k in keys[:LAYERS]]
        self.head = eqx.nn.Linear(WIDTH, OUT, use_bias=False, key=keys[-1])


def hf_tensors(seed: int = 0) -> dict:
    """A checkpoint as another tool writes it, in its own names."""
    rng = np.random.default_rng(seed)
    out = {"lm_head.weight": rng.normal(size=(OUT, WIDTH)).astype(np.float32)}
    for i in range(LAYERS):
        out[f"model.layers.{i}.mlp.weight"] = rng.normal(
            scale=0.3, size=(WIDTH, WIDTH)
        ).astype(np.float32)
        out[f"model.layers.{i}.mlp.bias"] = rng.normal(size=WIDTH).astype(np.float32)
    return out


HF_NAMES = [
    (r"layers\.(\d+)\.lin\.(weight|bias)", r"model.layers.\1.mlp.\2"),
    (r"head\.weight", "lm_head.weight"),
]


def numpy_forward(tensors: dict, x: np.ndarray) -> np.ndarray:
    for i in range(LAYERS):
        w, b = (
            tensors[f"model.layers.{i}.mlp.weight"],
            tensors[f"model.layers.{i}.mlp.bias"],
        )
        x = x + np.tanh(x @ w.T + b)
    return x @ tensors["lm_head.weight"].T


def test_default_names_one_file_and_what_numpy_reads(tmp_path):
    model = StackNet(jax.random.key(0))
    ed.save_safetensors(tmp_path, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    read = load_file(tmp_path / "model.safetensors")
    assert sorted(read) == sorted(
        ["head.weight"]
        + [f"layers.{i}.lin.{w}" for i in range(LAYERS) for w in ("weight", "bias")]
    )
    for i in range(LAYERS):  # one tensor per layer, without the layer axis
        np.testing.assert_array_equal(
            read[f"layers.{i}.lin.weight"], model.layers.layers.lin.weight[i]
        )
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_stacked_model_and_its_list_twin_share_files(tmp_path):
    listed = ListNet(jax.random.key(3))
    ed.save_safetensors(tmp_path / "list", listed)
    stacked = ed.load_safetensors(
        tmp_path / "list", eqx.filter_eval_shape(StackNet, jax.random.key(0))
    )
    for i, block in enumerate(listed.layers):
        np.testing.assert_array_equal(stacked.layers.layers.lin.bias[i], block.lin.bias)
    ed.save_safetensors(tmp_path / "stack", stacked)
    back = ed.load_safetensors(tmp_path / "stack", ListNet(jax.random.key(9)))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), listed, back))


def test_round_trip_is_bit_exact_for_every_dtype_across_shards(tmp_path):
    rng = np.random.default_rng(0)
    floats = rng.normal(size=(6, 5)).astype(np.float32)
    floats[0, 0] = np.nan
    tree = {
        "f32": jnp.asarray(floats),
        "bf16": jnp.asarray(floats, dtype=jnp.bfloat16),
        "f16": jnp.asarray(floats, dtype=jnp.float16),
        "i32": jnp.asarray(rng.integers(-(2**31), 2**31 - 1, size=(7,)), jnp.int32),
        "u8": jnp.arange(10, dtype=jnp.uint8),
        "flag": jnp.array([True, False]),
        "scalar": jnp.float32(3.5),
        "note": "kept",
    }
    ed.save_safetensors(tmp_path, tree, max_shard_bytes=100)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors" and len(files) > 2
    assert index["metadata"]["total_size"] == sum(
        x.nbytes for x in jax.tree.leaves(tree) if eqx.is_array(x)
    )
    assert load_file(tmp_path / index["weight_map"]["bf16"])["bf16"].dtype == (
        ml_dtypes.bfloat16
    )
    like = {
        k: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x
        for k, x in tree.items()
    }
    back = ed.load_safetensors(tmp_path, like)
    assert back["note"] == "kept"
    for key, x in tree.items():
        if key != "note":
            assert back[key].dtype == x.dtype
            assert np.asarray(back[key]).tobytes() == np.asarray(x).tobytes(), key
    # A leaf of another dtype reads the tensor cast to it.
    like["f32"] = jax.ShapeDtypeStruct((6, 5), jnp.bfloat16)
    cast = ed.load_safetensors(tmp_path, like)["f32"]
    assert cast.dtype == jnp.bfloat16 and cast.tobytes() == tree["bf16"].tobytes()


@pytest.mark.parametrize("layout", ["one device", "fsdp", "tensor"])
def test_load_into_a_layout_equals_a_numpy_forward(tmp_path, layout):
    tensors = hf_tensors()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    like = eqx.filter_eval_shape(StackNet, jax.random.key(0))
    if layout == "one device":
        chosen = None
    elif layout == "fsdp":
        chosen = ed.Layout(
            ed.create_data_parallel_mesh(), strategy="fsdp", min_weight_size=0
        )
    else:
        mesh = ed.create_device_mesh({"data": 4, "model": 2})
        chosen = ed.Layout(
            mesh,
            strategy="fsdp",
            min_weight_size=0,
            param_rules=[(r"lin\.weight", P(None, "model", None))],
        )
    model = ed.load_safetensors(
        tmp_path / "model.safetensors", like, names=HF_NAMES, layout=chosen
    )
    if chosen is not None:
        specs = chosen.model_specs(like)
        got = jax.tree.map(lambda x: x.sharding.spec, model)
        assert got == specs
        assert got.layers.layers.lin.weight != P()  # really split
    x = np.random.default_rng(1).normal(size=(3, WIDTH)).astype(np.float32)
    out = jax.jit(jax.vmap(model))(x)
    np.testing.assert_allclose(out, numpy_forward(tensors, x), rtol=1e-5, atol=1e-5)
    ed.save_safetensors(tmp_path / "back", model, names=HF_NAMES)
    again = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(again) == sorted(tensors)
    assert all(again[k].tobytes() == v.tobytes() for k, v in tensors.items())


def test_names_rules_use_fullmatch_and_expand(tmp_path):
    model = {"a": {"w": jnp.ones(2)}, "ab": {"w": jnp.zeros(2)}}
    ed.save_safetensors(tmp_path, model, names=[(r"a\.(w)", r"first.\1")])
    assert sorted(load_file(tmp_path / "model.safetensors")) == ["ab.w", "first.w"]
    with pytest.raises(ValueError, match="both have the tensor name 'x'"):
        ed.save_safetensors(tmp_path, model, names=[(r".*", "x")])
    with pytest.raises(TypeError, match="names"):
        ed.save_safetensors(tmp_path, model, names="a")


def test_missing_tensor_and_shape_mismatch_name_everything(tmp_path):
    ed.save_safetensors(tmp_path, {"w": jnp.ones((2, 3))})
    file = tmp_path / "model.safetensors"
    with pytest.raises(ValueError) as missing:
        ed.load_safetensors(tmp_path, {"v": jnp.ones((2, 3))})
    assert all(s in str(missing.value) for s in ("'v'", str(file), "['v']", "(2, 3)"))
    with pytest.raises(ValueError) as shape:
        ed.load_safetensors(file, {"w": jax.ShapeDtypeStruct((3, 2), jnp.float32)})
    assert all(
        s in str(shape.value) for s in ("'w'", str(file), "['w']", "(2, 3)", "(3, 2)")
    )
    with pytest.raises(ValueError, match="no checkpoint"):
        ed.load_safetensors(tmp_path / "nowhere", {"w": jnp.ones(1)})


@pytest.mark.slow
def test_two_processes_save_once_and_load_their_slices(tmp_path):
    """mp_weights.py: a model saved under FSDP from two processes, each tensor
    once; loaded back under FSDP and tensor rules; both equal one process's."""
    result = launch(MP_SCRIPTS / "mp_weights.py", tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    model = StackNet(jax.random.key(0))
    written = load_file(tmp_path / "saved" / "model.safetensors")
    expected = load_file(_save(tmp_path / "one", model) / "model.safetensors")
    assert sorted(written) == sorted(expected)
    assert all(written[k].tobytes() == expected[k].tobytes() for k in expected)
    assert "loaded: equal" in result.stdout


def _save(directory, model):
    ed.save_safetensors(directory, model)
    return directory
