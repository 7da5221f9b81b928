"""Metric pytrees as steps return them (`eqxdist/_metrics/tree.py`): printed
by `print_metrics`."""

import jax.numpy as jnp
import pytest

import eqxdist as ed


def test_print_metrics_format(capsys):
    accuracy = ed.metrics.Accuracy().update(
        jnp.array([1, 2, 3, 3]), jnp.array([1, 2, 0, 0])
    )
    ed.print_metrics(
        {"loss": (jnp.array(2.0), 4), "accuracy": accuracy}, "FSDP - Final metrics"
    )
    # The tutorial's rule: centred in `=` to the longest line's width; a title
    # wider than every line still gets one `=` on each side.
    assert capsys.readouterr().out == (
        "= FSDP - Final metrics =\nloss: 0.500000\naccuracy: 0.500000\n"
    )
    ed.print_metrics({"loss": (jnp.array(2.0), 4)}, "Final")
    assert capsys.readouterr().out == "=== Final ====\nloss: 0.500000\n"
    ed.print_metrics({"a_long_metric_name": (jnp.array(1.0), 2)}, "T")
    assert capsys.readouterr().out == (
        "============ T =============\na_long_metric_name: 0.500000\n"
    )
    ed.print_metrics({"loss": (jnp.array(1.0), 3)})
    assert capsys.readouterr().out == "loss: 0.333333\n"
    ed.print_metrics({"x": jnp.array([1.0, 0.5])})
    assert capsys.readouterr().out == "x: [1. , 0.5]\n"
    with pytest.raises(TypeError, match=r"metric 'name' is a str"):
        ed.print_metrics({"name": "resnet"})
