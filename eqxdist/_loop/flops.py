"""How fast a run is against the hardware: the FLOPs of a compiled step (XLA's
cost analysis) and model FLOP utilisation against a table of device peaks."""

from collections.abc import Sequence
from typing import Any

import jax

from .._utils import typecheck

# Peak dense bfloat16 FLOP/s per device (vendor data sheets, without sparsity),
# keyed by a lower-case substring of `device.device_kind`. The first match wins,
# so the specific variants come before the family name.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("h200", 989e12),  # also GH200
    ("h800", 989e12),
    ("b200", 2250e12),
    ("a100", 312e12),  # SXM and PCIe
    ("a800", 312e12),
    ("l40s", 362e12),
    ("l4", 121e12),
    ("a10g", 70e12),
    ("tpu v6 lite", 918e12),  # v6e (Trillium)
    ("tpu v6e", 918e12),
    ("tpu v5 lite", 197e12),  # v5e
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),  # v5p reports "TPU v5"
    ("tpu v4", 275e12),
    ("tpu v3", 123e12),
    ("tpu v2", 46e12),
)


def peak_flops(device: Any) -> float | None:
    """The peak dense bfloat16 FLOP/s of one device, from its `device_kind`;
    `None` on CPU or for a kind not in the table."""
    if getattr(device, "platform", None) == "cpu":
        return None
    kind = str(getattr(device, "device_kind", "")).lower()
    for key, peak in PEAK_BF16_FLOPS:
        if key in kind:
            return peak
    return None


@typecheck
def mfu(
    flops_per_step: float | int,
    seconds_per_step: float | int,
    devices: Sequence[Any] | None = None,
) -> float | None:
    """Model FLOP utilisation: the fraction of the devices' peak dense bfloat16
    FLOP/s that a step achieves, `flops_per_step / seconds_per_step / sum(peaks)`.

    Use it with `TrainStep.cost(state, batch)["model_flops"]` (or an analytic count,
    e.g. 6 x parameters x tokens for a transformer) and a measured step time.

    **Arguments:**

    - `flops_per_step`: floating-point operations of one step, all devices together.
    - `seconds_per_step`: measured wall-clock time of one step.
    - `devices`: the devices the step runs on (default `jax.devices()`); any
      objects with `device_kind` and `platform` attributes.

    **Returns:**

    A float (0.4 means 40% of peak), or `None` when a device's peak is unknown
    (CPU, or a kind not in `eqxdist`'s table).

    **Raises:**

    `ValueError` for a negative `flops_per_step`, a `seconds_per_step` that is not
    positive, or an empty `devices`.
    """
    if flops_per_step < 0:
        raise ValueError(f"mfu: `flops_per_step` must be >= 0; got {flops_per_step}.")
    if not seconds_per_step > 0:
        raise ValueError(
            f"mfu: `seconds_per_step` must be > 0; got {seconds_per_step}."
        )
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("mfu: `devices` is empty; pass the devices the step runs on.")
    peaks = [peak_flops(d) for d in devices]
    if any(p is None for p in peaks):
        return None
    return float(flops_per_step / seconds_per_step / sum(p for p in peaks if p))
