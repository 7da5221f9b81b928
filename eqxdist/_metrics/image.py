"""Image quality against a reference, averaged over images: `PSNR` and `SSIM`.

Both take `update(preds, targets, mask=None)` on float images `(B, H, W)` or
`(B, H, W, C)` of the same shape, with an optional boolean `mask` `(B,)` of the
images to count, and hold a `Mean` of the per-image values (a compensated float
sum and a carried integer count of images).
"""

import abc
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .aggregation import Mean
from .base import Metric
from .checks import float_input, positive_float, same_shape
from .inputs import counted_mask, float_dtype

_I = TypeVar("_I", bound="_PerImage")

WINDOW = 11
SIGMA = 1.5
K1, K2 = 0.01, 0.03


class _PerImage(Metric):
    """The mean over images of a per-image value."""

    per_image: Mean
    data_range: float = eqx.field(static=True)

    def __init__(self, data_range: float):
        self.data_range = positive_float(data_range, type(self).__name__, "data_range")
        self.per_image = Mean()

    def update(
        self: _I,
        preds: ArrayLike,
        targets: ArrayLike,
        mask: ArrayLike | None = None,
    ) -> _I:
        """Add a batch of images: `preds` and `targets` `(B, H, W)` or
        `(B, H, W, C)` alike, `mask` `(B,)` boolean (`None`: every image).

        **Raises:**

        `TypeError` for non-numeric input or a non-boolean `mask`; `ValueError`
        for other shapes, or shapes that differ.
        """
        caller = f"{type(self).__name__}.update"
        p = float_input(preds, caller, "preds")
        t = float_input(targets, caller, "targets")
        same_shape(p, t, caller, ("preds", "targets"), "one image per reference")
        if p.ndim not in (3, 4):
            raise ValueError(
                f"{caller}: `preds` and `targets` must be images (B, H, W) or "
                f"(B, H, W, C), got shape {p.shape}."
            )
        if p.ndim == 3:
            p, t = p[..., None], t[..., None]
        self._check_size(p.shape, caller)
        counted = counted_mask(
            mask, p.shape[:1], caller, has_weights=False, target="the rows"
        )
        values = self._per_image(p, t).astype(float_dtype())
        update = self.per_image.update(values, None if mask is None else counted)
        return self._with_children({"per_image": update})

    def _check_size(self, shape: tuple[int, ...], caller: str) -> None:
        """Raise for images too small for the metric."""

    @abc.abstractmethod
    def _per_image(self, preds: Array, targets: Array) -> Array:
        """The `(B,)` values of `(B, H, W, C)` images."""

    def compute(self) -> Array:
        """The mean over the counted images; NaN while none was counted."""
        return self.per_image.compute()


class PSNR(_PerImage):
    """Peak signal-to-noise ratio in dB, `10 log10(data_range**2 / MSE)` per image
    (scikit-image's `peak_signal_noise_ratio`), averaged over images. An image
    equal to its reference has PSNR `inf`, and so has the mean then.

    **Arguments:**

    - `data_range`: the range of pixel values (e.g. `1.0` or `255.0`), > 0.

    !!! Example

        ```python
        ed.metrics.PSNR(data_range=1.0).update(denoised, clean).compute()
        ```
    """

    def _per_image(self, preds: Array, targets: Array) -> Array:
        mse = jnp.mean((preds - targets) ** 2, axis=(1, 2, 3))
        return 10 * jnp.log10(self.data_range**2 / mse)


def _gaussian_window(dtype: jnp.dtype) -> Array:
    x = jnp.arange(WINDOW, dtype=dtype) - WINDOW // 2
    g = jnp.exp(-0.5 * (x / SIGMA) ** 2)
    return g / g.sum()


def _filtered(maps: Array) -> Array:
    """`maps` `(M, H, W)` filtered by the separable Gaussian window where it fits
    entirely (`(M, H - 10, W - 10)`): the pixels whose SSIM scikit-image keeps."""
    g = _gaussian_window(maps.dtype)
    x = maps[:, None]
    for kernel in (g.reshape(1, 1, WINDOW, 1), g.reshape(1, 1, 1, WINDOW)):
        x = jax.lax.conv_general_dilated(
            x, kernel, (1, 1), "VALID", precision=jax.lax.Precision.HIGHEST
        )
    return x[:, 0]


class SSIM(_PerImage):
    """Structural similarity, per image the mean of the SSIM map over its pixels
    and channels, averaged over images: scikit-image's `structural_similarity(
    ..., data_range=data_range, gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False)` (with `channel_axis=-1` for `(B, H, W, C)`):
    local statistics under an 11x11 Gaussian window of sigma 1.5, `K1 = 0.01`,
    `K2 = 0.03`, over the pixels at least 5 from the border. Images must be at
    least 11x11.

    **Arguments:**

    - `data_range`: the range of pixel values (e.g. `1.0` or `255.0`), > 0.

    !!! Example

        ```python
        ed.metrics.SSIM(data_range=1.0).update(reconstructed, images).compute()
        ```
    """

    def _check_size(self, shape: tuple[int, ...], caller: str) -> None:
        if min(shape[1:3]) < WINDOW:
            raise ValueError(
                f"{caller}: SSIM needs images of at least {WINDOW}x{WINDOW} pixels "
                f"(its Gaussian window), got {shape[1]}x{shape[2]}."
            )

    def _per_image(self, preds: Array, targets: Array) -> Array:
        b, h, w, c = preds.shape
        x = jnp.moveaxis(preds, -1, 1).reshape(b * c, h, w)
        y = jnp.moveaxis(targets, -1, 1).reshape(b * c, h, w)
        mx, my, xx, yy, xy = jnp.split(
            _filtered(jnp.concatenate([x, y, x * x, y * y, x * y])), 5
        )
        vx, vy, vxy = xx - mx * mx, yy - my * my, xy - mx * my
        c1, c2 = (K1 * self.data_range) ** 2, (K2 * self.data_range) ** 2
        ssim = ((2 * mx * my + c1) * (2 * vxy + c2)) / (
            (mx * mx + my * my + c1) * (vx + vy + c2)
        )
        return ssim.reshape(b, -1).mean(axis=-1)
