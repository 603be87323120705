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
- ``blocks.{i}.attn.qkv.weight [3D, D]``: ``...self_attn.{q,k,v}_proj.weight [D, D]`` (rows 0:D,
  D:2D, 2D:3D)
- ``blocks.{i}.attn.proj.weight [D, D]``: ``...self_attn.o_proj.weight``
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
permutation; attention is causal at scale ``J^-1/2`` with no biases; the router is softmax over all
E, top-k, renormalised; each expert is ``w2(silu(w1 x) * w3 x)``. ``router.expert_bias`` (our
selection bias, zero unless ``expert_bias``) has no Mixtral counterpart: exported only when zero,
imported as zeros (``ZERO_IN_MIXTRAL``).

The checkpoint file format is the Hub's (one tensor per expert under ``block_sparse_moe``): what
transformers 5 writes and converts to its fused module layout on load, and what every other
Mixtral reader expects. Import also reads a file in the fused module layout (a raw ``state_dict()``
of a transformers 5 model).

Configs: ``CONFIG_FIELDS``, our ``TransformerConfig``/``MoEConfig`` fields that are Mixtral's;
``FIXED_FIELDS``, Mixtral's fields with one valid value for our model (as many key/value heads as
heads, a SwiGLU with silu, no sliding window, default rotary positions, no router jitter, no
attention dropout, no biases, no quantization), each with what export writes and what import
accepts; ``MIXTRAL_ROUTING``, the router Mixtral's block computes, exactly. A Mixtral config always
has one MoE block per layer (``moe_every=1``). Anything else is refused with a ValueError naming
the field, its value and what is valid.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..model import Transformer, TransformerConfig
from .adapter import Adapter, Fixed, Row, fused_to_ours, ours_to_fused, row
from .safetensors_io import DEFAULT_SHARD_BYTES, SafetensorsFiles, TensorSource

# ---------------------------------------------------------------------------------------------
# the tables


def _split_qkv(qkv):
    return tuple(qkv.chunk(3, dim=0))  # our rows are q, k, v (each h-major, "(three h j)")


def _cat_qkv(q, k, v):
    return (torch.cat([q, k, v], dim=0),)


_L, _M = "model.layers.{i}.", "model.layers.{i}.block_sparse_moe."

TABLE: tuple[Row, ...] = (
    row(["embed.weight"], ["model.embed_tokens.weight"]),
    row(["blocks.{i}.attn_norm.weight"], [_L + "input_layernorm.weight"]),
    row(
        ["blocks.{i}.attn.qkv.weight"],
        [_L + f"self_attn.{p}_proj.weight" for p in "qkv"],
        to_module=_split_qkv,
        to_ours=_cat_qkv,
    ),
    row(["blocks.{i}.attn.proj.weight"], [_L + "self_attn.o_proj.weight"]),
    row(["blocks.{i}.ffn_norm.weight"], [_L + "post_attention_layernorm.weight"]),
    row(["blocks.{i}.ffn.router.weight"], [_L + "mlp.gate.weight"], [_M + "gate.weight"]),
    row(
        [f"blocks.{{i}}.ffn.experts.{w}" for w in ("w1", "w3", "w2")],
        [_L + "mlp.experts.gate_up_proj", _L + "mlp.experts.down_proj"],
        [_M + f"experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2")],
        to_module=ours_to_fused,
        to_ours=fused_to_ours,
        experts=True,
    ),
    row(["norm.weight"], ["model.norm.weight"]),
    row(["lm_head.weight"], ["lm_head.weight"]),
)
# ours only: the aux-loss-free selection bias, zero unless MoEConfig.expert_bias (which Mixtral lacks)
ZERO_IN_MIXTRAL = ("blocks.{i}.ffn.router.expert_bias",)

# (our field, Mixtral field): the same value on both sides. "moe." fields are MoEConfig's.
CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("d_model", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("moe.d_ff", "intermediate_size"),
    ("moe.num_experts", "num_local_experts"),
    ("moe.top_k", "num_experts_per_tok"),
    ("tie_embeddings", "tie_word_embeddings"),
    ("rope_theta", "rope_parameters.rope_theta"),
    ("norm_eps", "rms_norm_eps"),
    ("max_seq_len", "max_position_embeddings"),
    ("init_std", "initializer_range"),
)


def _no_noise(value, _) -> bool:
    return (value or 0.0) == 0


def _head_dim_fits(value, c) -> bool:
    D, H = c.hidden_size, c.num_attention_heads
    return value in (None, D // H) and D % H == 0


# Mixtral's fields with one valid value for our model: what export writes, what import accepts (in
# the order import checks them)
FIXED_FIELDS: tuple[Fixed, ...] = (
    Fixed(
        "num_key_value_heads",
        lambda cfg: cfg.n_heads,
        lambda value, c: value in (None, c.num_attention_heads),
        lambda c: f"our attention has one key/value head per head (num_attention_heads={c.num_attention_heads})",
    ),
    Fixed(
        "head_dim",
        lambda cfg: cfg.d_model // cfg.n_heads,
        _head_dim_fits,
        lambda c: f"our head dim is hidden_size / num_attention_heads = {c.hidden_size}/{c.num_attention_heads}",
    ),
    Fixed(
        "hidden_act",
        lambda cfg: "silu",
        lambda value, _: value in ("silu", "swish"),
        "our experts are SwiGLU (silu gate)",
    ),
    Fixed(
        "sliding_window",
        lambda cfg: None,
        lambda value, _: value is None,
        "our attention is full causal attention; null is valid",
    ),
    Fixed(
        "rope_parameters",
        lambda cfg: {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        lambda value, _: (value or {}).get("rope_type", "default") == "default",
        "only rope_type 'default' (no scaling) is implemented",
    ),
    Fixed("router_jitter_noise", lambda cfg: 0.0, _no_noise, "our model has no such noise; 0 is valid"),
    Fixed("attention_dropout", lambda cfg: 0.0, _no_noise, "our model has no such noise; 0 is valid"),
    # not MixtralConfig fields: a config that sets them came from elsewhere
    Fixed("attention_bias", None, lambda value, _: not value, "our model has no biases"),
    Fixed("mlp_bias", None, lambda value, _: not value, "our model has no biases"),
    Fixed(
        "quantization_config",
        None,
        lambda value, _: value is None,
        "only unquantized checkpoints are read",
        shown=lambda q: q.get("quant_method", q) if isinstance(q, dict) else q,
    ),
    # a byte-level (or any Switchyard) vocabulary has no special tokens; Mixtral's defaults (bos 1,
    # eos 2) would make generate() stop at an ordinary token. Any value is read: we have no use for them
    *(Fixed(f"{t}_token_id", lambda cfg: None, None) for t in ("bos", "eos", "pad")),
)

# the MoEConfig routing that Mixtral's sparse block computes; every other value is refused
MIXTRAL_ROUTING: dict[str, object] = dict(
    activation="swiglu",
    router="token_choice",
    score_func="softmax",
    softmax_before_topk=True,
    normalize_topk=True,
    route_scale=1.0,
    num_groups=None,
    topk_groups=None,
    expert_bias=False,
    num_shared_experts=0,
    shared_expert_gate=False,
)

MIXTRAL = Adapter(
    name="Mixtral",
    model_type="mixtral",
    table=TABLE,
    config_fields=CONFIG_FIELDS,
    fixed=FIXED_FIELDS,
    routing=MIXTRAL_ROUTING,
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
