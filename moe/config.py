"""MoE layer configuration; it validates itself so a bad value fails before any compute or collective."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

ROUTERS = ("token_choice", "expert_choice")
SCORE_FUNCS = ("softmax", "sigmoid")
ACTIVATIONS = ("swiglu", "gelu")
DROP_POLICIES = ("probs", "position")


@dataclass
class MoEConfig:
    d_model: int
    d_ff: int  # hidden size F of each routed expert
    num_experts: int = 8
    top_k: int = 2
    activation: str = "swiglu"  # swiglu (w1, w3, w2) or gelu (w1, w2)

    router: str = "token_choice"  # or expert_choice (non-causal: an expert picks among all tokens)
    score_func: str = "softmax"  # or sigmoid (DeepSeek-V3)
    # softmax over all E then top-k (Mixtral, GShard); False: top-k logits then softmax over the
    # k (Megatron-Core's default). Only meaningful with score_func=softmax.
    softmax_before_topk: bool = True
    normalize_topk: bool = True  # renormalise the k kept weights to sum to 1
    route_scale: float = 1.0  # multiplies the combine weights (DeepSeek-V3 uses 2.5)
    num_groups: int | None = None  # group-limited routing: pick topk_groups groups, then experts
    topk_groups: int | None = None

    capacity_factor: float | None = None  # None: dropless
    drop_policy: str = "probs"  # drop the lowest-weight assignments, or the latest by position

    aux_loss_coef: float = 1e-2  # Switch/GShard E * sum_e f_e P_e over the (global) batch
    seq_aux_loss_coef: float = 0.0  # the same per sequence, averaged over sequences
    z_loss_coef: float = 1e-3  # mean(logsumexp(logits)^2)

    expert_bias: bool = False  # aux-loss-free balancing: per-expert bias used for selection only
    bias_update_rate: float = 1e-3

    num_shared_experts: int = 0  # experts every token passes through (DeepSeekMoE / Qwen-MoE)
    shared_d_ff: int | None = None  # hidden size of the shared expert block (default d_ff * n)
    # scale the shared experts' output per token by sigmoid(x @ w_gate), w_gate [1, D] (Qwen2-MoE)
    shared_expert_gate: bool = False

    def __post_init__(self):
        def bad(name, value, valid):
            raise ValueError(f"MoEConfig.{name}={value!r} is invalid: {valid}")

        for name in ("d_model", "d_ff"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                bad(name, v, "expected a positive integer")
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            bad("num_experts", self.num_experts, "expected an integer >= 1")
        E = self.num_experts
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= E:
            bad("top_k", self.top_k, f"expected an integer in [1, num_experts={E}]")
        if self.activation not in ACTIVATIONS:
            bad("activation", self.activation, f"expected one of {ACTIVATIONS}")
        if self.router not in ROUTERS:
            bad("router", self.router, f"expected one of {ROUTERS}")
        if self.score_func not in SCORE_FUNCS:
            bad("score_func", self.score_func, f"expected one of {SCORE_FUNCS}")
        if self.score_func == "sigmoid" and not self.softmax_before_topk:
            bad("softmax_before_topk", False, "top-k-then-softmax needs score_func=softmax")
        if self.drop_policy not in DROP_POLICIES:
            bad("drop_policy", self.drop_policy, f"expected one of {DROP_POLICIES}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            bad("capacity_factor", self.capacity_factor, "expected a number > 0, or None for dropless")
        if self.route_scale <= 0:
            bad("route_scale", self.route_scale, "expected a number > 0")
        for name in ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                bad(name, getattr(self, name), "expected a number >= 0")
        if (self.num_groups is None) != (self.topk_groups is None):
            bad("num_groups", self.num_groups, "num_groups and topk_groups must be set together")
        if self.num_groups is not None:
            G = self.num_groups
            if not isinstance(G, int) or G < 1 or E % G:
                bad("num_groups", G, f"expected a positive divisor of num_experts={E}")
            if not isinstance(self.topk_groups, int) or not 1 <= self.topk_groups <= G:
                bad("topk_groups", self.topk_groups, f"expected an integer in [1, num_groups={G}]")
            if self.top_k > self.topk_groups * (E // G):
                bad("top_k", self.top_k, f"at most topk_groups * experts per group = {self.topk_groups * (E // G)}")
            if self.router != "token_choice":
                bad("num_groups", G, "group-limited routing needs router=token_choice")
        if self.num_shared_experts < 0:
            bad("num_shared_experts", self.num_shared_experts, "expected an integer >= 0")
        if self.shared_d_ff is not None and self.shared_d_ff < 1:
            bad("shared_d_ff", self.shared_d_ff, "expected a positive integer or None")
        if self.shared_expert_gate and not self.num_shared_experts:
            bad("shared_expert_gate", True, "a shared-expert gate needs num_shared_experts >= 1")
        if self.router == "expert_choice" and self.expert_bias:
            bad("expert_bias", True, "aux-loss-free bias applies to token_choice routing")

    @property
    def capacity_or_default(self) -> float:
        # expert choice always has a capacity; 1.0 means each expert takes k*T/E tokens
        return 1.0 if self.capacity_factor is None else self.capacity_factor

    @classmethod
    def from_dict(cls, d: dict) -> MoEConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown MoEConfig keys {unknown}; valid keys are {sorted(names)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)
