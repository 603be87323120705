"""How ``zero.nvme`` lays a rank's optimizer range into its files and cuts it into the optimizer's
tensors: segments, pieces and sub-groups (the package docstring explains the layout), and the
engine's ``offload`` arguments."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

MODES = ("none", "cpu", "nvme")
_ALIGN_ELEMS = 4096  # every segment starts at a multiple of this many elements (>= ALIGN bytes)
DEFAULT_SUB_GROUP = 1 << 22  # elements: 16 MiB of fp32 per slot and buffer set
_POISON = torch.full((1,), float("nan"))  # what shard tensors read between steps


def offload_mode(offload) -> str:
    """``"none"``, ``"cpu"`` or ``"nvme"`` from the engine's ``offload`` argument (False/True mean
    none/cpu), or a ValueError naming the bad value."""
    if offload is False or offload is None:
        return "none"
    if offload is True:
        return "cpu"
    if isinstance(offload, str) and offload in MODES:
        return offload
    raise ValueError(f"offload={offload!r} must be one of {MODES} (or False/True for 'none'/'cpu')")


def check_arguments(mode: str, offload_dir, sub_group_elems) -> tuple[Path | None, int]:
    """``(offload_dir, sub_group_elems)`` checked against ``mode`` (before any collective)."""
    if mode != "nvme":
        if offload_dir is not None:
            raise ValueError(f"offload_dir={offload_dir!r} only applies to offload='nvme', got offload={mode!r}")
        if sub_group_elems is not None:
            raise ValueError(
                f"offload_sub_group_elems={sub_group_elems!r} only applies to offload='nvme', got offload={mode!r}"
            )
        return None, 0
    if offload_dir is None or not isinstance(offload_dir, (str, os.PathLike)) or not str(offload_dir):
        raise ValueError(
            f"offload='nvme' needs offload_dir=<a directory on a local fast disk>, got offload_dir={offload_dir!r}"
        )
    s = DEFAULT_SUB_GROUP if sub_group_elems is None else sub_group_elems
    if isinstance(s, bool) or not isinstance(s, int) or s <= 0 or s % _ALIGN_ELEMS:
        raise ValueError(
            f"offload_sub_group_elems={sub_group_elems!r} must be a positive multiple of {_ALIGN_ELEMS} "
            f"(elements per sub-group; default {DEFAULT_SUB_GROUP})"
        )
    return Path(offload_dir), s


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _poison(n: int) -> torch.Tensor:
    """``n`` elements that read as NaN and, for n > 1, refuse in-place writes, in 4 bytes (one
    element has nothing to overlap: it gets a NaN of its own, so a write cannot reach the others)."""
    return _POISON.expand(n) if n > 1 else torch.full((n,), float("nan"))


def _placeholder(n: int) -> torch.Tensor:
    """A leaf tensor of ``n`` elements whose data is ``_poison(n)``: a shard tensor between steps."""
    t = torch.empty(0)
    t.data = _poison(n)
    return t


@dataclass
class Segment:
    """One (flat, param group) range ``[a, b)`` of flat coordinates at ``off`` elements in the files."""

    flat: object
    group: int
    a: int
    b: int
    off: int


@dataclass
class Piece:
    """One optimizer tensor: flat coordinates ``[a, b)`` of ``flat`` at ``off`` in the files."""

    flat: object
    group: int
    a: int
    b: int
    off: int
    tensor: torch.Tensor

    @property
    def n(self) -> int:
        return self.b - self.a


@dataclass
class SubGroup:
    lo: int  # file elements [lo, hi), aligned
    hi: int
    pieces: list = field(default_factory=list)


@dataclass
class Plan:
    segments: list
    subgroups: list
    total: int  # elements per slot file
    sub_group_elems: int


def cut_pieces(flats, sub_group_elems: int) -> Plan:
    """Lay every flat's optimizer range into the files and cut it into the optimizer's tensors:
    ``f.shards`` becomes ``(param group, a, b, tensor)`` of each piece (placeholders between steps)."""
    segments, off = [], 0
    for f in flats:
        for g, a, b in f.shard_ranges(f.group_bounds):
            segments.append(Segment(f, g, a, b, off))
            off += _round_up(b - a, _ALIGN_ELEMS)
    total, S = off, sub_group_elems
    subgroups: dict[int, SubGroup] = {}
    shards: dict[int, list] = {id(f): [] for f in flats}
    for seg in segments:
        x = seg.off
        end = seg.off + (seg.b - seg.a)
        while x < end:
            y = min(end, (x // S + 1) * S)  # a piece never crosses a sub-group's window
            a = seg.a + (x - seg.off)
            piece = Piece(seg.flat, seg.group, a, a + (y - x), x, _placeholder(y - x))
            k = x // S
            subgroups.setdefault(k, SubGroup(k * S, min((k + 1) * S, total))).pieces.append(piece)
            shards[id(seg.flat)].append((seg.group, piece.a, piece.b, piece.tensor))
            x = y
    for f in flats:
        f.shards = shards[id(f)]
    return Plan(segments, [subgroups[k] for k in sorted(subgroups)], total, S)
