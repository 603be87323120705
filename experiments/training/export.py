"""A training checkpoint (any layout) out of the trainer's format: one ``model.safetensors`` with
the full weights (``consolidate``), or a transformers checkpoint directory of the model's family
(``export_hf``). The
command line is ``python -m experiments.checkpoint``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf

from experiments.training.schema import model_config
from moe.hf.families import exporter
from moe.hf.safetensors_io import DEFAULT_SHARD_BYTES, TensorSource, write_safetensors
from zero import checkpoint as zc


class CheckpointTensors(TensorSource):
    """The model of a checkpoint (any layout) as named full tensors, read one at a time: every
    parameter in its global shape (``get`` assembles it from the chunks every rank wrote) and every
    saved ``state_dict`` buffer, under the model's names. Shapes and dtypes come from the metadata
    (and the tiny ``shape/`` tensors), so listing them reads no weight. The checkpoint is verified
    against its manifest first (ValueError naming the problem)."""

    def __init__(self, checkpoint: str | Path):
        self.path = Path(checkpoint)
        problem = zc.verify(self.path)
        if problem is not None:
            raise ValueError(f"checkpoint {self.path} is incomplete or corrupt: {problem}")
        saved = zc.SafeReader(self.path).read_metadata().state_dict_metadata
        names = sorted(k[len(zc.PARAM) :] for k in saved if k.startswith(zc.PARAM))
        shapes = {zc.SHAPE + n: torch.empty(saved[zc.SHAPE + n].size, dtype=torch.int64) for n in names}
        zc.read_tensors(self.path, shapes)
        entries = {n: (zc.PARAM + n, torch.Size(shapes[zc.SHAPE + n].tolist())) for n in names}
        entries.update((k[len(zc.BUFFER) :], (k, saved[k].size)) for k in sorted(saved) if k.startswith(zc.BUFFER))
        self._saved = saved
        super().__init__(entries)

    def meta(self, name: str) -> torch.Tensor:
        key, shape = self._state[name]
        return torch.empty(shape, dtype=self._saved[key].properties.dtype, device="meta")

    def _tensor(self, name: str, lo: int | None, hi: int | None) -> torch.Tensor:
        key, shape = self._state[name]
        md = self._saved[key]
        t = torch.empty(md.size, dtype=md.properties.dtype)
        zc.read_tensors(self.path, {key: t})  # a parameter's chunks, from every rank that wrote one
        t = t.view(shape)
        return t if lo is None else t[lo:hi]


def consolidate(checkpoint: str | Path, out: str | Path) -> Path:
    """Write ``<out>/model.safetensors``: every parameter (full, unsharded, in its global shape) and
    every ``state_dict`` buffer of the checkpoint, whatever layout saved it, plus its
    ``config.yaml`` and ``meta.json``. One process, no GPU; one full tensor in memory at a time
    (each is read from its chunks straight into place and written out before the next)."""
    src, out = CheckpointTensors(checkpoint), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = write_safetensors(
        out / "model.safetensors",
        [(n, src.meta(n)) for n in src.keys()],
        ((n, src.get(n)) for n in src.keys()),
        metadata={"format": "pt", "source": str(src.path)},
    )
    for extra in ("config.yaml", zc.META):
        if (src.path / extra).is_file():
            shutil.copyfile(src.path / extra, out / extra)
    return target


def _saved_config(checkpoint: str | Path):
    path = Path(checkpoint) / "config.yaml"
    if not path.is_file():
        raise ValueError(
            f"checkpoint {checkpoint} has no config.yaml (the trainer saves the resolved config beside "
            "the shards); without it the model's architecture is unknown"
        )
    return OmegaConf.load(path)


def saved_model_config(checkpoint: str | Path):
    """The ``TransformerConfig`` the run that saved ``checkpoint`` trained (its ``config.yaml``)."""
    return model_config(_saved_config(checkpoint))


def saved_family(checkpoint: str | Path) -> str | None:
    """The transformers ``model_type`` the run started from (``model.hf_family``; None: a run not
    started from a transformers checkpoint)."""
    return OmegaConf.select(_saved_config(checkpoint), "model.hf_family", default=None)


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> tuple[Path, str]:
    """Write the model of a training checkpoint (any layout) as a transformers checkpoint directory
    (``moe.hf.export_model``) of the family the run started from (``model.hf_family``; a run of its
    own config: the one family that can carry it), with the architecture from the checkpoint's
    ``config.yaml``. Reads one parameter at a time (the largest: one layer's ``w1``, ``w3`` or ``w2``
    over all experts, or the embedding). A config the family cannot carry is a ValueError naming
    the field, before any tensor is read. Returns ``(out, the family's name)``."""
    cfg = saved_model_config(checkpoint)
    adapter = exporter(cfg, saved_family(checkpoint))  # refuses before reading any tensor
    target = adapter.export(CheckpointTensors(checkpoint), out, cfg, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return target, adapter.name
