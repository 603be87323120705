"""Each pipeline layer's costs for the planner (``zero.plan``): parameters, the forward's matrix
products, and bytes per token saved for backward, handed on, and moved by All-to-All, for the
embedding, every block (MHA/GQA or MLA attention; a dense SwiGLU/GELU FFN or an MoE layer with its
router, routed and shared experts) and the head, from a ``TransformerConfig``.

    costs = model_costs(cfg, seq_len=4096, act_dtype="bf16")    # a zero.plan.ModelCosts
    zero.plan.predict(layout, costs, profile)

Parameter counts are exact (the tests hold them to ``Transformer.param_counts``); FLOPs count the
matrix products (2 per multiply-add; attention's scores and weighted values at half, causal);
activation bytes follow what autograd saves in ``moe.attention``, ``moe.layer`` and
``moe.experts`` as written (SDPA's memory-efficient kernels: q, k, v, the output and a logsumexp
per head, no L x L matrix), an estimate that a test measures against saved-tensor hooks on a
small model. Shapes follow the legend (docs/design.md): D model dim, H heads, Z key/value heads, J
query/key head dim, O value head dim, F FFN hidden dim, E experts, K top-k, V vocabulary, L
sequence length.
"""

from __future__ import annotations

from zero.plan import BlockCost, MatMul, ModelCosts

from .model import TransformerConfig

_BYTES = {"fp32": 4, "bf16": 2}
# operators one forward dispatches per part (views included), as moe.attention, moe.layer and
# moe.experts are written, counted with a TorchDispatchMode (tests/moe/test_costs.py holds them to
# it): an RMSNorm, attention (its projections, rotary halves, SDPA), MLA (q by rank or not), a q/k
# norm, a SwiGLU or GELU FFN, the MoE layer's router, statistics and aux losses and routed experts,
# the shared experts' gate, the head with its loss, the block's two residual additions
_OPS = dict(norm=5, attn=43, mla=83, mla_q_lora=10, qk_norm=6, swiglu=11, gelu=7, moe=253, gate=5, head=15, residual=2)


# bytes the forward's non-matmul operators read and write per token, counted operator by operator
# from the code as written (a TorchDispatchMode over these blocks holds them to it:
# tests/moe/test_costs.py); each term below names the operators it counts. The router and the
# routing metadata (moe.router, routing_kernels' reference metadata: fp32 scores, top-k, the
# statistics and losses, sorts and offsets of the slots), per routed slot and per expert, by score
# function; a capacity adds the drop ranking per slot
_ROUTING_BYTES = dict(softmax=(442, 65), sigmoid=(490, 109))
_CAPACITY_SLOT_BYTES = 316

# the backward's non-matmul bytes over the forward's, by what the forward ran (counted with a
# TorchDispatchMode over each block's backward, SDPA's own backward left out as attention's
# product: tests/moe/test_costs.py holds every test config within 8%): the routed experts'
# activation (the CPU kernel's backward recomputes silu(h1) * h3, then the product's two gradients
# and silu's in scratch blocks: 4.4x its forward's 5 c F a row), an autograd SwiGLU/GELU (a dense
# FFN or the shared experts: silu's output and the product kept, 3.5x), and everything else (the
# norms with their recompute, the rotary, the router, the routed rows' moves, the residuals: 2.1x).
# The GPU's grouped path runs the same activation backward (it recomputes too)
_BACKWARD_PER_FORWARD = dict(routed=4.4, ffn=3.5, rest=2.1)


def _backward_traffic(forward: float, routed: float, ffn: float) -> float:
    """The backward's non-matmul bytes of a layer whose forward moves ``forward`` bytes, of which
    ``routed`` are the routed experts' activation and ``ffn`` an autograd FFN's."""
    k = _BACKWARD_PER_FORWARD
    return k["routed"] * routed + k["ffn"] * ffn + k["rest"] * (forward - routed - ffn)


def _cast(width: float, c: int) -> float:
    """An upcast to fp32 and back (read c, write 4; read 4, write c per element); none in fp32."""
    return 0.0 if c == 4 else 2 * (c + 4) * width


def _norm_traffic(width: float, c: int) -> float:
    # moe.attention.RMSNorm: the casts, the square (8), the mean (4 + 4), eps and rsqrt (16), the
    # normalising product (8 + 4), the gain (2c)
    return _cast(width, c) + 20 * width + 24 + 2 * c * width


def _rotary_copy(width: float, c: int) -> float:
    # of _rotary_traffic, the fp32 copy of the head-split view, which has no backward (in bf16 the
    # upcast is that copy, and its backward casts the gradient)
    return 8 * width if c == 4 else 0.0


def _rotary_traffic(width: float, c: int) -> float:
    # moe.rope.apply_rotary on ``width`` rotated values, in fp32: the contiguous fp32 copy of the
    # head-split view (read c, write 4), two products (16), the halves' difference and sum (6 + 6),
    # their concatenation (8), the cast back (read 4, write c; none in fp32)
    return 36 * width + _cast(width, c) + _rotary_copy(width, c)


def _act_traffic(f: float, activation: str, c: int) -> float:
    # silu (read, write) and the product with the up projection (two reads, a write); gelu (read,
    # write). The activation's bytes are a class of their own (BlockCost.activation_bytes): a CPU
    # computes silu's exp (gelu's erf) at a rate well under its other operators'
    return (5 if activation == "swiglu" else 2) * c * f


def _norm_saved(width: int, c: int, input_saved: bool = False) -> float:
    # moe.attention.RMSNorm: its input as it came (nothing more when a view of a tensor saved
    # already: the q/k norms' of the qkv projection's output) and the fp32 reciprocal root
    return 4 + (0 if input_saved else c * width)


def _norm_recompute(width: float, c: int) -> float:
    # what RMSNorm's backward recomputes of its forward: the upcast, the normalising product (8),
    # the cast back (the gain's gradient takes the normalised value)
    return _cast(width, c) + 8 * width


def _ffn(d: int, f: int, activation: str, c: int, rows: float = 1.0, expert: bool = False):
    """(matmuls, params, saved bytes, weight-pass bytes, transient bytes) of one SwiGLU/GELU FFN
    per token; ``rows`` rows per token (top_k for routed experts); the input is not counted (the
    caller owns it)."""
    gated = activation == "swiglu"
    ins = 2 if gated else 1
    mms = tuple(MatMul(k=d, n=f, rows_per_token=rows, expert=expert) for _ in range(ins)) + (
        MatMul(k=f, n=d, rows_per_token=rows, expert=expert),
    )
    params = (ins + 1) * d * f
    # swiglu: silu's input, its output and the up projection (the product's inputs), the product (w2's input)
    saved = rows * c * f * (4 if gated else 2)
    wgrad = rows * c * (f + (ins + 1) * f + d)  # w2's input; the outputs' gradients
    transient = rows * c * (ins + 1) * f
    return mms, params, saved, wgrad, transient


def _attention_output_grads(cfg: TransformerConfig, c: int) -> float:
    """Per token, the gradients of the attention's weight operators' outputs: what a split
    backward's input pass keeps for the weight pass (MHA/GQA: the fused qkv projection and the
    output projection; MLA: its down and up projections, the latents' norms and the output
    projection)."""
    D, H, J, O = cfg.d_model, cfg.n_heads, cfg.attn_head_dim, cfg.value_head_dim  # noqa: E741
    if cfg.attention == "mla":
        qr, kvr, rope, nope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
        q = H * J if qr is None else 2 * qr + H * J  # with q_lora: its down projection and norm
        return c * (q + 2 * kvr + rope + H * (nope + O) + D)  # kv's down projection and norm
    return c * ((H + 2 * cfg.kv_heads) * J + D)


def _attention(cfg: TransformerConfig, c: int, L: int):
    D, H = cfg.d_model, cfg.n_heads
    J, O = cfg.attn_head_dim, cfg.value_head_dim  # noqa: E741 (O: the legend's value head dim)
    half = 0.5  # causal: the kernels skip the masked half of the scores
    scores = (
        MatMul(k=J, n=L, weight=False, fixed_rows=L, work=half, count=H),
        MatMul(k=L, n=O, weight=False, fixed_rows=L, work=half, count=H),
    )
    if cfg.attention == "mla":
        qr, kvr, rope, nope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
        mms, params, saved, wgrad, recompute = [], 0, 0.0, 0.0, 0.0
        if qr is None:
            mms.append(MatMul(k=D, n=H * J))
            params += D * H * J
        else:
            mms += [MatMul(k=D, n=qr), MatMul(k=qr, n=H * J)]
            params += D * qr + qr + qr * H * J
            saved += _norm_saved(qr, c) + c * qr
            recompute += _norm_recompute(qr, c)
            wgrad += c * (qr + qr + H * J)
        mms += [MatMul(k=D, n=kvr + rope), MatMul(k=kvr, n=H * (nope + O)), MatMul(k=H * O, n=D)]
        params += D * (kvr + rope) + kvr + kvr * H * (nope + O) + H * O * D
        # the latent's norm (its input a view of kv_a's whole output) and kv_b's input; q and k
        # concatenated per head; v, a view of kv_b's output, keeps all of it alive; SDPA's output
        # and logsumexp; the output projection's input
        recompute += _norm_recompute(kvr, c)
        saved += _norm_saved(kvr + rope, c) + c * kvr
        saved += c * 2 * H * J + c * H * (nope + O) + c * H * O + 4 * H + c * H * O
        wgrad += c * (D + kvr + H * O) + c * (kvr + rope + H * (nope + O) + D)
        transient = c * (2 * H * J + 2 * H * O)
        ops = _OPS["mla"] + (_OPS["mla_q_lora"] if qr is not None else 0)
        # the latents' norms, the rotary query parts and the shared rotary key, the two [nope | rope]
        # concatenations, the heads merged (a copy)
        traffic = (_norm_traffic(qr, c) if qr is not None else 0.0) + _norm_traffic(kvr, c)
        traffic += _rotary_traffic(H * rope, c) + _rotary_traffic(rope, c) + 2 * 2 * c * H * J + 2 * c * H * O
        copies = _rotary_copy(H * rope, c) + _rotary_copy(rope, c)
        return tuple(mms) + scores, params, saved, wgrad, transient, ops, traffic, recompute, copies
    Z = cfg.kv_heads
    params = D * (H + 2 * Z) * J + H * J * D
    if cfg.qkv_bias:
        params += (H + 2 * Z) * J
    # the rotated q and k; v, a view of the fused projection's output, keeps all of it alive; SDPA's
    # output and logsumexp; the output projection's input (a contiguous copy of that output)
    saved = c * (H * J + Z * J) + c * (H + 2 * Z) * J + c * H * O + 4 * H + c * H * O
    recompute = 0.0
    if cfg.qk_norm == "head":  # the norms' inputs are views of the qkv projection's output
        params += 2 * J
        saved += (H + Z) * _norm_saved(J, c, input_saved=True)
        recompute += (H + Z) * _norm_recompute(J, c)
    elif cfg.qk_norm == "proj":
        params += H * J + Z * J
        saved += 2 * _norm_saved(0, c, input_saved=True)
        recompute += _norm_recompute((H + Z) * J, c)
    mms = (MatMul(k=D, n=(H + 2 * Z) * J), MatMul(k=H * J, n=D)) + scores
    wgrad = c * (D + H * O) + c * ((H + 2 * Z) * J + D)
    transient = c * (H + 2 * Z) * J
    ops = _OPS["attn"] + (2 * _OPS["qk_norm"] if cfg.qk_norm != "none" else 0)
    # the rotary queries and keys, the heads merged (a copy), the q/k norms
    traffic = _rotary_traffic((H + Z) * J, c) + 2 * c * H * O
    if cfg.qk_norm == "head":
        traffic += (H + Z) * _norm_traffic(J, c)
    elif cfg.qk_norm == "proj":
        traffic += _norm_traffic(H * J, c) + _norm_traffic(Z * J, c)
    return mms, params, saved, wgrad, transient, ops, traffic, recompute, _rotary_copy((H + Z) * J, c)


EXPERT_KERNELS = ("grouped", "fused")


def _fused_pool(D: int, F: int, swiglu: bool) -> dict:
    """The buffers the CPU expert kernel (``routing_kernels.cpu.blocks``) takes from its pool per
    layer beyond what autograd saves (h1, h3), one lane, each with the passes that use it: the
    forward's activation block and the backward's four scratch blocks ([block, F]); in tokens mode
    the gathered-input block (both passes) and the gradient block ([block, D]), the rows buffer
    ([rows + 1, D]: the forward's outputs, then the backward's input gradients), the layer's output
    (forward) and input gradient (backward) in token order ([T, D]); in rows mode the output and
    input-gradient rows ([rows, D]); the weight gradients ([experts, D x F] each, in the compute
    weights' dtype: lent as p.grad, which the engine adds into its flat buffer and drops, so the
    pool keeps them); h1 (and h3), saved (mode "ckpt": under activation checkpointing idle in the
    pool between passes). A buffer under ``BufferPool.min_bytes`` comes from the heap instead,
    for the pass that uses it only. Also the combine's chunk of rows back into token order
    (``pool_combine_tokens`` tokens of top_k rows, from the heap) and the weight gradients'
    count (all of them returned at once)."""
    from routing_kernels.cpu.lanes import COMBINE_BLOCK_T, ROW_BLOCK
    from routing_kernels.cpu.pool import BufferPool

    bufs = [("block", F, "both", "F")] + [("block", F, "both", "B")] * 4
    bufs += [("block", D, "tokens", "FB"), ("block", D, "tokens", "B"), ("rows+1", D, "tokens", "FB")]
    bufs += [("tokens", D, "tokens", "F"), ("tokens", D, "tokens", "B")]
    bufs += [("rows", D, "rows", "F"), ("rows", D, "rows", "B")]
    bufs += [("experts", D * F, "both", "B")] * (3 if swiglu else 2)  # dw1 (dw3) dw2
    bufs += [("bound", F, "ckpt", "FB")] * (2 if swiglu else 1)  # h1 (and h3)
    return dict(
        pool_buffers=tuple(bufs),
        pool_block_rows=ROW_BLOCK,
        pool_min_bytes=BufferPool.min_bytes,
        pool_combine_tokens=COMBINE_BLOCK_T,
    )


def model_costs(
    cfg: TransformerConfig, seq_len: int, act_dtype: str = "fp32", name: str = "", experts: str = "grouped"
) -> ModelCosts:
    """The ``ModelCosts`` of ``cfg`` trained on sequences of ``seq_len`` tokens with activations in
    ``act_dtype`` (``fp32``, or ``bf16`` under autocast or ZeRO's bf16 compute weights).
    ``experts``: what the routed experts save per row, by the kernel that runs them: ``grouped``
    (GPU: rows permuted into expert order, grouped GEMMs, the rows combined back: the rows in and
    out and the hidden projections, from which its backward recomputes the activation), or
    ``fused`` (the CPU kernel, ``routing_kernels.cpu_experts``: the hidden projections and each
    row's source and weight)."""
    if act_dtype not in _BYTES:
        raise ValueError(f"act_dtype={act_dtype!r} is invalid: expected one of {tuple(_BYTES)}")
    if experts not in EXPERT_KERNELS:
        raise ValueError(f"experts={experts!r} is invalid: expected one of {EXPERT_KERNELS}")
    if not isinstance(seq_len, int) or seq_len < 1 or seq_len > cfg.max_seq_len:
        raise ValueError(f"seq_len={seq_len!r} is invalid: expected an integer in [1, max_seq_len={cfg.max_seq_len}]")
    c = _BYTES[act_dtype]
    D, V, L = cfg.d_model, cfg.vocab_size, seq_len
    blocks = [
        BlockCost(
            name="embed",
            params_dense=V * D,
            elementwise_bytes=2 * c * D,
            ops=1,
            act_bytes=8,  # the token ids
            act_bytes_checkpointed=8,
            checkpointed=False,
            transient_bytes=c * D,
            boundary_bytes=c * D,
        )
    ]
    (
        attn_mms,
        attn_params,
        attn_saved,
        attn_wgrad,
        attn_transient,
        attn_ops,
        attn_traffic,
        attn_recompute,
        attn_copies,
    ) = _attention(cfg, c, L)
    for i in range(cfg.n_layers):
        # two RMSNorms, each followed by a projection that saves its output
        norms = 2 * _norm_saved(D, c) + 2 * c * D
        params_dense = 2 * D + attn_params
        params_expert = 0
        mms = list(attn_mms)
        saved = norms + attn_saved
        wgrad = attn_wgrad
        # the output gradients a split backward's input pass captures: the attention's projections'
        # and the two norms' (for their weights)
        captured = _attention_output_grads(cfg, c) + 2 * c * D
        transient = 2 * c * D + attn_transient
        ops = 2 * _OPS["norm"] + attn_ops + _OPS["residual"]
        traffic = 2 * _norm_traffic(D, c) + attn_traffic + 2 * 3 * c * D  # and the two residual additions
        moe_fields = {}
        recompute = 2 * _norm_recompute(D, c) + attn_recompute
        routed_act = ffn_act = 0.0  # of traffic: the routed experts' activation, an autograd FFN's
        if cfg.is_moe_block(i):
            m = cfg.moe
            E, K = m.num_experts, m.top_k
            mms.append(MatMul(k=D, n=E))  # the router, fp32
            params_dense += E * D
            # router: fp32 input (when the model is not), probabilities, logits for the z-loss,
            # the kept weights; per routed row its indices
            saved += (4 * D if c != 4 else 0) + 3 * 4 * E + 16 * K
            e_mms, e_params, _, e_wgrad, e_transient = _ffn(D, m.d_ff, m.activation, c, rows=K, expert=True)
            mms += e_mms
            params_expert += E * e_params
            # both kernels keep the hidden projections only (h1 and h3; the backward recomputes the
            # activation and the product from them)
            hidden = c * m.d_ff * (2 if m.activation == "swiglu" else 1)
            if experts == "grouped":  # per row: its input and output rows, the hidden projections, its slot
                row_saved = c * 2 * D + hidden + 8
            else:  # the fused kernel: the hidden projections, each row's source (long) and weight
                row_saved = hidden + 12
            saved += K * row_saved
            wgrad += e_wgrad
            # the router's (fp32 logits); the experts': the fused kernel's weight pass takes its
            # output's gradient, the grouped experts' their projections' outputs' per row
            ins = 2 if m.activation == "swiglu" else 1
            captured += 4 * E + (c * D if experts == "fused" else K * c * (ins * m.d_ff + D))
            # the router's fp32 input, its passes per expert, the routing metadata; per routed row
            # its activation and the rows' moves: the reference and CPU kernels gather the rows in,
            # assemble the experts' outputs and gather them back (a read and a write each; the
            # weighted sum is a product), the GPU's grouped path permutes, masks the segments'
            # tail and combines (Triton: rows read, the sum written)
            per_slot, per_expert = _ROUTING_BYTES[m.score_func]
            per_slot += _CAPACITY_SLOT_BYTES if m.capacity_factor is not None else 0
            traffic += (0.0 if c == 4 else (c + 4) * D) + per_slot * K + per_expert * E
            moves = 5 * K * c * D + c * D if experts == "grouped" else 6 * K * c * D
            routed_act = K * _act_traffic(m.d_ff, m.activation, c)
            traffic += routed_act + moves
            # both kernels' backward recomputes the activation and the product from the hidden projections
            recompute += routed_act
            # the fused kernel's backward works in its pool's buffers, or heap ones of the same
            # shapes (``_fused_pool``; zero.plan's kernel_buffers and workspace), not in [rows, F] temporaries
            if experts == "grouped":
                transient = max(transient, e_transient + 2 * c * D * K)
            if m.num_shared_experts:
                s_mms, s_params, s_saved, s_wgrad, s_transient = _ffn(
                    D, m.shared_d_ff or m.d_ff * m.num_shared_experts, m.activation, c
                )
                mms += s_mms
                params_dense += s_params
                saved += s_saved + c * D
                wgrad += s_wgrad
                s_ins = 2 if m.activation == "swiglu" else 1
                captured += c * (s_ins * (m.shared_d_ff or m.d_ff * m.num_shared_experts) + D)
                transient = max(transient, s_transient)
                ops += _OPS[m.activation]
                ffn_act = _act_traffic(m.shared_d_ff or m.d_ff * m.num_shared_experts, m.activation, c)
                traffic += ffn_act + 3 * c * D
            if m.shared_expert_gate:
                mms.append(MatMul(k=D, n=1))
                params_dense += D
                saved += 2 * c
                ops += _OPS["gate"]
                traffic += 2 * c * D + 3 * c  # its sigmoid and the product
            ops += _OPS["moe"]
            moe_fields = dict(
                num_experts=E,
                top_k=K,
                capacity_factor=m.capacity_factor,
                expert_row_bytes=row_saved,
                row_bytes=c * D,
                # between the exchanges (ep > 1) the dispatcher's two row gathers save their int64
                # indices; the fused kernel in rows mode also saves its input rows, and the combine
                # the outputs it weights, which in tokens mode the kernel folds in (the grouped
                # kernel's row_saved has both already)
                rows_mode_row_bytes=16 + (2 * c * D if experts == "fused" else 0),
                num_groups=m.num_groups,
                topk_groups=m.topk_groups,
                # counts, token count, dropped, probability sums, z-loss and entropy sums (moe.layer)
                stats_bytes=8 * (2 * E + 4),
                routing_bytes=K * (8 + 4),  # ids (long) and weights (fp32) of each token's slots
            )
            if experts == "fused":
                moe_fields.update(_fused_pool(D, m.d_ff, m.activation == "swiglu"))
        else:
            f_mms, f_params, f_saved, f_wgrad, f_transient = _ffn(D, cfg.d_ff, "swiglu", c)
            captured += c * (2 * cfg.d_ff + D)
            mms += f_mms
            params_dense += f_params
            saved += f_saved
            wgrad += f_wgrad
            transient = max(transient, f_transient)
            ops += _OPS["swiglu"]
            ffn_act = _act_traffic(cfg.d_ff, "swiglu", c)
            traffic += ffn_act
        blocks.append(
            BlockCost(
                name=f"block{i}" + (" (moe)" if moe_fields else ""),
                params_dense=params_dense,
                params_expert=params_expert,
                matmuls=tuple(mms),
                elementwise_bytes=traffic,
                activation_bytes=routed_act + ffn_act,
                backward_bytes=_backward_traffic(traffic - attn_copies, routed_act, ffn_act),
                backward_activation_bytes=_backward_traffic(routed_act + ffn_act, routed_act, ffn_act),
                recompute_bytes=recompute,
                ops=ops,
                act_bytes=saved,
                act_bytes_checkpointed=c * D,  # the block's input only
                wgrad_bytes=wgrad,
                wgrad_captured_bytes=captured,
                transient_bytes=transient,
                boundary_bytes=c * D,
                **moe_fields,
            )
        )
    tied = cfg.tie_embeddings
    blocks.append(
        BlockCost(
            name="head",
            params_dense=D + (0 if tied else V * D),
            matmuls=(MatMul(k=D, n=V),),
            elementwise_bytes=2 * c * D + 3 * 4 * V,
            recompute_bytes=_norm_recompute(D, c),
            ops=_OPS["head"],
            # the norm, lm_head's input, the loss's fp32 log-probabilities
            act_bytes=_norm_saved(D, c) + c * D + 4 * V,
            act_bytes_checkpointed=_norm_saved(D, c) + c * D + 4 * V,  # blocks only are checkpointed
            checkpointed=False,
            wgrad_bytes=c * D + 4 * V,
            transient_bytes=4 * V + c * V,  # the logits' gradient, fp32 and in the compute dtype
            boundary_bytes=0.0,
            output_bytes=c * V,  # the logits (a pipeline's last stage keeps them until the backward)
            shares_params_with=0 if tied else None,
        )
    )
    return ModelCosts(blocks=tuple(blocks), seq_len=seq_len, act_dtype=act_dtype, name=name)
