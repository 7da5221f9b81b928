"""`MetricCollection` (`eqxdist/_metrics/base.py`): a collection of the v0.2 and
the new metrics syncs with one all-reduce per (ReduceOp, dtype) in use, counted in
the compiled HLO; its state dict round trips."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from harness import smap
from jax.sharding import PartitionSpec as P

import eqxdist as ed

N_DEV, ROWS, C = 8, 4, 3


def _collection():
    return ed.MetricCollection(
        {
            # v0.2
            "acc": ed.metrics.Accuracy(),
            "f1": ed.metrics.F1Score(C),
            "auroc": ed.metrics.AUROC(),
            "loss": ed.metrics.Mean(),
            "std": ed.metrics.Std(),
            "peak": ed.metrics.Max(),
            # new
            "mse": ed.metrics.MeanSquaredError(),
            "rmse": ed.metrics.MeanSquaredError(squared=False),
            "mae": ed.metrics.MeanAbsoluteError(),
            "msle": ed.metrics.MeanSquaredLogError(),
            "r2": ed.metrics.R2Score(),
            "pearson": ed.metrics.PearsonCorrCoef(),
            "ap": ed.metrics.AveragePrecision(),
            "mcc": ed.metrics.MatthewsCorrCoef(C),
            "kappa": ed.metrics.CohenKappa(C),
            "jaccard": ed.metrics.JaccardIndex(C),
            "specificity": ed.metrics.Specificity(C),
            "ece": ed.metrics.CalibrationError(),
            "p@2": ed.metrics.PrecisionAtK(2),
            "r@2": ed.metrics.RecallAtK(2),
            "ndcg@2": ed.metrics.NDCGAtK(2),
            "mrr": ed.metrics.MRR(),
            "psnr": ed.metrics.PSNR(1.0),
            "ssim": ed.metrics.SSIM(1.0),
        }
    )


def _data():
    rng = np.random.default_rng(0)
    n = N_DEV * ROWS
    logits = rng.normal(size=(n, C)).astype(np.float32)
    return {
        "logits": logits,
        "labels": rng.integers(0, C, n).astype(np.int32),
        "mask": rng.random(n) < 0.8,
        "x": rng.random(n).astype(np.float32),
        "y": rng.random(n).astype(np.float32),
        "relevance": rng.integers(0, 3, (n, 5)).astype(np.float32),
        "images": rng.random((n, 11, 11)).astype(np.float32),
    }


def _update(metrics, d):
    classes = (d["logits"], d["labels"], d["mask"])
    binary = (d["x"], (d["y"] > 0.5).astype(jnp.int32), d["mask"])
    pairs = (d["x"], d["y"], d["mask"].astype(jnp.float32))
    retrieval = (d["relevance"] + d["x"][:, None], d["relevance"], d["mask"])
    images = (d["images"], d["images"] * 0.9, d["mask"])
    args = {
        "acc": classes,
        "f1": classes,
        "auroc": binary,
        "loss": (d["x"], d["mask"]),
        "std": (d["y"],),
        "peak": (d["x"],),
        "ap": binary,
        "ece": (jax.nn.softmax(d["logits"]), d["labels"], d["mask"]),
        "psnr": images,
        "ssim": images,
    }
    args |= {name: pairs for name in ("mse", "rmse", "mae", "msle", "r2", "pearson")}
    args |= {name: classes for name in ("mcc", "kappa", "jaccard", "specificity")}
    args |= {name: retrieval for name in ("p@2", "r@2", "ndcg@2", "mrr")}
    return metrics.update(**args)


def test_one_all_reduce_per_op_and_dtype_and_global_values(mesh8):
    data = _data()

    def per_device(d):
        return _update(_collection(), d).reduce("data")

    fn = smap(mesh8, per_device, P("data"))
    lowered = fn.lower(data)
    # (sum, int32): every count; (sum, float32): the float sums and the folded
    # moments; (max, float32): `Max`. Nothing else, however many metrics.
    assert len(re.findall(r"stablehlo\.all_reduce", lowered.as_text())) == 3
    counted = ed.count_collectives(lowered.compile())
    assert 1 <= counted["all-reduce"] <= 3, counted
    assert sum(counted.values()) == counted["all-reduce"], counted

    # Values of each family against scikit-learn are in their own test files;
    # here: the collection's values are finite where defined, and round trip.
    reduced = fn(data)
    computed = reduced.compute()
    assert all(np.isfinite(computed[name]).all() for name in computed if name != "psnr")
    np.testing.assert_allclose(
        computed["psnr"],
        10
        * np.log10(
            1
            / np.mean(
                (0.1 * data["images"][data["mask"]]).astype(np.float64) ** 2,
                axis=(1, 2),
            )
        ).mean(),
        rtol=1e-5,
    )

    loaded = _collection().load_state_dict(reduced.state_dict())
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(reduced), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
