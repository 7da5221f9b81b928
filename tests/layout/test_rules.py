"""The names-to-axes rules (`eqxdist/_layout/rules.py`), checked on specs alone: nothing
is compiled. The FSDP rule against a NumPy statement of it, the parameter rules'
matching and every mistake they report."""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxdist as ed
from eqxdist._layout.rules import FsdpRule, ParamRules, leaf_spec, merge_specs, restrict


@pytest.fixture(scope="module")
def tp_mesh():
    return ed.create_device_mesh({"data": 4, "model": 2})


def _numpy_rule(shape, size, minimum, layout):
    """The FSDP rule as the docs state it, written independently."""
    if int(np.prod(shape)) <= minimum:
        return P()
    dims = [i for i, d in enumerate(shape) if d % size == 0]
    if not dims:
        return P()
    dim = dims[0] if layout == "leading" else max(dims, key=lambda i: (shape[i], i))
    return P(*["data" if i == dim else None for i in range(len(shape))])


@pytest.mark.parametrize("layout", ["largest", "leading"])
def test_fsdp_rule_is_the_documented_rule(layout):
    for shape in itertools.product([1, 3, 4, 8, 12], repeat=2):
        for minimum in (0, 16, 31, 32):
            rule = FsdpRule("data", 4, minimum, layout)
            expected = _numpy_rule(shape, 4, minimum, layout)
            assert rule.spec(shape) == expected, (shape, minimum)
            assert leaf_spec(shape, 4, "data", minimum, prefer=layout) == expected
    tree = {"w": np.zeros((8, 12)), "name": "x"}
    assert ed.fsdp_specs(tree, 4, min_weight_size=0, layout=layout) == {
        "w": _numpy_rule((8, 12), 4, 0, layout),
        "name": None,
    }


def test_fsdp_rule_composes_with_a_parameter_rule():
    rule = FsdpRule("data", 4, 16, "leading")
    # The FSDP rule takes the first dimension the parameter rule leaves free.
    assert rule.spec((16, 32), P("model")) == P("model", "data")
    assert rule.spec((16, 32), P(None, "model")) == P("data", "model")
    # min_weight_size compares the leaf's full size, not its free part.
    assert rule.spec((4, 4), P("model")) == P("model")
    # No free dimension divides: the parameter rule alone.
    assert rule.spec((16, 6), P("model")) == P("model")
    assert rule.spec((16, 32), None) == P("data", None)


def test_restrict_keeps_the_named_axes():
    assert restrict(P("model", "data"), ("data",)) == P(None, "data")
    assert restrict(P(("replica", "data"), None), ("data",)) == P("data")
    assert restrict(P("model"), ("data",)) == P()
    assert restrict(None, ("data",)) is None


def test_param_rules_match_first_rule_and_report_unused(tp_mesh):
    rules = ParamRules(
        [(r"up\.weight", P("model", None)), (r"weight", P(None, "model"))],
        tp_mesh,
        ("data",),
        "make_train_step",
    )
    leaves = [np.zeros((8, 4)), np.zeros((4, 8)), np.zeros(3), "static"]
    paths = [".up.weight", ".down.weight", ".up.bias", ".name"]
    assert rules.match(paths, leaves) == [
        P("model", None),
        P(None, "model"),
        None,
        None,
    ]
    with pytest.raises(
        ValueError, match=r"make_train_step: .*'up\\\\.weight' matches no"
    ):
        rules.match(paths[1:], leaves[1:])


@pytest.mark.parametrize(
    ("rules", "error", "match"),
    [
        ([("w",)], TypeError, r"param_rules\[0\] is \('w',\); expected a pair"),
        ([(1, P())], TypeError, r"expected \(a regular expression string"),
        ([("(", P())], ValueError, "not a valid regular expression"),
        (
            [("w", P("tensor"))],
            ValueError,
            "names an axis the mesh lacks: 'tensor' is not an axis",
        ),
        ([("w", P("data"))], ValueError, "names the data axis 'data'"),
    ],
)
def test_param_rules_errors(tp_mesh, rules, error, match):
    with pytest.raises(error, match=match):
        ParamRules(rules, tp_mesh, ("data",), "make_train_step")


def test_param_rules_that_do_not_fit_a_leaf(tp_mesh):
    too_long = ParamRules([("w", P(None, None, "model"))], tp_mesh, ("data",), "f")
    with pytest.raises(ValueError, match=r"f: .*more entries than the leaf"):
        too_long.match([".w"], [np.zeros((4, 4))])
    odd = ParamRules([("w", P("model"))], tp_mesh, ("data",), "f")
    with pytest.raises(ValueError, match=r"dimension 0 of \.w \(shape \(3, 4\)\)"):
        odd.match([".w"], [jax.ShapeDtypeStruct((3, 4), np.float32)])


def test_merge_specs():
    assert merge_specs(P(None, "model"), P("data"), ".w", "f") == P("data", "model")
    assert merge_specs(None, P("data"), ".w", "f") == P("data")
    assert merge_specs(P("model"), None, ".w", "f") == P("model")
    with pytest.raises(ValueError, match=r"f: param_rules shard dimension 0 of \.w"):
        merge_specs(P("model"), P("data"), ".w", "f")
