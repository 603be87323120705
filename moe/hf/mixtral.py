"""A Switchyard ``Transformer`` as a transformers Mixtral checkpoint, and back: the Mixtral adapter
(``MIXTRAL``, read by ``moe.hf.adapter``), its tables, and ``export_mixtral``/``import_mixtral``.

Needs the optional extra (``pip install -e .[hf]``: transformers for the config class, safetensors
for the files); ``import moe`` never imports this module, and this module imports neither package
until a function needs it.

Shapes follow the project's legend (docs/design.md): V vocabulary, D model dim, H heads, J head dim,
F expert hidden dim, E experts of the model, X experts held by this process.

What maps to what (``TABLE``; ``{i}`` is the block, ``{e}`` the expert): ours; the Mixtral module's
(transformers 5, ``state_dict()``); the Mixtral checkpoint file's (what ``save_pretrained``
writes), where it differs from the module's:

- ``embed.weight [V, D]``: ``model.embed_tokens.weight``
- ``blocks.{i}.attn_norm.weight [D]``: ``model.layers.{i}.input_layernorm.weight``
- ``blocks.{i}.attn.qkv.weight [(H + 2Z) J, D]``: ``...self_attn.{q,k,v}_proj.weight`` (rows
  ``[q (H J) | k (Z J) | v (Z J)]``, Z the key/value heads)
- ``blocks.{i}.attn.proj.weight [D, H J]``: ``...self_attn.o_proj.weight``
- ``blocks.{i}.ffn_norm.weight [D]``: ``...post_attention_layernorm.weight``
- ``blocks.{i}.ffn.router.weight [E, D]``: ``...mlp.gate.weight``; file
  ``...block_sparse_moe.gate.weight``
- ``blocks.{i}.ffn.experts.w1, w3 [E, D, F]``: ``...mlp.experts.gate_up_proj [E, 2F, D]`` =
  ``cat(w1ᵀ, w3ᵀ)``; file ``...block_sparse_moe.experts.{e}.w1.weight, w3.weight [F, D]`` =
  ``w1[e]ᵀ, w3[e]ᵀ``
- ``blocks.{i}.ffn.experts.w2 [E, F, D]``: ``...mlp.experts.down_proj [E, D, F]`` = ``w2ᵀ``; file
  ``...block_sparse_moe.experts.{e}.w2.weight [D, F]`` = ``w2[e]ᵀ``
- ``norm.weight [D]``: ``model.norm.weight``
- ``lm_head.weight [V, D]``: ``lm_head.weight`` (absent from the file when tied)

Nothing else needs converting: both models are pre-norm with RMSNorm (normalised in fp32, then
times the gain), rotary positions rotate the same half-split pairs (``x[j]`` with ``x[j + J/2]``,
transformers' ``rotate_half``) with the same frequencies ``theta^(-2j/J)``, so q and k rows need no
permutation; attention is causal at scale ``J^-1/2`` with no biases (grouped-query: query head h reads
key/value head h // (H / Z), as transformers' ``repeat_kv``); the router is softmax over all
E, top-k, renormalised; each expert is ``w2(silu(w1 x) * w3 x)``. ``router.expert_bias`` (our
selection bias, zero unless ``expert_bias``) has no Mixtral counterpart: exported only when zero,
imported as zeros (``ZERO_IN_MIXTRAL``).

The checkpoint file format is the Hub's (one tensor per expert under ``block_sparse_moe``): what
transformers 5 writes and converts to its fused module layout on load, and what every other
Mixtral reader expects. Import also reads a file in the fused module layout (a raw ``state_dict()``
of a transformers 5 model).

Configs: ``FIELDS``, our ``TransformerConfig``/``MoEConfig`` fields that are Mixtral's (sizes,
key/value heads, head dim, rotary positions and their scaling); ``OURS_FIXED``, our fields with one
value in a Mixtral model (every block MoE, multi-head attention without q/k norms or biases,
Mixtral's router); ``FIXED_FIELDS``, Mixtral's fields with one valid value for our model (a SwiGLU
with silu, no sliding window, no router jitter, no attention dropout, no biases, no quantization),
each with what export writes and what import accepts. Anything else is refused with a ValueError
naming the field, its value and what is valid (``moe.hf.adapter``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..model import Transformer, TransformerConfig
from .adapter import Adapter
from .common import (
    ALL_MOE,
    ATTN_NORM,
    COMMON_FIXED,
    EMBED,
    FFN_NORM,
    HEAD,
    HEAD_DIM,
    KV_HEADS,
    MHA,
    MHA_ROUTED,
    NO_BIAS,
    NO_JITTER,
    NO_MLP_BIAS,
    NO_SHARED,
    ROPE,
    SIZES,
    SOFTMAX_ROUTING,
    moe_rows,
)
from .safetensors_io import DEFAULT_SHARD_BYTES, SafetensorsFiles, TensorSource
from .tables import Field, Fixed

# ---------------------------------------------------------------------------------------------
# the tables

TABLE = (
    *EMBED,
    *ATTN_NORM,
    *MHA,
    *FFN_NORM,
    *moe_rows("model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")),
    *HEAD,
)
# ours only: the aux-loss-free selection bias, zero unless MoEConfig.expert_bias (which Mixtral lacks)
ZERO_IN_MIXTRAL = ("blocks.{i}.ffn.router.expert_bias",)

FIELDS = (
    *SIZES,
    KV_HEADS,
    HEAD_DIM,
    Field("moe.d_ff", "intermediate_size"),
    Field("moe.num_experts", "num_local_experts"),
    *ROPE,
)
OURS_FIXED = {
    **MHA_ROUTED,
    **ALL_MOE,
    "qk_norm": "none",
    "qkv_bias": False,
    **SOFTMAX_ROUTING,
    "moe.normalize_topk": True,
    **NO_SHARED,
}
FIXED_FIELDS = (
    *COMMON_FIXED,
    Fixed(
        "sliding_window",
        lambda cfg: None,
        lambda value, _: value is None,
        "our attention is full causal attention; null is valid",
    ),
    NO_JITTER,
    # not MixtralConfig fields: a config that sets them came from elsewhere
    Fixed("attention_bias", None, NO_BIAS.accepts, NO_BIAS.why),
    NO_MLP_BIAS,
)

MIXTRAL = Adapter(
    name="Mixtral",
    model_type="mixtral",
    table=TABLE,
    fields=FIELDS,
    ours_fixed=OURS_FIXED,
    fixed=FIXED_FIELDS,
    config_class="MixtralConfig",
    architectures=("MixtralForCausalLM",),
    zero_in_theirs=ZERO_IN_MIXTRAL,
)

# ---------------------------------------------------------------------------------------------
# configs


def check_exportable(cfg: TransformerConfig, *, dropless: bool = True) -> None:
    """Raise ValueError naming the first field of ``cfg`` that a Mixtral model cannot compute.

    ``dropless=False`` accepts a ``capacity_factor`` (a training-time rule: a run may start from a
    dropless checkpoint and train with a capacity); export keeps it refused, since the exported
    model would route dropless and so compute something else."""
    MIXTRAL.check_exportable(cfg, dropless=dropless)


def mixtral_config(cfg: TransformerConfig, dtype: torch.dtype = torch.float32):
    """The ``transformers.MixtralConfig`` of a Switchyard model (refusing what Mixtral cannot be)."""
    return MIXTRAL.hf_config(cfg, dtype)


def transformer_config(hf_cfg, *, max_seq_len: int | None = None, **moe_kw) -> TransformerConfig:
    """Our ``TransformerConfig`` for a ``transformers.MixtralConfig`` (refusing what our model cannot
    compute). ``max_seq_len``: default ``max_position_embeddings`` (rotary tables are that long).
    ``moe_kw``: training-time MoEConfig fields (aux_loss_coef, z_loss_coef, capacity_factor, ...)."""
    return MIXTRAL.transformer_config(hf_cfg, max_seq_len=max_seq_len, **moe_kw)


def config_mismatches(cfg: TransformerConfig, hf_cfg) -> list[str]:
    """``model.x=ours (checkpoint: mixtral_field=theirs)`` for each architecture field of ``cfg`` that
    differs from the Mixtral config's (empty when the checkpoint's weights fit ``cfg``); also the
    fields of ``cfg`` no Mixtral model has. Training-time fields (aux losses, capacity, init, sequence
    length) are free."""
    return MIXTRAL.config_mismatches(cfg, hf_cfg)


def read_mixtral_config(path: str | os.PathLike):
    """The ``transformers.MixtralConfig`` of a checkpoint directory (only ``config.json`` is read)."""
    return MIXTRAL.read_hf_config(path)


# ---------------------------------------------------------------------------------------------
# state dicts, export and import


def to_mixtral_state_dict(state: dict[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> ``MixtralForCausalLM.state_dict()`` names and layouts (transformers 5, fused
    experts), e.g. for ``hf_model.load_state_dict``."""
    return MIXTRAL.to_module_state_dict(state, cfg)


def _read(files: TensorSource, cfg: TransformerConfig, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Our state dict (experts ``[lo, hi)``) from a Mixtral checkpoint of ``cfg``, in either file
    layout; refuses a checkpoint that holds tensors the table does not know, naming them."""
    return MIXTRAL.read(files, cfg, lo, hi)


def export_mixtral(
    src,
    out_dir: str | os.PathLike,
    cfg: TransformerConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``src`` as a transformers Mixtral checkpoint directory: ``config.json`` and
    ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most
    ``max_shard_bytes`` each and ``model.safetensors.index.json`` (written last), which
    ``MixtralForCausalLM.from_pretrained(out_dir)`` loads.

    ``src``: a ``Transformer`` holding every expert (one process), or its ``state_dict()``, or the path
    of a safetensors file of our parameter names (a consolidated checkpoint), or a ``TensorSource``
    (e.g. ``experiments.checkpoint``'s reader of a sharded training checkpoint); ``cfg`` is required
    for all but the first. ``dtype``: the file's dtype (default: the embedding's). Returns ``out_dir``.

    The files are written tensor by tensor: from a file or a ``TensorSource`` one of our tensors is
    read at a time (the largest: one layer's expert weight over all experts, or the embedding)."""
    return MIXTRAL.export(src, out_dir, cfg, dtype=dtype, max_shard_bytes=max_shard_bytes)


def import_mixtral(
    path: str | os.PathLike,
    model: Transformer | None = None,
    *,
    max_seq_len: int | None = None,
    layout=None,
    ep_group=None,
    dp_group=None,
    **moe_kw,
) -> Transformer:
    """Load a transformers Mixtral checkpoint directory into ``model`` (in place; returned), or into a
    new ``Transformer`` of the checkpoint's config (``max_seq_len``, ``moe_kw``: see
    ``transformer_config``; ``layout``/``ep_group``/``dp_group``: as ``Transformer`` takes them).

    ``model``'s config must match the checkpoint's on every architecture field (ValueError naming
    each mismatch); under expert parallelism each process reads only the experts it holds."""
    path = Path(path)
    hf_cfg = read_mixtral_config(path)
    return MIXTRAL.load(
        lambda: SafetensorsFiles(path),
        hf_cfg,
        model,
        str(path),
        max_seq_len=max_seq_len,
        layout=layout,
        ep_group=ep_group,
        dp_group=dp_group,
        **moe_kw,
    )


def import_mixtral_state_dict(
    state: dict[str, torch.Tensor],
    hf_cfg,
    model: Transformer | None = None,
    *,
    max_seq_len: int | None = None,
    layout=None,
    ep_group=None,
    dp_group=None,
    **moe_kw,
) -> Transformer:
    """``import_mixtral`` from a transformers model's ``state_dict()`` and its config (e.g. a live
    ``MixtralForCausalLM``: ``import_mixtral_state_dict(m.state_dict(), m.config)``); the tensors are
    copied, the model is not changed."""
    MIXTRAL.check_hf_config(hf_cfg)
    return MIXTRAL.load(
        lambda: TensorSource(state),
        hf_cfg,
        model,
        "the state dict",
        max_seq_len=max_seq_len,
        layout=layout,
        ep_group=ep_group,
        dp_group=dp_group,
        **moe_kw,
    )
