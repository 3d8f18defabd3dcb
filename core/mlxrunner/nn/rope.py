"""Rotary position embeddings as the published configs describe them.

``RoPE.from_config(head_dim, config)`` reads a config's ``rope_parameters`` (transformers
>= 5) or ``rope_scaling`` / ``rope_theta`` (older configs) and ``partial_rotary_factor``:
``default``, ``linear``, ``llama3``, ``yarn``, ``proportional`` (Gemma 4's full layers) and
a partial rotation (only the first dims rotate). Every kind is ``mx.fast.rope`` with
either a base or precomputed frequencies, so one kernel serves all; the offset may be an
int or an int32 array (a traced forward's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .host_ops import host_rope

KINDS = ("default", "linear", "llama3", "yarn", "proportional")


class RopeConfigError(ValueError):
    """A rope setting this module does not know or cannot use."""


class RoPE(nn.Module):
    """Rotate-half RoPE over the first ``dims`` of each head (``traditional`` rotates
    interleaved pairs), ``base`` or explicit ``freqs`` (periods, one per rotated pair), and
    ``scale`` on positions; ``mscale`` multiplies the rotated output (yarn's attention
    factor)."""

    def __init__(self, dims: int, *, base: float = 10000.0, traditional: bool = False,
                 scale: float = 1.0, freqs: mx.array | None = None, mscale: float = 1.0) -> None:
        super().__init__()
        self.dims = int(dims)
        self.base = float(base)
        self.traditional = traditional
        self.scale = float(scale)
        self.mscale = float(mscale)
        # kept out of the parameter tree: computed, never loaded
        self._freqs = None if freqs is None else freqs.astype(mx.float32)
        if self._freqs is not None:
            mx.eval(self._freqs)

    @property
    def freqs(self) -> mx.array | None:
        """The periods given (float32, one per rotated pair), or None where ``base`` gives
        them."""
        return self._freqs

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.mscale != 1.0:  # yarn scales the rotated dims only
            scaled = x[..., :self.dims] * mx.array(self.mscale, x.dtype)
            x = scaled if self.dims == x.shape[-1] else mx.concatenate(
                [scaled, x[..., self.dims:]], axis=-1)
        hosted = None if self.mscale != 1.0 else host_rope(
            x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
            offset=offset, freqs=self._freqs)
        if hosted is not None:
            return hosted
        if self._freqs is None:
            return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base,
                                scale=self.scale, offset=offset)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None,
                            scale=self.scale, offset=offset, freqs=self._freqs)

    @classmethod
    def from_config(cls, head_dim: int, config: Mapping[str, Any],
                    parameters: Mapping[str, Any] | None = None,
                    traditional: bool = False) -> RoPE:
        """The RoPE a config describes for heads of ``head_dim`` (``parameters``: a
        per-layer-type block to use instead of the config's own)."""
        if parameters is None:
            parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
            if not isinstance(parameters, Mapping):
                raise RopeConfigError(f"rope_parameters must be an object, got {parameters!r}")
            if any(isinstance(v, Mapping) for v in parameters.values()):
                raise RopeConfigError("rope_parameters holds one block per layer type: pass "
                                      "the layer's block as parameters=")
        kind = parameters.get("rope_type", parameters.get("type", "default")) or "default"
        if kind not in KINDS:
            raise RopeConfigError(f"unsupported rope_type {kind!r} (known: {', '.join(KINDS)})")
        try:
            theta = float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))
            partial = float(parameters.get("partial_rotary_factor",
                                           config.get("partial_rotary_factor", 1.0)))
        except (TypeError, ValueError):
            raise RopeConfigError("rope_theta and partial_rotary_factor must be numbers") \
                from None
        if not theta > 0 or not 0 < partial <= 1:
            raise RopeConfigError(f"rope_theta {theta} must be > 0 and partial_rotary_factor "
                                  f"{partial} in (0, 1]")
        if kind == "proportional":
            return cls(head_dim, traditional=traditional,
                       freqs=proportional_periods(head_dim, theta, partial,
                                                  float(parameters.get("factor", 1.0))))
        dims = int(head_dim * partial)
        if dims <= 0 or dims % 2:
            raise RopeConfigError(f"{dims} rotated dims of head_dim {head_dim}: must be even")
        if kind == "default":
            return cls(dims, base=theta, traditional=traditional)
        factor = float(parameters.get("factor", 1.0))
        if not factor > 0:
            raise RopeConfigError(f"rope factor {factor} must be > 0")
        if kind == "linear":
            return cls(dims, base=theta, traditional=traditional, scale=1.0 / factor)
        if kind == "llama3":
            return cls(dims, traditional=traditional, freqs=llama3_periods(
                dims, theta, factor, float(parameters.get("low_freq_factor", 1.0)),
                float(parameters.get("high_freq_factor", 4.0)),
                int(parameters.get("original_max_position_embeddings", 8192))))
        periods, mscale = yarn_periods(
            dims, theta, factor,
            int(parameters.get("original_max_position_embeddings",
                               config.get("max_position_embeddings", 4096))),
            float(parameters.get("beta_fast", 32.0)), float(parameters.get("beta_slow", 1.0)),
            parameters.get("mscale"), parameters.get("mscale_all_dim"),
            parameters.get("attention_factor"))
        return cls(dims, traditional=traditional, freqs=periods, mscale=mscale)


def _inverse_frequencies(dims: int, theta: float) -> mx.array:
    return theta ** -(mx.arange(0, dims, 2, dtype=mx.float32) / dims)


def proportional_periods(head_dim: int, theta: float, partial: float, factor: float = 1.0
                         ) -> mx.array:
    """Gemma 4's full-attention RoPE over the whole head: pair ``i`` of the first
    ``partial * head_dim / 2`` rotates with period ``factor * theta^(2i / head_dim)``; the
    other pairs do not rotate (infinite period)."""
    rotated = int(partial * head_dim // 2)
    periods = [factor * theta ** (2 * i / head_dim) for i in range(rotated)]
    periods += [math.inf] * (head_dim // 2 - rotated)
    return mx.array(periods, dtype=mx.float32)


def llama3_periods(dims: int, theta: float, factor: float, low: float, high: float,
                   original: int) -> mx.array:
    """Llama 3.1's frequency scaling: long wavelengths divided by ``factor``, short ones
    kept, a smooth blend between."""
    inv = _inverse_frequencies(dims, theta)
    wavelength = 2 * math.pi / inv
    low_wavelength, high_wavelength = original / low, original / high
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    inv = mx.where(wavelength > low_wavelength, inv / factor,
                   mx.where(wavelength < high_wavelength, inv, blended))
    return 1.0 / inv


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_periods(dims: int, theta: float, factor: float, original: int, beta_fast: float,
                 beta_slow: float, mscale: Any = None, mscale_all_dim: Any = None,
                 attention_factor: Any = None) -> tuple[mx.array, float]:
    """YaRN: interpolate low frequencies by ``factor`` and keep high ones, with a linear
    ramp between the dims where ``beta_fast`` and ``beta_slow`` rotations fit the original
    context; the output scale is the attention factor."""

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(beta_slow)), dims - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = _inverse_frequencies(dims, theta)
    inv = inv / factor * (1 - extrapolation) + inv * extrapolation
    if attention_factor is not None:
        out_scale = float(attention_factor)
    elif mscale is not None and mscale_all_dim is not None:
        out_scale = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor,
                                                                       float(mscale_all_dim))
    else:
        out_scale = _yarn_mscale(factor)
    return 1.0 / inv, out_scale
