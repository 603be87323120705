"""The cost model's records: a model's costs per pipeline layer (``MatMul``, ``BlockCost``,
``ModelCosts``, which ``moe.costs`` builds from a ``TransformerConfig``) and a layout's predicted
memory and time (``Prediction``, whose ``memory_parts`` are the ``PARTS``); ``zero.plan.cost``
says what each holds and how ``predict`` combines them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MatMul:
    """One matrix product of a block's forward, per token: ``[rows, k] @ [k, n]``."""

    k: int
    n: int
    rows_per_token: float = 1.0  # rows per token (top_k for the routed experts)
    expert: bool = False  # the routed experts' product: rows spread over the experts
    weight: bool = True  # False: attention's scores and weighted values (no weight gradient)
    fixed_rows: int | None = None  # the rows of one product when they are not tokens (attention: L)
    work: float = 1.0  # share of the product computed (causal attention skips the upper half)
    count: int = 1  # products of this shape per token (attention: the heads)

    def flops_per_token(self) -> float:
        return 2.0 * self.k * self.n * self.rows_per_token * self.count * self.work


@dataclass(frozen=True)
class BlockCost:
    """One pipeline layer's costs. Counts are of the whole model (``params_expert``: every
    expert of the layer); bytes are per token and in the dtypes the model runs in."""

    name: str
    params_dense: int = 0
    params_expert: int = 0
    matmuls: tuple[MatMul, ...] = ()
    elementwise_bytes: float = 0.0  # forward: bytes the non-matmul operators read and write
    # of those, the FFN activation's (silu or gelu and the gate's product: the profile's
    # activation_bandwidth, a CPU's transcendental rate)
    activation_bytes: float = 0.0
    # backward: the same of its operators, recomputation included; None: the average, 2.3x the
    # forward's plus recompute_bytes
    backward_bytes: float | None = None
    backward_activation_bytes: float = 0.0  # of backward_bytes, the activation's backward (and recompute)
    recompute_bytes: float = 0.0  # of the backward's, what a kernel runs again of its forward (input pass)
    ops: int = 0  # forward operators launched (the backward launches about twice as many)
    act_bytes: float = 0.0  # saved for backward
    act_bytes_checkpointed: float = 0.0  # saved under activation checkpointing (the block's input)
    # under activation checkpointing, run again in its backward (the model checkpoints its blocks;
    # the embedding and the head run once, and save what they always save)
    checkpointed: bool = True
    wgrad_bytes: float = 0.0  # of act_bytes: what the weight pass still needs after the input pass
    # what a split backward's input pass captures for the weight pass beyond the saved tensors: the
    # gradients of the weight operators' outputs (torch's stage_backward_input keeps them)
    wgrad_captured_bytes: float = 0.0
    transient_bytes: float = 0.0  # the backward's working memory beyond what is saved
    boundary_bytes: float = 0.0  # handed to the next layer (a pipeline's point-to-point)
    output_bytes: float = 0.0  # the output of a layer that hands nothing on (the head's logits)
    # MoE layers
    num_experts: int = 0
    top_k: int = 0
    capacity_factor: float | None = None
    expert_row_bytes: float = 0.0  # saved per routed row (part of act_bytes at top_k rows per token)
    # saved per routed row beyond expert_row_bytes where the experts run between All-to-All
    # exchanges (ep > 1: rows in expert order, not tokens); not part of act_bytes
    rows_mode_row_bytes: float = 0.0
    row_bytes: float = 0.0  # one routed row as the All-to-All moves it
    # group-limited routing (moe.MoEConfig): each token's slots among topk_groups of num_groups
    # groups of consecutive experts; None: plain top_k (ep_dispatch=node's nodes per token)
    num_groups: int | None = None
    topk_groups: int | None = None
    stats_bytes: float = 0.0  # the routing statistics all-reduced over dp each forward
    routing_bytes: float = 0.0  # per token, what a capacity's decision gathers over dp (ids and weights)
    shares_params_with: int | None = None  # tied: the layer whose weight this one uses (held once)
    # what the layer's kernel keeps allocated from step to step beyond what it saves (the CPU expert
    # kernel's buffer pool): buffers of rows x width elements, (kind, width, mode, passes); rows by
    # kind: "block" pool_block_rows (a block buffer is whole however few rows use it), "rows" the
    # routed rows ("rows+1" and a zero row), "tokens" the layer's tokens, "bound" the kernel's static
    # bound on the rows (the worst case; ep > 1: the rows received), "experts" this rank's experts
    # (a weight gradient, in the compute weights' dtype; the rest in the activations'); mode
    # "tokens" (ep = 1), "rows" (ep > 1, rows in expert order), "both", or "ckpt" (what the layer
    # saves, idle in the pool between passes under activation checkpointing); passes "F", "B" or
    # "FB": which pass takes it. A buffer is kept only at pool_min_bytes or more; a smaller one
    # comes from the heap for its pass (the backward's: workspace). pool_combine_tokens: tokens per
    # chunk of the backward's combine into token order (top_k rows each, from the heap)
    pool_buffers: tuple[tuple[str, int, str, str], ...] = ()
    pool_block_rows: int = 0
    pool_min_bytes: int = 0
    pool_combine_tokens: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True)
class ModelCosts:
    blocks: tuple[BlockCost, ...]
    seq_len: int
    act_dtype: str = "fp32"  # what the matrix products run in: fp32 or bf16
    name: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def num_experts(self) -> int | None:
        es = {b.num_experts for b in self.blocks if b.is_moe}
        if len(es) > 1:
            raise ValueError(f"MoE layers with different expert counts {sorted(es)}: one ep cannot divide all")
        return es.pop() if es else None

    @property
    def tied(self) -> tuple[int, int] | None:
        for i, b in enumerate(self.blocks):
            if b.shares_params_with is not None:
                return (b.shares_params_with, i)
        return None

    def param_counts(self) -> dict[str, int]:
        return {
            "dense": sum(b.params_dense for b in self.blocks),
            "expert": sum(b.params_expert for b in self.blocks),
        }

    def model_flops_per_token(self) -> float:
        """Training FLOPs per token, forward and backward (3x the forward's matrix products), the
        MFU convention: causal attention not discounted, no recomputation."""
        total = 0.0
        for b in self.blocks:
            for mm in b.matmuls:
                total += 3 * mm.flops_per_token() / mm.work
        return total


@dataclass(frozen=True)
class Prediction:
    memory_bytes: float  # the busiest rank's device peak
    memory_parts: dict[str, float]  # adds up to memory_bytes
    step_s: float
    time_parts: dict[str, float] = field(default_factory=dict)  # seconds, a breakdown (not a sum)
    host_bytes: float = 0.0  # per rank: ZeRO-Offload's optimizer state in host memory
    fits: bool = True
    tokens_per_s: float = 0.0  # global
    bubble: float = 0.0  # the pipeline's idle fraction (0 without a pipeline)
    live_microbatches: int = 1  # the most micro-batches' activations alive at once on a rank
    # bytes one rank sends per step by link tier, as the engine counts them (zero.plan.wire)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    # each pipeline rank's device peak by part (one entry without a pipeline); memory_parts is the
    # busiest's
    memory_parts_by_pp_rank: tuple[dict[str, float], ...] = ()

    def to_dict(self) -> dict:
        return {
            "memory_bytes": self.memory_bytes,
            "memory_parts": dict(self.memory_parts),
            "step_s": self.step_s,
            "time_parts": dict(self.time_parts),
            "host_bytes": self.host_bytes,
            "fits": self.fits,
            "tokens_per_s": self.tokens_per_s,
            "bubble": self.bubble,
            "live_microbatches": self.live_microbatches,
            "comm_bytes": dict(self.comm_bytes),
            "memory_parts_by_pp_rank": [dict(d) for d in self.memory_parts_by_pp_rank],
        }


PARTS = (
    "model_states",
    "gathered_params",
    "grad_buffers",
    "activations",
    "expert_rows",
    "a2a_buffers",
    "workspace",
    "kernel_buffers",
)
