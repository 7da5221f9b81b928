"""Pipeline parallelism (`make_train_step(..., pipeline=ed.Pipeline(...))`): every
schedule on 8 simulated devices against single-device training of the same model
in plain Equinox and Optax (`reference.train_one_device`), float32 within 1e-5
after several steps; composed with FSDP, tensor-parallel rules, minibatches,
weighted losses, step statistics and skipped steps, in either view; what the
compiled program does (loop iterations, collectives, memory); remat policies;
the mistakes a user can make."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
    ADAMW,
    MP_SCHEDULES,
    MP_SCRIPTS,
    PipeNet,
    launch,
    pipe_batches,
    pipe_loss,
)
from jax.sharding import PartitionSpec as P
from reference import max_diff, train_one_device

import eqxdist as ed
from eqxdist._layout.pipeline.messages import by_all_to_all

SGD = optax.sgd(0.1)
Net, loss_fn, _data = PipeNet, pipe_loss, pipe_batches


def weighted_loss(model, batch, key):
    logits = jax.vmap(model)(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    mask = batch["mask"]
    return (jnp.sum(losses * mask), mask.sum()), {}


def weighted_mean(model, batch, key):
    """`weighted_loss` on one device: the mean over the batch's real rows."""
    (total, weight), _ = weighted_loss(model, batch, key)
    return total / weight


def _pipeline(stages, micro, schedule):
    repeats = 2 if schedule in ("circular", "interleaved") else 1
    return ed.Pipeline("stage", micro, schedule=schedule, repeats=repeats)


def _train(mesh, pipeline, data, loss=loss_fn, optimizer=SGD, **options):
    step = ed.make_train_step(loss, optimizer, mesh, pipeline=pipeline, **options)
    state = ed.TrainState.create(Net(), optimizer, jax.random.key(1))
    outs = []
    for batch in data:
        out = step(state, batch)
        state = out.state
        outs.append(out)
    return state, outs, step


MESHES = {
    "stage2_data4": {"stage": 2, "data": 4},
    "stage4_data2": {"stage": 4, "data": 2},
    "stage8": {"stage": 8},
}
SCHEDULES = ["gpipe", "circular", "1f1b"]
# The schedules of smaller bubbles at 4 stages, M = P and 2P (for CI time;
# the tests of compositions below run them at 2 stages).
NEW = [("stage4_data2", 1, "interleaved"), ("stage4_data2", 2, "zb-h1")]
# M = P microbatches on every mesh, M = 2P (a steady phase of 1F1B, the circular
# schedule's ring holding more microbatches than stages) on one: the tables and
# the loop are the same code at every P (for CI time).
CASES = [
    (m, t, s)
    for s in SCHEDULES
    for m in MESHES
    for t in ((1, 2) if m == "stage4_data2" else (1,))
]


@pytest.mark.parametrize(("mesh_name", "times", "schedule"), CASES + NEW)
def test_every_schedule_equals_one_device(mesh_name, times, schedule):
    shape = MESHES[mesh_name]
    stages = shape["stage"]
    data = _data()
    want = train_one_device(Net(), data, SGD, loss_fn)
    mesh = ed.create_device_mesh(shape)
    state, outs, _ = _train(mesh, _pipeline(stages, times * stages, schedule), data)
    assert max_diff(state.model, want.model) < 1e-5
    losses = [float(m["loss"].compute()) for _, m in outs]
    np.testing.assert_allclose(losses, want.losses, rtol=1e-5)


@pytest.mark.parametrize(
    ("schedule", "view", "axis_types"),
    [
        ("gpipe", "global", "auto"),
        ("circular", "global", "explicit"),
        ("1f1b", "device", "explicit"),
        ("zb-h1", "global", "auto"),
    ],
)
def test_fsdp_over_the_data_axes_in_either_view(schedule, view, axis_types):
    data = _data()
    want = train_one_device(Net(), data, optax.adamw(1e-2), loss_fn)
    mesh = ed.create_device_mesh({"stage": 2, "data": 4}, axis_types=axis_types)
    state, _, step = _train(
        mesh,
        _pipeline(2, 2, schedule),
        data,
        optimizer=optax.adamw(1e-2),
        strategy="fsdp",
        min_weight_size=16,
        view=view,
    )
    assert max_diff(state.model, want.model) < 1e-5
    # Each device holds its stage's layers, sharded over the data axis too.
    weight = state.model.blocks.layers.linear.weight
    assert weight.sharding.spec == P("stage", "data", None)
    assert {s.data.shape for s in weight.addressable_shards} == {(8, 4, 16)}
    assert step.state_specs(state).model.embed.weight == P("data", None)


def test_tensor_parallel_rules_minibatches_weighted_loss_and_step_info():
    data = _data()
    want = train_one_device(Net(), data, SGD, weighted_mean)
    mesh = ed.create_device_mesh({"stage": 2, "data": 2, "model": 2})
    rules = [
        (r"blocks\.layers\.linear\.weight", P(None, "model", None)),
        (r"head\.weight", P("model", None)),
    ]
    # GPipe (autodiff's backward) and ZB-H1 (the written-out one, as 1F1B's
    # with another table).
    for schedule in ("gpipe", "zb-h1"):
        state, outs, step = _train(
            mesh,
            _pipeline(2, 2, schedule),
            data,
            loss=weighted_loss,
            param_rules=rules,
            num_minibatches=2,
            step_info=True,
        )
        assert max_diff(state.model, want.model) < 1e-5, schedule
        spec = step.state_specs(state).model.blocks.layers.linear.weight
        assert spec == P("stage", "model", None)
        grad_norm = float(outs[-1].info["grad_norm"])
        want_norm = float(optax.tree.norm(want.grads))
        assert grad_norm == pytest.approx(want_norm, rel=1e-5)


def test_a_nan_row_skips_the_step():
    """A NaN in one row of the second batch: every schedule skips that step as
    GPipe does (the parameters those of one device's first step, the counter
    still advancing), in either view."""
    data = _data(steps=2)
    data[1]["x"][3, 0] = np.nan
    want = train_one_device(Net(), data[:1], SGD, loss_fn)
    mesh = ed.create_device_mesh({"stage": 4, "data": 2})
    # 1F1B runs the written-out code of interleaved and ZB-H1 with another table.
    for schedule, view in [
        ("gpipe", "device"),
        ("interleaved", "device"),
        ("zb-h1", "global"),
    ]:
        state, outs, _ = _train(
            mesh,
            _pipeline(4, 4, schedule),
            data,
            skip_nonfinite=True,
            step_info=True,
            view=view,
        )
        assert max_diff(state.model, want.model) == pytest.approx(0.0, abs=1e-6)
        skipped = [float(out.info["skipped"]) for out in outs]
        assert skipped == [0.0, 1.0] and int(state.step) == 2, schedule


def test_checkpoints_resume_under_another_schedule(tmp_path):
    """Trained a step under ZB-H1, saved, restored and trained a step under the
    interleaved schedule (whose stages hold their layers in another order),
    saved again, restored and trained a step under GPipe: the parameters of
    three uninterrupted steps on one device (AdamW, so its moments go through
    both checkpoints)."""
    adamw = optax.adamw(1e-2)
    data = _data()
    want = train_one_device(Net(), data, adamw, loss_fn)
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    state = ed.TrainState.create(Net(), adamw, jax.random.key(1))
    for i, schedule in enumerate(("zb-h1", "interleaved", "gpipe")):
        step = ed.make_train_step(
            loss_fn, adamw, mesh, pipeline=_pipeline(2, 4, schedule)
        )
        if i:  # a restarted job: a fresh state placed by this step, restored
            blank = ed.TrainState.create(
                Net(key=jax.random.key(5)), adamw, jax.random.key(0)
            )
            state = ed.restore_checkpoint(tmp_path, step.place_state(blank), step=i)
            assert int(state.step) == i
        state, _ = step(state, data[i])
        ed.save_checkpoint(tmp_path, state, step=i + 1)
    assert int(state.step) == 3
    assert max_diff(state.model, want.model) < 1e-5


def _compiled(step, state, batch):
    return step.lower(state, batch).compile()


def _groups(line):
    """The replica groups of a collective in compiled HLO text, in any of XLA's
    three spellings: explicit `{{0,1},{2,3}}`, iota `[2,2]<=[4]` (with an
    optional transpose `T(1,0)`), and mesh axes `mesh['a'=2,'b'=4] {'b'}`."""
    found = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if found:
        return [
            list(map(int, g.split(","))) for g in re.findall(r"\{([\d,]*)\}", found[1])
        ]
    found = re.search(
        r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line
    )
    if found:
        count, size = int(found[1]), int(found[2])
        dims = [int(d) for d in found[3].split(",")]
        ids = np.arange(np.prod(dims)).reshape(dims)
        if found[4]:
            ids = ids.transpose([int(d) for d in found[4].split(",")])
        return ids.reshape(count, size).tolist()
    found = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    assert found is not None, line
    axes = re.findall(r"'(\w+)'=(\d+)", found[1])
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    chosen = [names.index(a) for a in re.findall(r"'(\w+)'", found[2])]
    rest = [d for d in range(len(names)) if d not in chosen]
    ids = np.arange(np.prod(sizes)).reshape(sizes).transpose(rest + chosen)
    return ids.reshape(-1, int(np.prod([sizes[d] for d in chosen]))).tolist()


@pytest.mark.parametrize(("schedule", "micro"), [("gpipe", 4), ("circular", 4)])
def test_the_compiled_schedule(schedule, micro):
    """The loop runs R M + P - 1 iterations; activations move by
    collective-permute, on the CPU by all-to-all over the stage axis
    (`messages.by_all_to_all`: each group one device of each stage); no
    all-gather spans two stages (the stages' layers are never gathered over
    the stage axis)."""
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    pipeline = _pipeline(2, micro, schedule)
    step = ed.make_train_step(
        loss_fn, SGD, mesh, pipeline=pipeline, strategy="fsdp", min_weight_size=16
    )
    state = ed.TrainState.create(Net(), SGD, jax.random.key(1))
    text = _compiled(step, state, _data(1)[0]).as_text()
    trips = {int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"', text)}
    assert pipeline.repeats * micro + 2 - 1 in trips
    stage_of = {d.id: i for i, row in enumerate(mesh.devices) for d in row}
    if not by_all_to_all():
        assert "collective-permute" in text
    else:
        moves = [line for line in text.splitlines() if " all-to-all(" in line]
        assert moves
        for line in moves:
            for group in _groups(line):
                assert sorted(stage_of[d] for d in group) == [0, 1], line
    for line in text.splitlines():
        if " all-gather(" in line or "all-gather-start(" in line:
            for group in _groups(line):
                assert len({stage_of[d] for d in group}) == 1, line


def test_1f1b_keeps_fewer_activations_than_gpipe():
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    batch = _data(1, rows=128)[0]
    temps = {}
    for schedule in ("gpipe", "1f1b"):
        step = ed.make_train_step(
            loss_fn, SGD, mesh, pipeline=_pipeline(2, 8, schedule)
        )
        state = ed.TrainState.create(Net(), SGD, jax.random.key(1))
        temps[schedule] = (
            _compiled(step, state, batch).memory_analysis().temp_size_in_bytes
        )
    assert temps["1f1b"] < temps["gpipe"]


class _NoBias(eqx.Module):
    """A block of a dozen leaves whose `Linear`s have no bias: `None` fields in
    the model."""

    linears: list[eqx.nn.Linear]
    norms: list[eqx.nn.LayerNorm]

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.linears = [eqx.nn.Linear(16, 16, use_bias=False, key=k) for k in keys]
        self.norms = [eqx.nn.LayerNorm(16) for _ in keys]

    def __call__(self, x):
        for linear, norm in zip(self.linears, self.norms, strict=True):
            x = x + jnp.tanh(linear(norm(x)))
        return x


class _NoBiasNet(eqx.Module):
    embed: eqx.nn.Linear
    blocks: ed.Stacked
    head: eqx.nn.Linear

    def __init__(self):
        k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
        self.embed = eqx.nn.Linear(8, 16, use_bias=False, key=k1)
        self.blocks = ed.Stacked([_NoBias(k) for k in jax.random.split(k2, 8)])
        self.head = eqx.nn.Linear(16, 4, key=k3)

    def __call__(self, x):
        return self.head(self.blocks(self.embed(x)))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_block_of_many_leaves_and_none_fields(schedule):
    """Leaves that are `None` (a `Linear` without bias), inside the stages and
    out of them, and a dozen leaves per block (each moved between the circular
    schedule's chunk orders), under FSDP: trained as on one device."""
    data = _data(steps=2)
    want = train_one_device(_NoBiasNet(), data, SGD, loss_fn)
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    step = ed.make_train_step(
        loss_fn,
        SGD,
        mesh,
        pipeline=_pipeline(2, 2, schedule),
        strategy="fsdp",
        min_weight_size=16,
    )
    state = ed.TrainState.create(_NoBiasNet(), SGD, jax.random.key(1))
    for batch in data:
        state, _ = step(state, batch)
    assert max_diff(state.model, want.model) < 1e-5
    assert state.model.blocks.layers.linears[0].bias is None
    specs = step.state_specs(state).model.blocks.layers
    assert specs.linears[0].weight == P("stage", "data", None)


def test_gpipe_keeps_its_layers_once():
    """GPipe's backward pass reads the stage's layers as they are, not a copy
    kept per iteration of its loop: with more microbatches (more iterations)
    the temporaries shrink (fewer rows computed in the bubble); a copy of the
    layers per iteration made them grow."""
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    batch = _data(1, rows=64)[0]
    temps = {}
    for micro in (1, 16):
        step = ed.make_train_step(
            loss_fn, SGD, mesh, pipeline=ed.Pipeline("stage", micro)
        )
        state = ed.TrainState.create(Net(), SGD, jax.random.key(1))
        memory = _compiled(step, state, batch).memory_analysis()
        temps[micro] = memory.temp_size_in_bytes
    assert temps[16] < temps[1]


@pytest.mark.parametrize(
    "remat",
    ["none", "full", "dots", "offload", jax.checkpoint_policies.nothing_saveable],
)
def test_remat_policies_give_the_same_parameters(remat):
    data = _data(steps=2)
    want = train_one_device(Net(), data, SGD, loss_fn)
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    state, _, _ = _train(mesh, _pipeline(2, 2, "gpipe"), data, remat=remat)
    assert max_diff(state.model, want.model) < 1e-5


def test_remat_keeps_less():
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    batch = _data(1, rows=128)[0]
    temps = {}
    for remat in ("none", "dots", "full"):
        step = ed.make_train_step(
            loss_fn, SGD, mesh, pipeline=_pipeline(2, 4, "gpipe"), remat=remat
        )
        state = ed.TrainState.create(Net(), SGD, jax.random.key(1))
        temps[remat] = (
            _compiled(step, state, batch).memory_analysis().temp_size_in_bytes
        )
    assert temps["full"] < temps["none"]
    assert temps["full"] <= temps["dots"] <= temps["none"]


def test_eval_init_state_and_checkpoints_across_layouts(tmp_path):
    mesh = ed.create_device_mesh({"stage": 4, "data": 2})
    pipeline = _pipeline(4, 4, "gpipe")
    step = ed.make_train_step(loss_fn, SGD, mesh, pipeline=pipeline)
    state = step.init_state(
        lambda k: ed.TrainState.create(Net(key=k), SGD, k), jax.random.key(0)
    )
    weight = state.model.blocks.layers.linear.weight
    assert {s.data.shape for s in weight.addressable_shards} == {(4, 16, 16)}
    state, _ = step(state, _data(1)[0])

    def eval_fn(model, batch, mask):
        logits = jax.vmap(model)(batch["x"])
        return {"accuracy": ed.metrics.Accuracy().update(logits, batch["y"], mask)}

    batch = _data(1, rows=13)[0]
    got = ed.make_eval_step(eval_fn, mesh, pipeline=pipeline)(state, batch)
    host = jax.device_get(state.model)
    accuracy = np.mean(np.argmax(jax.vmap(host)(batch["x"]), -1) == batch["y"])
    assert float(got["accuracy"].compute()) == pytest.approx(accuracy)

    # Saved under the pipeline, restored under FSDP without one, and back.
    ed.save_checkpoint(tmp_path / "a", state, step=1)
    fsdp = ed.make_train_step(
        loss_fn,
        SGD,
        ed.create_data_parallel_mesh(),
        strategy="fsdp",
        min_weight_size=16,
    )
    target = fsdp.place_state(
        ed.TrainState.create(Net(key=jax.random.key(5)), SGD, jax.random.key(0))
    )
    plain = ed.restore_checkpoint(tmp_path / "a", target)
    assert max_diff(plain.model, state.model) == 0.0
    ed.save_checkpoint(tmp_path / "b", plain, step=1)
    back = ed.restore_checkpoint(
        tmp_path / "b",
        step.place_state(
            ed.TrainState.create(Net(key=jax.random.key(5)), SGD, jax.random.key(0))
        ),
    )
    assert max_diff(back.model, state.model) == 0.0
    assert back.model.blocks.layers.linear.weight.sharding.spec == P("stage")


def test_pipeline_mistakes_are_clear_errors():
    mesh = ed.create_device_mesh({"stage": 2, "data": 4})
    state = ed.TrainState.create(Net(), SGD, jax.random.key(1))
    batch = _data(1)[0]
    with pytest.raises(ValueError, match=r"unknown schedule 'zb'"):
        ed.Pipeline("stage", 4, schedule="zb")
    with pytest.raises(ValueError, match=r"needs repeats > 1"):
        ed.Pipeline("stage", 4, schedule="circular")
    with pytest.raises(ValueError, match=r"`microbatches` is required"):
        ed.Pipeline("stage")
    with pytest.raises(ValueError, match=r"'pipe' is not an axis of the mesh"):
        ed.make_train_step(loss_fn, SGD, mesh, pipeline=ed.Pipeline("pipe", 2))
    with pytest.raises(ValueError, match=r"'data' is also a data axis"):
        ed.make_train_step(loss_fn, SGD, mesh, pipeline=ed.Pipeline("data", 2))
    with pytest.raises(ValueError, match=r"16 layers, not divisible by 2 stages x 3"):
        step = ed.make_train_step(
            loss_fn, SGD, mesh,
            pipeline=ed.Pipeline("stage", 2, schedule="circular", repeats=3),
        )  # fmt: skip
        step(state, batch)
    with pytest.raises(ValueError, match=r"8 rows .* microbatches=3"):
        ed.make_train_step(loss_fn, SGD, mesh, pipeline=ed.Pipeline("stage", 3))(
            state, batch
        )
    mlp = ed.TrainState.create(
        eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0)), SGD, jax.random.key(1)
    )
    with pytest.raises(ValueError, match=r"holds no ed.Stacked"):
        ed.make_train_step(loss_fn, SGD, mesh, pipeline=ed.Pipeline("stage", 2))(
            mlp, batch
        )
    with pytest.raises(
        ValueError, match=r"`where` returns a Linear, not an ed.Stacked"
    ):
        ed.make_train_step(
            loss_fn, SGD, mesh, pipeline=ed.Pipeline("stage", 2, where=lambda m: m.head)
        )(state, batch)
    with pytest.raises(ValueError, match=r"unknown `remat`='some'"):
        ed.make_train_step(loss_fn, SGD, mesh, remat="some")


@pytest.mark.slow
def test_stages_across_two_processes(tmp_path):
    """2 processes x 4 devices, the stage axis across the processes: the same
    parameters as one device in plain Equinox and Optax, for GPipe, the
    interleaved schedule and ZB-H1 (one launch runs them all; 1F1B runs the
    written-out schedules' code with another table, and runs in-process here)."""
    result = launch(MP_SCRIPTS / "mp_pipeline.py", tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    want = train_one_device(PipeNet(), pipe_batches(), ADAMW, pipe_loss).model
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(want, eqx.is_array))[0]
    for schedule in MP_SCHEDULES:
        saved = np.load(tmp_path / f"{schedule}.npz")
        assert len(saved.files) == len(leaves)
        for path, leaf in leaves:
            np.testing.assert_allclose(
                saved[jax.tree_util.keystr(path)],
                np.asarray(leaf),
                atol=1e-5,
                err_msg=f"{schedule}: {jax.tree_util.keystr(path)}",
            )
