"""`PSNR` and `SSIM` on 8 devices against scikit-image on the concatenated
images: one update, merged, synced inside `shard_map`, grayscale and colour,
with a mask over images."""

import numpy as np
import pytest
from harness import one_and_merged, synced
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

import eqxdist as ed

N_DEV, IMAGES = 8, 2


def _data(shape, data_range, seed=0):
    rng = np.random.default_rng(seed)
    targets = rng.random((N_DEV * IMAGES, *shape)) * data_range
    noise = (
        rng.normal(size=targets.shape)
        * data_range
        * rng.uniform(0.02, 0.3, (len(targets),) + (1,) * len(shape))
    )
    preds = np.clip(targets + noise, 0, data_range)
    mask = rng.random(len(targets)) < 0.8
    return preds.astype(np.float32), targets.astype(np.float32), mask


def _expected(preds, targets, mask, data_range):
    channel_axis = -1 if preds.ndim == 4 else None
    p, t = preds[mask].astype(np.float64), targets[mask].astype(np.float64)
    ssim = [
        structural_similarity(
            b,
            a,
            data_range=data_range,
            gaussian_weights=True,
            sigma=1.5,
            use_sample_covariance=False,
            channel_axis=channel_axis,
        )
        for a, b in zip(p, t, strict=True)
    ]
    psnr = [
        peak_signal_noise_ratio(b, a, data_range=data_range)
        for a, b in zip(p, t, strict=True)
    ]
    return {"ssim": np.mean(ssim), "psnr": np.mean(psnr)}


@pytest.mark.parametrize(
    ("shape", "data_range"), [((13, 16), 1.0), ((12, 11, 3), 255.0)]
)
def test_one_update_merged_and_synced_match_skimage(mesh8, shape, data_range):
    preds, targets, mask = _data(shape, data_range)
    expected = _expected(preds, targets, mask, data_range)

    def collection():
        return ed.MetricCollection(
            {"ssim": ed.metrics.SSIM(data_range), "psnr": ed.metrics.PSNR(data_range)}
        )

    def update(metrics, p, t, m):
        return metrics.update(
            ssim=(p, t, m), psnr={"preds": p, "targets": t, "mask": m}
        )

    data = (preds, targets, mask)
    on_devices = synced(mesh8, collection, update, data, compute=True)
    for computed in (*one_and_merged(collection, update, data), on_devices):
        for name, want in expected.items():
            np.testing.assert_allclose(computed[name], want, rtol=2e-5, err_msg=name)


def test_identical_images():
    x = np.random.default_rng(1).random((2, 11, 11)).astype(np.float32)
    assert float(ed.metrics.SSIM(1.0).update(x, x).compute()) == pytest.approx(1.0)
    assert float(ed.metrics.PSNR(1.0).update(x, x).compute()) == np.inf
