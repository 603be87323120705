"""The model families by ``model_type`` (``FAMILIES``), and the family-generic entry points:
``import_model`` (a transformers checkpoint directory -> our ``Transformer``), ``export_model``
(ours -> a checkpoint directory of its family), ``read_config`` (a directory's adapter and config,
refusals first, before any tensor is read).

The families: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 (``moe.hf.<model_type>``, one
mapping table each). Any other ``model_type`` is refused by name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..model import Transformer, TransformerConfig
from .adapter import Adapter
from .deepseek_v3 import DEEPSEEK_V3
from .dense import LLAMA, QWEN3
from .mixtral import MIXTRAL
from .olmoe import OLMOE
from .qwen2_moe import QWEN2_MOE
from .qwen3_moe import QWEN3_MOE
from .safetensors_io import DEFAULT_SHARD_BYTES, SafetensorsFiles, TensorSource

FAMILIES: dict[str, Adapter] = {a.model_type: a for a in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, DEEPSEEK_V3)}
# dense families, read to start an MoE run from (sparse upcycling) and written back
DENSE_FAMILIES: dict[str, Adapter] = {a.model_type: a for a in (LLAMA, QWEN3)}

# model types people try, and why they are not ours
_WHY_NOT = {
    "gpt_oss": "GPT-OSS's attention sinks and alternating sliding-window layers are not part of our attention",
    "deepseek_v2": "DeepSeek-V2's router (greedy/group_limited_greedy top-k, softmax scores) is not mapped; V3 is",
    "qwen3_next": "Qwen3-Next's linear-attention (gated DeltaNet) layers are not part of our model",
}


def family(model_type: str | None) -> Adapter:
    """The adapter of ``model_type``; a ValueError naming it and the supported ones otherwise."""
    known = {**FAMILIES, **DENSE_FAMILIES}
    if model_type not in known:
        why = _WHY_NOT.get(model_type, "no adapter maps it onto moe.model.Transformer")
        raise ValueError(f"config.model_type={model_type!r} is not supported: {why}; supported are {sorted(known)}")
    return known[model_type]


def read_config(path: str | os.PathLike):
    """``(adapter, transformers config)`` of a checkpoint directory; only ``config.json`` is read,
    and everything the family's adapter refuses is refused here, by field."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a transformers checkpoint directory)")
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    adapter = family(model_type)
    return adapter, adapter.read_hf_config(path)


def config_of(path: str | os.PathLike, **kw) -> TransformerConfig:
    """Our ``TransformerConfig`` of a checkpoint directory (``kw``: ``max_seq_len`` and the
    training-time MoEConfig fields)."""
    adapter, hf_cfg = read_config(path)
    return adapter.transformer_config(hf_cfg, **kw)


def import_model(
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    *,
    model: Transformer | None = None,
    max_seq_len: int | None = None,
    layout=None,
    ep_group=None,
    dp_group=None,
    layers: set[int] | None = None,
    **moe_kw,
) -> Transformer:
    """A transformers checkpoint directory (``config.json`` + ``model.safetensors``, or shards and
    ``model.safetensors.index.json``) of any supported family as our ``Transformer``; the family
    comes from ``model_type``. The config is checked before any tensor is read.

    ``dtype``: the model's (None: the checkpoint's). ``model``: load into this model (in place)
    instead, whose config must match the checkpoint's on every architecture field. ``max_seq_len``:
    default the checkpoint's ``max_position_embeddings``. ``layout``/``ep_group``/``dp_group``: as
    ``Transformer`` takes them; under expert parallelism each process reads only its experts.
    ``layers``: read only those pipeline layers (0 the embedding, i + 1 block i, n_layers + 1 the
    head; the others keep their initial weights). ``moe_kw``: training-time MoEConfig fields
    (``aux_loss_coef``, ``capacity_factor``...). The model remembers its family (``hf_family``)."""
    path = Path(path)
    adapter, hf_cfg = read_config(path)
    model = adapter.load(
        lambda: SafetensorsFiles(path),
        hf_cfg,
        model,
        str(path),
        max_seq_len=max_seq_len,
        layout=layout,
        ep_group=ep_group,
        dp_group=dp_group,
        layers=layers,
        **moe_kw,
    )
    if dtype is None:
        dtype = SafetensorsFiles(path).meta("model.embed_tokens.weight").dtype
    # the rotary tables stay fp32 (transformers computes cos/sin in fp32): rounded to bf16 they cost a
    # Qwen3-MoE test model 6x the stock bf16 model's distance from fp32 (tests/hf/test_families.py)
    cos, sin = model.rope_cos, model.rope_sin
    model.to(dtype)
    model.rope_cos, model.rope_sin = cos, sin
    return model


def exporter(cfg: TransformerConfig, family_name: str | None = None) -> Adapter:
    """The adapter that writes a model of ``cfg``: ``family_name``'s (a model_type), or else the one
    family that can carry ``cfg`` (ValueError naming each family's first refusal when none can)."""
    if family_name is not None:
        adapter = family(family_name)
        adapter.check_exportable(cfg)
        return adapter
    refusals = []
    for adapter in (*FAMILIES.values(), *DENSE_FAMILIES.values()):
        try:
            adapter.check_exportable(cfg)
            return adapter
        except ValueError as e:
            refusals.append(str(e))
    raise ValueError("no supported family can carry this model: " + "; ".join(refusals))


def export_model(
    src,
    out_dir: str | os.PathLike,
    cfg: TransformerConfig | None = None,
    *,
    family: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``src`` as a transformers checkpoint directory: ``config.json`` and
    ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most
    ``max_shard_bytes`` each and ``model.safetensors.index.json`` (written last), which
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads with no missing or unexpected key.

    ``src``: a ``Transformer`` holding every expert (one process), or its ``state_dict()``, or the path
    of a safetensors file of our parameter names (a consolidated checkpoint), or a ``TensorSource``
    (e.g. ``experiments.checkpoint``'s reader of a sharded training checkpoint); ``cfg`` is required
    for all but the first. ``family``: the ``model_type`` to write (default: the family the model
    was imported from, ``src.hf_family``, else the one family that can carry ``cfg``). ``dtype``: the
    file's dtype (default: the embedding's). Returns ``out_dir``.

    The files are written tensor by tensor: from a file or a ``TensorSource`` one of our tensors is
    read at a time (the largest: one layer's expert weight over all experts, or the embedding)."""
    if isinstance(src, Transformer):
        family = family or getattr(src, "hf_family", None)
        cfg = src.cfg if cfg is None else cfg
    if cfg is None:
        raise ValueError("export_model needs cfg (the model's TransformerConfig) unless src is a Transformer")
    return exporter(cfg, family).export(src, out_dir, cfg, dtype=dtype, max_shard_bytes=max_shard_bytes)


def import_state_dict(state: dict[str, torch.Tensor], hf_cfg, model: Transformer | None = None, **kw) -> Transformer:
    """``import_model`` from a transformers model's ``state_dict()`` and its config (a live model:
    ``import_state_dict(m.state_dict(), m.config)``); the tensors are copied, ``m`` is unchanged."""
    adapter = family(getattr(hf_cfg, "model_type", None))
    adapter.check_hf_config(hf_cfg)
    return adapter.load(lambda: TensorSource(state), hf_cfg, model, "the state dict", **kw)
