"""fp8 (e4m3) KV-cache scales computed from a sample of keys and values.

``scale = amax / 448 * margin`` so that the sample's largest magnitude maps to the top of the e4m3
range (vLLM's ``calculate_kv_scales`` does the same on the first forward pass). A ``margin > 1``
leaves headroom for later activations larger than the sample. Scales never drop below
``min_scale``, so an all-zero sample (or head) still gives a finite, usable scale.
"""

from __future__ import annotations

import torch

from kernels.checks import KernelArgumentError

FP8_MAX = 448.0


def compute_kv_scales(
    key: torch.Tensor,  # [T, Hkv, D] (any float dtype; more leading dims are flattened)
    value: torch.Tensor,  # [T, Hkv, D]
    per_head: bool = False,
    margin: float = 1.0,
    min_scale: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:  # k_scale, v_scale: [1] or [Hkv] float32
    """Return ``(k_scale, v_scale)`` for ``write_kv`` / the attention kernels.

    Raises :class:`KernelArgumentError` for non-float or mis-shaped input, or a margin <= 0.
    """
    if margin <= 0:
        raise KernelArgumentError(f"margin must be > 0, got {margin}")
    scales = []
    for name, x in (("key", key), ("value", value)):
        if not x.is_floating_point() or x.dim() < 2:
            raise KernelArgumentError(
                f"{name} must be a float tensor [..., Hkv, D], got {x.dtype} {tuple(x.shape)}"
            )
        x = x.detach().reshape(-1, x.shape[-2], x.shape[-1]).to(torch.float32)  # [N, Hkv, D]
        if x.shape[0] == 0:
            raise KernelArgumentError(f"{name} sample is empty")
        amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax().reshape(1)  # [Hkv] | [1]
        if not bool(torch.isfinite(amax).all()):
            raise KernelArgumentError(f"{name} sample contains inf or NaN")
        scales.append((amax * (margin / FP8_MAX)).clamp_min(min_scale))
    return scales[0], scales[1]
