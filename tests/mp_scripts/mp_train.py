"""Multi-process training and checkpoints, run by tests/launch/test_launch.py as
`python -m eqxdist.launch -n 2 -d 4 mp_train.py OUT CKPT1`.

- trains the `common` problem with DP and with FSDP for `STEPS` steps and writes the
  final states to `OUT/{dp,fsdp}.npz` and each step's metrics to
  `OUT/results.json`;
- during the FSDP run saves the sharded state at step 2 to `OUT/ckpt` (each process
  writing its shards; the values go to `OUT/fsdp_step2.npz`), then restores it into
  a fresh abstract target and trains the remaining steps again
  (`OUT/fsdp_resumed.npz`: must equal the uninterrupted run);
- builds a fresh state straight into the FSDP layout with `init_state`
  (`OUT/fsdp_init.npz`: must equal the state built on one process);
- restores `CKPT1` (a data-parallel checkpoint the test saved from one process) into
  an FSDP-sharded target on these 2 x 4 devices (`OUT/from_one_process.npz`).
"""

import json
import sys
from pathlib import Path

import eqxdist as ed

ed.initialize_distributed()

import common  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

out, ckpt1 = Path(sys.argv[1]), Path(sys.argv[2])
assert jax.process_count() == 2 and len(jax.devices()) == 8, "run under the launcher"
mesh = ed.create_data_parallel_mesh()
results = {}


def dump(name, tree):
    arrays = common.flat(tree)  # every process takes part in the gathers
    if jax.process_index() == 0:
        np.savez(out / f"{name}.npz", **arrays)


for strategy in ("dp", "fsdp"):
    step = common.make_step(mesh, strategy)
    state, first, _ = common.train(step, common.make_state(), 0, 2)
    if strategy == "fsdp":
        ed.save_checkpoint(out / "ckpt", state, step=2)
        dump("fsdp_step2", state)
    state, second, metrics = common.train(step, state, 2, common.STEPS)
    results[strategy] = first + second
    dump(strategy, state)
    ed.print_metrics(metrics, f"{strategy} final metrics")

# Resume: a fresh abstract target with the FSDP layout, as a restarted job has.
abstract = eqx.filter_eval_shape(common.make_state)
specs = step.state_specs(abstract)
target = jax.tree.map(
    lambda x, s: (
        jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, s)
        )
        if isinstance(x, jax.ShapeDtypeStruct)
        else x
    ),
    abstract,
    specs,
)
restored = ed.restore_checkpoint(out / "ckpt", target)
results["resumed_step"] = ed.latest_step(out / "ckpt")
results["restored_specs"] = sorted(
    {str(x.sharding.spec) for x in jax.tree.leaves(restored) if eqx.is_array(x)}
)
state, rest, _ = common.train(step, restored, 2, common.STEPS)
results["fsdp_resumed"] = rest
dump("fsdp_resumed", state)

# A fresh state built straight into the FSDP layout, by every process together.
initial = step.init_state(common.make_state)
results["init_specs"] = sorted(
    {str(x.sharding.spec) for x in jax.tree.leaves(initial) if eqx.is_array(x)}
)
dump("fsdp_init", initial)

from_one = ed.restore_checkpoint(ckpt1, target, step=2)
results["from_one_process_specs"] = sorted(
    {str(x.sharding.spec) for x in jax.tree.leaves(from_one) if eqx.is_array(x)}
)
dump("from_one_process", from_one)

if jax.process_index() == 0:
    (out / "results.json").write_text(json.dumps(results))
