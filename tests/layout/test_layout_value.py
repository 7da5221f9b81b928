"""`ed.Layout`, the layout as one value: built and checked once, immutable,
described, and taken by the train step, the evaluation step and the loader in
place of a mesh; v0.4's mesh-and-keywords form builds the same value, with the
same programs."""

import dataclasses
import importlib.util
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxdist as ed
from tests.harness import ADAMW, ResidualMLP, batches, loss_fn

_DUMP = Path(__file__).resolve().parents[2] / "benchmarks" / "dump_programs.py"


def _dump_programs():
    spec = importlib.util.spec_from_file_location("dump_programs", _DUMP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DUMP = _dump_programs()


@pytest.mark.parametrize("case", [*DUMP.CASES, "eval"])
def test_a_layout_lowers_the_program_of_the_shorthand(case):
    """Every configuration `benchmarks/dump_programs.py` dumps (DP, FSDP both
    ways, HSDP, tensor rules, ZeRO-1, Stacked, weighted losses, BatchNorm,
    GPipe, 1F1B, a context axis, the eval step): the lowered program of
    `ed.Layout(mesh, **keywords)` is byte-identical to v0.4's `mesh,
    **keywords`."""
    if case == "eval":
        assert DUMP.lower_eval(False, layout=True) == DUMP.lower_eval(False)
    else:
        assert DUMP.lower_case(case, False, layout=True) == DUMP.lower_case(case, False)


@pytest.fixture(scope="module")
def tp_mesh():
    return jax.make_mesh((4, 2), ("data", "model"))


RULES = [(r"up\.weight", P("model", None))]


def test_describe_names_every_axis_and_its_roles(tp_mesh):
    layout = ed.Layout(tp_mesh, strategy="fsdp", param_rules=RULES, min_weight_size=16)
    lines = layout.describe().splitlines()
    assert str(layout) == layout.describe()
    assert len(lines) == 3
    assert lines[1].split()[:3] == ["data", "4", "data;"]
    assert "fsdp (min_weight_size=16, layout='leading'" in lines[1]
    assert lines[2].split() == ["model", "2", "tensor", "rules", "(1", "rule)"]
    stages = jax.make_mesh((2, 2, 2), ("stage", "data", "context"))
    piped = ed.Layout(
        stages,
        strategy="zero1",
        pipeline=ed.Pipeline("stage", microbatches=4, schedule="1f1b"),
        context_axis="context",
    )
    roles = {line.split()[0]: line for line in piped.describe().splitlines()[1:]}
    assert "pipeline (1f1b, 4 microbatches)" in roles["stage"]
    assert "zero1 (optimizer state" in roles["data"]
    assert roles["context"].split()[2:] == ["context"]
    assert "replicated (no role)" in ed.Layout(tp_mesh).describe().splitlines()[2]


def test_a_layout_is_immutable_and_keeps_its_mesh(tp_mesh):
    layout = ed.Layout(tp_mesh, strategy="fsdp")
    assert layout.mesh is tp_mesh
    with pytest.raises(AttributeError, match="Layout is immutable"):
        layout.strategy = "dp"
    assert repr(layout) == "Layout({'data': 4, 'model': 2}, strategy='fsdp')"


def test_model_specs_are_the_step_state_specs(tp_mesh):
    layout = ed.Layout(tp_mesh, strategy="fsdp", param_rules=RULES, min_weight_size=16)
    model = ResidualMLP(jax.random.key(0))
    state = ed.TrainState.create(model, ADAMW, jax.random.key(1))
    step = ed.make_train_step(loss_fn, ADAMW, layout)
    assert step.layout is layout
    specs = layout.model_specs(model)
    assert specs == step.state_specs(state).model
    assert specs.up.weight == P("model", "data")


def test_one_layout_for_the_train_step_the_eval_step_and_the_loader(tp_mesh):
    """The same value everywhere; training equals the shorthand's, and the
    loader's batches are placed as the step takes them."""
    layout = ed.Layout(tp_mesh, strategy="fsdp", param_rules=RULES, min_weight_size=16)
    model = ResidualMLP(jax.random.key(0))
    data = {
        k: np.concatenate([b[k] for b in batches(3, features=16)]) for k in ("x", "y")
    }
    states = []
    for where in (layout, tp_mesh):
        extra = (
            {}
            if where is layout
            else dict(strategy="fsdp", param_rules=RULES, min_weight_size=16)
        )
        step = ed.make_train_step(loss_fn, ADAMW, where, **extra)
        state = ed.TrainState.create(model, ADAMW, jax.random.key(1))
        with ed.BatchLoader(data, 32, where, shuffle=False, prefetch=0) as loader:
            for i, batch in loader.iterate():
                if i == 3:
                    break
                assert batch["x"].sharding.spec == P("data")
                state, _ = step(state, batch)
        states.append(state)
    assert eqx.tree_equal(states[0].model, states[1].model)
    eval_step = ed.make_eval_step(lambda m, b, mask: {"n": (mask.sum(), 1)}, layout)
    assert int(eval_step(states[0], {"x": data["x"][:5]})["n"][0]) == 5


def test_the_v0_4_keyword_mesh_still_works(tp_mesh):
    step = ed.make_train_step(loss_fn, ADAMW, mesh=tp_mesh, strategy="fsdp")
    assert step.layout.strategy == "fsdp"
    loader = ed.BatchLoader(np.zeros((64, 2)), 8, mesh=tp_mesh, data_axis="data")
    assert loader.layout.data_axes == ("data",)


@pytest.mark.parametrize(
    "make",
    [
        lambda layout: ed.make_train_step(loss_fn, ADAMW, layout, strategy="fsdp"),
        lambda layout: ed.make_eval_step(lambda m, b, k: {}, layout, data_axis="data"),
        lambda layout: ed.BatchLoader(np.zeros((8, 2)), 8, layout, context_axis="x"),
    ],
    ids=["train", "eval", "loader"],
)
def test_a_layout_with_a_layout_keyword_is_refused(tp_mesh, make):
    with pytest.raises(ValueError, match=r"is given with an ed\.Layout.*ed\.Layout\("):
        make(ed.Layout(tp_mesh))


def test_unknown_keywords_and_arguments_are_named(tp_mesh):
    with pytest.raises(TypeError, match="unexpected keyword argument 'stratgy'"):
        ed.make_train_step(loss_fn, ADAMW, tp_mesh, stratgy="fsdp")
    with pytest.raises(TypeError, match="both `layout` and `mesh`"):
        ed.make_train_step(loss_fn, ADAMW, tp_mesh, mesh=tp_mesh)
    with pytest.raises(TypeError, match="missing the `layout` argument"):
        ed.make_eval_step(lambda m, b, k: {})
    with pytest.raises(TypeError, match=r"`donate` must be True or False; got 1"):
        ed.make_train_step(loss_fn, ADAMW, tp_mesh, donate=1)


@dataclasses.dataclass
class _Case:
    keywords: dict
    error: type
    match: str


CONSTRUCTOR_ERRORS = {
    "strategy": _Case({"strategy": "ddp"}, ValueError, r"unknown strategy 'ddp'"),
    "axis": _Case({"data_axis": "batch"}, ValueError, r"`data_axis`='batch' is not"),
    "option": _Case(
        {"fsdp_gather": "minibatch"}, ValueError, r"`fsdp_gather`='minibatch' is given"
    ),
    "rule_on_data": _Case(
        {"param_rules": [("w", P("data"))]}, ValueError, r"names the data axis"
    ),
    "context_is_data": _Case(
        {"context_axis": "data"}, ValueError, r"`context_axis`='data' is also a data"
    ),
    "rule_on_context": _Case(
        {"context_axis": "model", "param_rules": [("w", P("model"))]},
        ValueError,
        r"name the context axis 'model'",
    ),
    "pipeline_type": _Case({"pipeline": "stage"}, TypeError, r"must be an ed.Pipeline"),
    "rules_type": _Case({"param_rules": {"w": P()}}, TypeError, r"list or tuple"),
    "min_weight_size": _Case({"min_weight_size": -1}, ValueError, r">= 0; got -1"),
}


@pytest.mark.parametrize("name", CONSTRUCTOR_ERRORS)
def test_the_constructor_raises_every_layout_error(tp_mesh, name):
    case = CONSTRUCTOR_ERRORS[name]
    with pytest.raises(case.error, match=r"^Layout: .*" + case.match):
        ed.Layout(tp_mesh, **case.keywords)
    # The shorthand raises the same, naming its caller.
    with pytest.raises(case.error, match=r"^make_train_step: .*" + case.match):
        ed.make_train_step(loss_fn, optax.sgd(0.1), tp_mesh, **case.keywords)


def test_one_f_one_b_with_a_context_axis_is_refused_by_the_train_step_only():
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "context"))
    layout = ed.Layout(
        mesh,
        pipeline=ed.Pipeline("stage", microbatches=2, schedule="1f1b"),
        context_axis="context",
    )
    with pytest.raises(ValueError, match=r"make_train_step: .*schedule='1f1b'"):
        ed.make_train_step(loss_fn, ADAMW, layout)
    ed.make_eval_step(lambda m, b, mask: {}, layout)  # the forward pass runs
