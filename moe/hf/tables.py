"""The vocabulary the family tables are written in: ``Row`` (our tensors against theirs, with the
layout change each way), ``Field`` (our config field against theirs), ``Fixed`` (their field with
one valid value), and transformers 5's fused expert layout against ours (``fused_to_ours``,
``ours_to_fused``, also used by ``moe.hf.patch``). ``moe.hf.adapter`` reads the tables.

Shapes follow the project's legend (docs/design.md): D model dim, F expert hidden dim, X experts
held by this process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model import TransformerConfig

# ---------------------------------------------------------------------------------------------
# the expert layouts (also used by moe.hf.patch, which copies transformers' fused experts through them)


def fused_to_ours(gate_up: torch.Tensor, down_XDF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers 5's fused experts -> ``(w1, w3, w2)`` in our layout, as views (no copy).

    ``gate_up [X, 2F, D]`` holds the gate rows then the up rows of each expert; ``down [X, D, F]``.
    Ours: ``w1, w3 [X, D, F]``, ``w2 [X, F, D]``."""
    F = down_XDF.shape[2]
    return gate_up[:, :F].transpose(1, 2), gate_up[:, F:].transpose(1, 2), down_XDF.transpose(1, 2)


def ours_to_fused(
    w1_XDF: torch.Tensor, w3_XDF: torch.Tensor, w2_XFD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w1, w3, w2)`` -> transformers 5's ``(gate_up [X, 2F, D], down [X, D, F])`` (contiguous copies)."""
    return torch.cat([w1_XDF.transpose(1, 2), w3_XDF.transpose(1, 2)], dim=1), w2_XFD.transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------
# the tables


def same(cfg, *ts):
    return ts


def always(cfg, i) -> bool:
    return True


@dataclass(frozen=True)
class Row:
    """Our tensors ``ours`` are the family's ``module`` tensors (the transformers 5 module layout) by
    ``to_module(cfg, *ours)``/``to_ours(cfg, *theirs)``. ``file`` names the same tensors in a
    checkpoint file: the module names, except for the experts (``experts=True``: dimension 0 runs
    over experts), which a file stores one tensor per expert: ``file[j]`` of expert e is
    ``ours[j][e]`` transposed. ``{i}`` in a name is the block, ``{e}`` the expert; ``when(cfg, i)``:
    whether block i of a model of ``cfg`` has the row (a dense block's FFN, a qkv bias...)."""

    ours: tuple[str, ...]
    module: tuple[str, ...]
    file: tuple[str, ...]
    to_module: Callable = same
    to_ours: Callable = same
    experts: bool = False
    when: Callable[[TransformerConfig, int], bool] = always


def row(ours, module, file=None, **kw) -> Row:
    """A ``Row``; ``file`` defaults to the module names."""
    return Row(tuple(ours), tuple(module), tuple(file if file is not None else module), **kw)


OMIT = object()  # a Field's to_theirs result: the field is not written


def _keep(value, other):
    return value


@dataclass(frozen=True)
class Field:
    """Our config field ``ours`` (``"d_model"``, ``"moe.top_k"``) is their field ``theirs``
    (``"hidden_size"``; dotted into a dict: ``"rope_parameters.rope_theta"``).
    ``to_theirs(value, our_cfg)`` and ``to_ours(value, their_cfg)`` convert (an absent field of
    theirs reads as None; ``to_ours`` returning None leaves our default; ``to_theirs`` returning
    ``OMIT`` writes nothing)."""

    ours: str
    theirs: str
    to_theirs: Callable = _keep
    to_ours: Callable = _keep


@dataclass(frozen=True)
class Fixed:
    """A field of their config with one valid value for our model. ``export(cfg)``: the value export
    writes (None: the field is not written, the config class's default stands). ``accepts(value,
    hf_cfg)``: whether import takes the config's value (None: any; an absent field reads as None).
    ``why`` (or ``why(hf_cfg)``) says why nothing else is valid; ``shown(value)`` names a refused
    value."""

    field: str
    export: Callable[[TransformerConfig], object] | None
    accepts: Callable[[object, object], bool] | None
    why: str | Callable[[object], str] = ""
    shown: Callable[[object], object] = lambda value: value


def names(templates: tuple[str, ...], i: int, e: int | None = None) -> list[str]:
    return [t.format(i=i, e=e) for t in templates]


def get_field(obj, dotted: str):
    """``obj.a.b`` or ``obj["a"]["b"]``; None where a part is absent."""
    for part in dotted.split("."):
        if obj is None:
            return None
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
    return obj


def put_field(out: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        out = out.setdefault(p, {})
    out[last] = value
