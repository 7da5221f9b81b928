"""Safetensors across processes, run by tests/weights/test_safetensors.py as
`python -m eqxdist.launch -n 2 -d 4 mp_weights.py OUT`: a model placed under
FSDP over all 8 devices (both processes) is saved to `OUT/saved` (each tensor
written once), then loaded back under FSDP and under tensor rules whose model
axis spans the processes; each process checks the values it holds and process 0
prints `loaded: equal`."""

import sys
from pathlib import Path

import eqxdist as ed

ed.initialize_distributed()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "weights")]
from test_safetensors import StackNet  # noqa: E402

out = Path(sys.argv[1])
assert jax.process_count() == 2 and len(jax.devices()) == 8, "run under the launcher"
model = StackNet(jax.random.key(0))
fsdp = ed.Layout(ed.create_data_parallel_mesh(), strategy="fsdp", min_weight_size=0)
tensor = ed.Layout(
    ed.create_device_mesh({"model": 2, "data": 4}),
    strategy="fsdp",
    min_weight_size=0,
    param_rules=[(r"lin\.weight", P(None, "model", None))],
)


def place(x, spec):
    value = np.asarray(x)
    sharding = NamedSharding(fsdp.mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])


sharded = jax.tree.map(place, model, fsdp.model_specs(model))
assert not sharded.head.weight.is_fully_addressable
ed.save_safetensors(out / "saved", sharded)
like = eqx.filter_eval_shape(StackNet, jax.random.key(1))
for layout in (fsdp, tensor):
    loaded = ed.load_safetensors(out / "saved", like, layout=layout)
    for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True):
        assert x.sharding.spec != P() or x.ndim < 2, x.sharding
        for shard in x.addressable_shards:
            assert (
                np.asarray(shard.data).tobytes() == np.asarray(y)[shard.index].tobytes()
            )
multihost_utils.sync_global_devices("mp_weights checked")
if jax.process_index() == 0:
    print("loaded: equal")
