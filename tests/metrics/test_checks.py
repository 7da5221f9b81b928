"""The input checks of the regression, ranking, retrieval, calibration, image and
confusion-score metrics (`eqxdist/_metrics/checks.py`): every caller mistake is a
clear `ValueError`/`TypeError` naming the argument, the value seen and what was
expected (one table)."""

import numpy as np
import pytest

import eqxdist as ed

F = np.float32
X = np.array([0.2, 0.4, 0.6, 0.8], F)
Y = np.array([0, 1, 1, 0], np.int32)
SCORES = np.array([[0.1, 0.5, 0.2], [0.3, 0.3, 0.9]], F)
RELEVANCE = np.array([[0, 1, 2], [1, 0, 0]], F)
PROBS = np.array([[0.7, 0.3], [0.4, 0.6], [0.5, 0.5], [0.9, 0.1]], F)
IMAGES = np.zeros((2, 11, 12), F)


def mine_or_hook(mine, parameter, value):
    """Our own message, or the one of the type checker that the test run adds
    (jaxtyping's pytest hook): both name the argument, the value and the type."""
    return rf"(?s)({mine}|parameter '{parameter}'.*Actual value: {value})"


NOT_BOOL = r"`mask` must be boolean.*got dtype"
CASES = [
    # regression
    (
        lambda: ed.metrics.MeanSquaredError(squared="yes"),
        TypeError,
        mine_or_hook(r"`squared` must be a bool, got 'yes'", "squared", "'yes'"),
    ),
    (
        lambda: ed.metrics.MeanSquaredError().update(X, X[:3]),
        ValueError,
        r"MeanSquaredError.update: `preds` of shape \(4,\) and `targets` of shape "
        r"\(3,\) must have the same shape",
    ),
    (
        lambda: ed.metrics.MeanAbsoluteError().update(None, X),
        TypeError,
        mine_or_hook(r"`preds`.*got None", "preds", "None"),
    ),
    (
        lambda: ed.metrics.R2Score().update(X, X, weights=np.ones(3, F)),
        ValueError,
        r"R2Score.update: `weights` of shape \(3,\) does not broadcast to the shape "
        r"of `targets`, \(4,\)",
    ),
    (
        lambda: ed.metrics.MeanSquaredLogError().update(X - 1.5, X),
        ValueError,
        r"MeanSquaredLogError.update: `preds` holds -1.(3|29).*needs values > -1",
    ),
    (
        lambda: ed.metrics.PearsonCorrCoef().update(X > 0.5, X),
        TypeError,
        r"PearsonCorrCoef.update: `preds` must hold numbers, got dtype bool",
    ),
    (
        lambda: ed.metrics.R2Score().update(np.array(["a"] * 4), X),
        TypeError,
        r"R2Score.update: `preds` must hold numbers or booleans, got dtype <U1",
    ),
    # AveragePrecision
    (
        lambda: ed.metrics.AveragePrecision(1),
        ValueError,
        r"AveragePrecision: `num_thresholds` must be >= 2, got 1",
    ),
    (
        lambda: ed.metrics.AveragePrecision(2.5),
        TypeError,
        mine_or_hook(
            r"`num_thresholds` must be an int, got 2.5", "num_thresholds", "2.5"
        ),
    ),
    (
        lambda: ed.metrics.AveragePrecision().update(Y, Y),
        TypeError,
        r"AveragePrecision.update: `scores` must be floats in \[0, 1\], got dtype int",
    ),
    (
        lambda: ed.metrics.AveragePrecision().update(
            X, Y, mask=np.array([1.0, 0.5, 0, 1])
        ),
        TypeError,
        r"AveragePrecision.update: `mask` must be boolean.*got dtype float.*"
        r"pass per-example weights as `weights=`",
    ),
    (
        lambda: ed.metrics.AveragePrecision().update(
            X, Y, mask=np.array([1, 1, 0, -1])
        ),
        TypeError,
        NOT_BOOL,
    ),
    (
        lambda: ed.metrics.AveragePrecision().update(X + 1, Y),
        ValueError,
        r"`scores`\[0\] is 1.2.*outside \[0, 1\]",
    ),
    (
        lambda: ed.metrics.AveragePrecision().update(X, Y + 1),
        ValueError,
        r"`labels`\[1\] is 2, outside \[0, 1\]",
    ),
    (
        lambda: ed.metrics.AveragePrecision().update(X, Y[:3]),
        ValueError,
        r"`scores` of shape \(4,\) and `labels` of shape \(3,\) must have the same",
    ),
    (
        lambda: ed.metrics.AveragePrecision().update(X, Y, weights=np.ones((2, 4))),
        ValueError,
        r"`weights` of shape \(2, 4\) does not broadcast",
    ),
    # confusion scores
    (
        lambda: ed.metrics.MatthewsCorrCoef(1),
        ValueError,
        r"MatthewsCorrCoef: `num_classes` must be >= 2, got 1",
    ),
    (
        lambda: ed.metrics.JaccardIndex(3, "binary"),
        ValueError,
        r"JaccardIndex: average='binary'.*num_classes=3",
    ),
    (
        lambda: ed.metrics.Specificity(3, average="foo"),
        ValueError,
        r"Specificity: unknown `average` 'foo'",
    ),
    (
        lambda: ed.metrics.CohenKappa(2).update(Y, Y, mask=np.ones(4)),
        TypeError,
        r"CohenKappa.update: `mask` must be boolean.*float.*takes no weights",
    ),
    (
        lambda: ed.metrics.JaccardIndex(2).update(Y, Y, mask=np.ones(3, bool)),
        ValueError,
        r"JaccardIndex.update: `mask` of shape \(3,\) does not broadcast",
    ),
    # CalibrationError
    (
        lambda: ed.metrics.CalibrationError(0),
        ValueError,
        r"CalibrationError: `num_bins` must be >= 1, got 0",
    ),
    (
        lambda: ed.metrics.CalibrationError().update(Y[:, None], Y),
        TypeError,
        r"CalibrationError.update: `probs` must be float probabilities, got dtype int",
    ),
    (
        lambda: ed.metrics.CalibrationError().update(PROBS, Y[:3]),
        ValueError,
        r"`probs` of shape \(4, 2\) must have the shape of `labels` \(3,\) plus a "
        r"trailing class axis",
    ),
    (
        lambda: ed.metrics.CalibrationError().update(PROBS * 2, Y),
        ValueError,
        r"`probs`\[0, 0\] is 1\.(4|39).*outside \[0, 1\]; pass probabilities",
    ),
    (
        lambda: ed.metrics.CalibrationError().update(PROBS, Y + 2),
        ValueError,
        r"`labels`\[0\] is 2, outside \[0, 1\]",
    ),
    (
        lambda: ed.metrics.CalibrationError().update(PROBS, Y, mask=Y),
        TypeError,
        NOT_BOOL,
    ),
    # retrieval
    (
        lambda: ed.metrics.PrecisionAtK(0),
        ValueError,
        r"PrecisionAtK: `k` must be >= 1, got 0",
    ),
    (
        lambda: ed.metrics.NDCGAtK(2.0),
        TypeError,
        mine_or_hook(r"NDCGAtK: `k` must be an int, got 2.0", "k", "2.0"),
    ),
    (
        lambda: ed.metrics.MRR().update(X, X),
        ValueError,
        r"MRR.update: `scores` must be \(queries, items\).*got shape \(4,\)",
    ),
    (
        lambda: ed.metrics.RecallAtK(2).update(SCORES, RELEVANCE[:, :2]),
        ValueError,
        r"`scores` of shape \(2, 3\) and `relevance` of shape \(2, 2\) must have",
    ),
    (
        lambda: ed.metrics.NDCGAtK(2).update(SCORES, -RELEVANCE),
        ValueError,
        r"NDCGAtK.update: `relevance`\[0, 1\] is -1.0.*relevance must be >= 0",
    ),
    (
        lambda: ed.metrics.PrecisionAtK(2).update(
            SCORES, RELEVANCE, np.ones((2, 3), bool)
        ),
        ValueError,
        r"`mask` of shape \(2, 3\) does not broadcast to the shape of the rows, \(2,\)",
    ),
    (
        lambda: ed.metrics.MRR().update(SCORES, RELEVANCE, np.array([1, 0])),
        TypeError,
        NOT_BOOL,
    ),
    # images
    (
        lambda: ed.metrics.PSNR(0.0),
        ValueError,
        r"PSNR: `data_range` must be a finite number > 0, got 0.0",
    ),
    (
        lambda: ed.metrics.SSIM("1"),
        TypeError,
        mine_or_hook(
            r"SSIM: `data_range` must be a number, got '1'", "data_range", "'1'"
        ),
    ),
    (
        lambda: ed.metrics.SSIM(1.0).update(IMAGES[:, :10], IMAGES[:, :10]),
        ValueError,
        r"SSIM.update: SSIM needs images of at least 11x11 pixels.*got 10x12",
    ),
    (
        lambda: ed.metrics.PSNR(1.0).update(IMAGES[0], IMAGES[0]),
        ValueError,
        r"PSNR.update: .*must be images \(B, H, W\) or \(B, H, W, C\), got shape "
        r"\(11, 12\)",
    ),
    (
        lambda: ed.metrics.PSNR(1.0).update(IMAGES, IMAGES, mask=np.ones(2, F)),
        TypeError,
        NOT_BOOL,
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), CASES, ids=[str(i) for i in range(len(CASES))]
)
def test_bad_input_raises_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()
