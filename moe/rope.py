"""Rotary positions: the frequency of each rotated pair (with the context-extension rules the open
MoE checkpoints use), the cos/sin tables, and the rotation itself.

Shapes follow the project's legend (docs/design.md): B batch, L sequence length, H heads, Y rotary
dims of one head (the head dim J, or MLA's ``qk_rope_head_dim``).

Scaling types (``RopeSpec.scaling``), each as transformers' ``modeling_rope_utils`` computes it:

- ``none``: ``1 / theta^(2i / Y)``.
- ``linear``: those divided by ``factor`` (position interpolation).
- ``yarn``: per pair, a ramp between the original frequency (pairs that turn more than
  ``beta_fast`` times over ``original_max_seq_len``) and the interpolated one (fewer than
  ``beta_slow`` turns); cos and sin are multiplied by the attention factor (given, or
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
  ``mscale(factor)``, where ``mscale(s, m) = 0.1 m ln(s) + 1``), which scales the scores by its
  square.
- ``llama3``: long wavelengths (beyond ``original_max_seq_len / low_freq_factor``) divided by
  ``factor``, short ones (below ``original_max_seq_len / high_freq_factor``) kept, a smooth blend
  between.

``dynamic`` (NTK) is not here: it rescales by the length of each forward's sequence, and only
beyond ``max_position_embeddings``, an inference-time extrapolation; at training lengths it is the
default table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_SCALINGS = ("none", "linear", "yarn", "llama3")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 m ln(s) + 1`` (1 for ``s <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    original_max_seq_len: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: unset (transformers treats a falsy value as absent)
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def attention_scale(self) -> float:
        """The factor on cos and sin (1 but for yarn)."""
        if self.scaling != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def inv_frequencies(dim: int, spec: RopeSpec, device=None) -> torch.Tensor:
    """The angle per position of each of the ``dim / 2`` rotated pairs, fp32 ``[Y/2]``."""
    # the same float32 ops, in the same order, as transformers' tables: the ids stay on the same bits
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    if spec.scaling == "none":
        return 1.0 / spec.theta**exponents
    if spec.scaling == "linear":
        return 1.0 / spec.theta**exponents / spec.factor
    if spec.scaling == "yarn":
        return _yarn(dim, spec, spec.theta**exponents, device)
    if spec.scaling == "llama3":
        return _llama3(spec, 1.0 / spec.theta**exponents)
    raise ValueError(f"rope scaling {spec.scaling!r} is not one of {ROPE_SCALINGS}")


def _yarn(dim: int, spec: RopeSpec, pos_freqs: torch.Tensor, device) -> torch.Tensor:
    base, orig = spec.theta, spec.original_max_seq_len

    def correction_dim(rotations: float) -> float:
        # the pair index whose wavelength fits ``rotations`` turns into the original context
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp: avoid dividing by zero (as transformers does)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    extrapolation = 1 - ramp  # 1: keep the original frequency (fast-turning pairs)
    return (1.0 / (spec.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3(spec: RopeSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    orig, factor = spec.original_max_seq_len, spec.factor
    low_wavelen, high_wavelen = orig / spec.low_freq_factor, orig / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(seq_len: int, dim: int, spec: RopeSpec | float = 10000.0, device=None):
    """cos and sin of each position's rotation angles, each ``[L, Y/2]`` (times yarn's attention
    factor). ``spec``: a ``RopeSpec``, or a bare theta for the unscaled table."""
    if not isinstance(spec, RopeSpec):
        spec = RopeSpec(theta=float(spec))
    inv_freq = inv_frequencies(dim, spec, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    scale = spec.attention_scale()
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def apply_rotary(x_BHLY: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """Rotate each pair of the last dim by its angle: ``cos``/``sin`` ``[L, Y/2]``, or ``[B, 1, L, Y/2]``
    when each sequence has its own positions (documents).

    Half-split (GPT-NeoX, Llama): pairs ``(x[i], x[i + Y/2])``. Interleaved (DeepSeek's
    ``rope_interleave``): pairs ``(x[2i], x[2i + 1])``, rotated in place. transformers' interleaved
    rotation returns the pairs de-interleaved (evens then odds); queries and keys are permuted
    alike, so their dot products, all attention sees, are the same."""
    # contiguous: queries and keys arrive as head-split views of the fused projection, and each
    # product over such a view's short rows (Y/2 values) ran at 3 GB/s on a CPU core against 25
    # for the copy and contiguous products (docs/design.md); in bf16 the upcast copies anyway
    x = x_BHLY.to(torch.float32, memory_format=torch.contiguous_format)
    if not x.is_contiguous():  # fp32 in: .to returns the view itself
        x = x.contiguous()
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x_BHLY.dtype)


def document_positions(doc_ids_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(segment_BL, pos_BL)``: each token's document, numbered from 0 along its sequence, and its
    position within that document. A document is a run of equal ids: a change of id starts one (so
    ids need only differ between neighbours, and a reused id further on is a new document)."""
    B, L = doc_ids_BL.shape
    starts_BL = torch.ones_like(doc_ids_BL, dtype=torch.bool)
    starts_BL[:, 1:] = doc_ids_BL[:, 1:] != doc_ids_BL[:, :-1]
    segment_BL = starts_BL.long().cumsum(1) - 1
    t_BL = torch.arange(L, device=doc_ids_BL.device).expand(B, L)
    # the index of each token's document start: the running maximum of the start indices so far
    start_BL = torch.where(starts_BL, t_BL, torch.zeros_like(t_BL)).cummax(1).values
    return segment_BL, t_BL - start_BL
