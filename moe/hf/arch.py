"""What a ``TransformerConfig``'s weights compute: ``architecture(cfg)``, the fields that decide it,
normalised so that two configs of one model compare equal (``n_kv_heads=None`` is ``n_heads``, a
placement is its list of MoE blocks, a shared-expert block is its width, ...). The adapters compare
these to refuse a field a family cannot carry and to name a checkpoint's mismatches.

Not architecture (free when a run starts from a checkpoint): ``max_seq_len`` (rotary tables are
computed for any length), ``init_std``, ``checkpoint_activations``, and the MoEConfig training
fields ``TRAINING_MOE_FIELDS``.
"""

from __future__ import annotations

from ..model_config import _ROPE_PARAMS, TransformerConfig

TRAINING_MOE_FIELDS = (
    "capacity_factor",
    "drop_policy",
    "aux_loss_coef",
    "seq_aux_loss_coef",
    "z_loss_coef",
    "bias_update_rate",
)
NOT_ARCHITECTURE = ("max_seq_len", "init_std", "checkpoint_activations")


def moe_blocks(cfg: TransformerConfig) -> tuple[int, ...]:
    return tuple(i for i in range(cfg.n_layers) if cfg.is_moe_block(i))


def architecture(cfg: TransformerConfig) -> dict[str, object]:
    """``{key: value}``: ``model.*`` keys without the prefix, ``moe.*`` with it; ``placement`` is the
    tuple of MoE blocks. Ordered as a refusal should name them (routing before sizes)."""
    a: dict[str, object] = {"placement": moe_blocks(cfg)}
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "tie_embeddings", "norm_eps", "attention"):
        a[name] = getattr(cfg, name)
    if cfg.attention == "mla":
        for name in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            a[name] = getattr(cfg, name)
    else:
        a.update(n_kv_heads=cfg.kv_heads, head_dim=cfg.attn_head_dim, qk_norm=cfg.qk_norm, qkv_bias=cfg.qkv_bias)
    a.update(rope_interleave=cfg.rope_interleave, rope_theta=float(cfg.rope_theta), rope_scaling=cfg.rope_scaling)
    for name, kinds in _ROPE_PARAMS.items():
        if cfg.rope_scaling in kinds:
            a[name] = getattr(cfg, name)
    if len(a["placement"]) < cfg.n_layers:
        a["d_ff"] = cfg.d_ff  # the dense blocks' width
    m = cfg.moe
    if m is None or not a["placement"]:
        return a
    a["moe.activation"], a["moe.router"], a["moe.score_func"] = m.activation, m.router, m.score_func
    if m.score_func == "softmax":
        a["moe.softmax_before_topk"] = m.softmax_before_topk
    a["moe.normalize_topk"], a["moe.route_scale"] = m.normalize_topk, float(m.route_scale)
    grouped = m.num_groups not in (None, 1) and m.topk_groups != m.num_groups
    a["moe.num_groups"] = m.num_groups if grouped else None
    a["moe.topk_groups"] = m.topk_groups if grouped else None
    a["moe.expert_bias"] = m.expert_bias
    a["moe.num_shared_experts"] = m.num_shared_experts > 0
    if m.num_shared_experts:
        a["moe.shared_d_ff"] = m.shared_d_ff or m.d_ff * m.num_shared_experts
        a["moe.shared_expert_gate"] = m.shared_expert_gate
    a["moe.d_ff"], a["moe.num_experts"], a["moe.top_k"] = m.d_ff, m.num_experts, m.top_k
    return a


def describe(cfg: TransformerConfig, key: str) -> tuple[str, object]:
    """``(field, value)`` of an ``architecture`` key as the config names it (``model.moe_every``,
    ``moe.num_shared_experts``)."""
    if key == "placement":
        return "model.moe_every", cfg.moe_every
    if key == "moe.num_shared_experts":
        return key, cfg.moe.num_shared_experts if cfg.moe is not None else 0
    value = architecture(cfg).get(key)
    return (key if key.startswith("moe.") else f"model.{key}"), value


def placement_why(cfg: TransformerConfig, back: TransformerConfig, family: str) -> str:
    return (
        f"its MoE blocks are {list(moe_blocks(cfg))} (model.moe_every={cfg.moe_every}, first_k_dense="
        f"{cfg.first_k_dense}, dense_layers={cfg.dense_layers}); a {family} model of this config has MoE "
        f"blocks {list(moe_blocks(back))}"
    )


def block_of(name: str) -> int:
    """The block of our state-dict entry ``name`` as ``layer_blocks`` numbers them: i for
    ``blocks.i.*``, -1 for the embedding, -2 for the final norm and the head."""
    if name.startswith("blocks."):
        return int(name.split(".")[1])
    return -1 if name.startswith("embed.") else -2


def layer_blocks(cfg: TransformerConfig, layers: set[int] | None) -> set[int]:
    """The blocks (and -1: the embedding, -2: the final norm and head) of pipeline ``layers`` (0 the
    embedding, i + 1 block i, n_layers + 1 the head); None: all."""
    n = cfg.n_layers
    if layers is None:
        return set(range(n)) | {-1, -2}
    out = {k - 1 for k in layers if 1 <= k <= n}
    if 0 in layers:
        out.add(-1)
    if n + 1 in layers:
        out.add(-2)
    if cfg.tie_embeddings and (-1 in out or -2 in out):
        out |= {-1, -2}  # one tensor
    return out
