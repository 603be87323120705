"""``MoELayer``: a drop-in replacement for a dense FFN.

Shapes follow the project's legend (docs/design.md): T tokens, K routing slots, D model dim,
E experts of the model.

``forward(x)`` maps ``[..., D]`` to the same shape. The auxiliary losses reach the backward pass
through the output itself (``_AttachAuxLoss``, after Megatron-Core's aux-loss auto-scaler), so a
training loop only calls ``loss.backward()``; their values and the router statistics are in
``layer.stats`` after each forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from routing_kernels.runtime import all_reduce_sum, first_pass_weight, group_size, replayed

from .config import MoEConfig
from .dispatch import AllToAllDispatcher, LocalDispatcher, NodeDispatcher
from .experts import DenseFFN, GroupedExperts
from .losses import load_balancing_loss, router_z_loss, routing_entropy, sequence_load_balancing_loss
from .router import Router


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, gives ``aux_loss`` the gradient ``scale`` as if it had been
    added to the training loss."""

    @staticmethod
    def forward(ctx, out, aux_loss, scale: float):
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        if torch.compiler.is_compiling():
            # traced, an identity output is a view of ``out``; when ``out`` is a graph input (a
            # graph break before it, e.g. expert parallelism's exchange) AOTAutograd replays that
            # view outside the graph and this backward, the aux losses' gradient, is lost. A copy
            # is a new tensor (its cost under Inductor is not measured yet).
            return out.clone()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_out.device), None


def _all_reduce_fields(fields: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """Each named tensor summed over ``group`` (in float64), all of them in one all-reduce."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in fields.values()])
    all_reduce_sum(flat, group)
    out, start = {}, 0
    for name, t in fields.items():
        out[name] = flat[start : start + t.numel()].view(t.shape)
        start += t.numel()
    return out


@dataclass
class MoEStats:
    """Detached values from the last forward (global over the data-parallel group when given)."""

    aux_loss: torch.Tensor
    seq_aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor  # assignments routed to each expert, before capacity
    dropped_fraction: torch.Tensor  # fraction of the k*T assignments dropped at capacity
    router_entropy: torch.Tensor  # mean entropy (nats) of each token's distribution over experts

    def as_dict(self) -> dict:
        return {k: (v.tolist() if v.dim() else v.item()) for k, v in self.__dict__.items()}


class MoELayer(nn.Module):
    """Router -> dispatcher -> grouped experts (+ shared experts).

    ``ep_group``: the expert-parallel group; each of its R ranks holds E/R experts and tokens cross
    it by All-to-All. ``dp_group``: the data-parallel group over which balancing statistics are
    reduced (global-batch balancing). ``None`` means one process for either. ``ep_node_groups``:
    ``(intra, inter)``, the ep group's sub-groups on this rank's node (None: this rank alone) and
    across nodes at its position: tokens then cross to each node once (``NodeDispatcher``).
    """

    def __init__(self, cfg: MoEConfig, *, ep_group=None, dp_group=None, ep_node_groups=None):
        super().__init__()
        self.cfg = cfg
        self.ep_group = ep_group
        self.dp_group = dp_group
        ep = group_size(ep_group)
        if cfg.num_experts % ep:
            raise ValueError(f"num_experts={cfg.num_experts} is not divisible by the expert-parallel size {ep}")
        local = cfg.num_experts // ep
        rank = 0 if ep_group is None else torch.distributed.get_rank(ep_group)
        self.router = Router(cfg)
        self.experts = GroupedExperts(
            local, cfg.d_model, cfg.d_ff, cfg.activation, expert_offset=rank * local, num_global=cfg.num_experts
        )
        self.shared_experts = None
        if cfg.num_shared_experts:
            self.shared_experts = DenseFFN(
                cfg.d_model, cfg.shared_d_ff or cfg.d_ff * cfg.num_shared_experts, cfg.activation
            )
        # per-token gate of the shared experts' output, sigmoid(x @ w_gate) (cfg.shared_expert_gate)
        self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.shared_expert_gate else None
        # optional module called with the router logits [T, E] on every forward (its output is
        # ignored): a place for forward hooks that record them (e.g. moe.hf's router-logits tap)
        self.router_logits_tap: nn.Module | None = None
        if ep_node_groups is not None and ep > 1:
            self.dispatcher = NodeDispatcher(ep_group, *ep_node_groups)
        else:
            self.dispatcher = AllToAllDispatcher(ep_group) if ep > 1 else LocalDispatcher()
        # multiplies the aux-loss gradient: set to 1/N when the training loss is divided by N
        # (gradient accumulation), see moe.scale_aux_losses
        self.aux_loss_scale = 1.0
        self.register_buffer("load_since_update", torch.zeros(cfg.num_experts), persistent=False)
        self.stats: MoEStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if x.shape[-1] != cfg.d_model:
            raise ValueError(
                f"MoELayer expects last dimension d_model={cfg.d_model}, got input of shape {tuple(x.shape)}"
            )
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])  # every leading dim is tokens
        T = x_TD.shape[0]
        # capacity and expert choice decide over the whole data-parallel batch, so the kept set is
        # the single-process one on every layout
        routing = self.router(x_TD, self.dp_group if self.dp_group is not None else self.ep_group)
        out_TD = self.dispatcher(x_TD, routing.expert_ids_TK, routing.weights_TK, self.experts, routing.max_kept)
        if self.router_logits_tap is not None:
            self.router_logits_tap(routing.logits_TE)
        if self.shared_experts is not None:
            shared_TD = self.shared_experts(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            out_TD = out_TD + shared_TD

        z_loss = router_z_loss(routing.logits_TE)  # one logsumexp serves the loss and its statistic
        E = cfg.num_experts
        K = routing.selected_TK.shape[1]
        # slot ids shifted by one so a -1 (a slot no expert took, expert choice) lands in bin 0
        counts_E1 = torch.zeros(E + 1, dtype=torch.float64, device=x.device)
        counts_E1.scatter_add_(
            0,
            routing.selected_TK.reshape(-1) + 1,
            torch.ones(routing.selected_TK.numel(), dtype=torch.float64, device=x.device),
        )
        # one all-reduce carries every global statistic, with no host sync on the way (no .item(),
        # no boolean-mask indexing); activation checkpointing's recomputation reuses the forward's
        # (replayed: the same routing gives the same sums) instead of reducing again in the backward
        fields = {
            "counts_E": counts_E1[1:],
            "tokens": torch.full((), float(T), dtype=torch.float64, device=x.device),
            "dropped": routing.num_dropped,
            "prob_sums_E": routing.probs_TE.detach().sum(0),
            "z_loss_sum": z_loss.detach() * T,
            "entropy_sum": routing_entropy(routing.probs_TE.detach()) * T,
        }
        total = replayed(lambda: _all_reduce_fields(fields, self.dp_group))
        counts_E = total["counts_E"]
        T_global = total["tokens"].clamp(min=1.0)

        zero = routing.logits_TE.sum() * 0.0
        lb_loss = lb_value = zero
        if cfg.router == "token_choice":
            lb_loss = zero if T == 0 else load_balancing_loss(routing.probs_TE, counts_E.float(), K, T_global.float())
            P_global = (total["prob_sums_E"] / T_global).float()
            lb_value = E * torch.dot((counts_E / (K * T_global)).float(), P_global)
        seq_loss = zero
        if cfg.seq_aux_loss_coef > 0 and cfg.router == "token_choice" and T > 0:
            seq_len = shape[-2] if len(shape) >= 3 else T
            seq_loss = sequence_load_balancing_loss(
                routing.probs_TE.view(-1, seq_len, E), routing.selected_TK.view(-1, seq_len, K)
            )
        aux = zero
        if cfg.aux_loss_coef > 0:
            aux = aux + cfg.aux_loss_coef * lb_loss
        if cfg.seq_aux_loss_coef > 0:
            aux = aux + cfg.seq_aux_loss_coef * seq_loss
        if cfg.z_loss_coef > 0:
            aux = aux + cfg.z_loss_coef * z_loss
        if torch.is_grad_enabled() and aux.requires_grad:
            out_TD = _AttachAuxLoss.apply(out_TD, aux, self.aux_loss_scale)

        # a forward's statistics, not those of activation checkpointing's recomputation. A compiled
        # recomputation must trace the graph its forward traced (checkpoint requires both to save
        # the same tensors), so under torch.compile the load is added times 0 and the statistics
        # (the same values) are set again, rather than skipped
        counted = first_pass_weight()
        if counted or torch.compiler.is_compiling():
            if self.training:
                self.load_since_update += counts_E.to(self.load_since_update.dtype) * counted
            self.stats = MoEStats(
                aux_loss=lb_value.detach(),
                seq_aux_loss=seq_loss.detach(),
                z_loss=(total["z_loss_sum"] / T_global).float(),
                tokens_per_expert=counts_E.long(),
                dropped_fraction=(total["dropped"] / (K * T_global)).float(),
                router_entropy=(total["entropy_sum"] / T_global).float(),
            )
        return out_TD.view(shape)

    @torch.no_grad()
    def update_expert_bias(self, rate: float | None = None) -> None:
        """Aux-loss-free balancing step; call after each optimizer step. Uses the load routed since
        the previous call (already global over the data-parallel group), then resets it."""
        if not self.cfg.expert_bias:
            return
        rate = self.cfg.bias_update_rate if rate is None else rate
        self.router.update_bias(self.load_since_update, rate)
        self.load_since_update.zero_()


def moe_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def scale_aux_losses(model: nn.Module, scale: float) -> None:
    """Make every MoE layer's aux-loss gradient match a training loss multiplied by ``scale``."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = scale


def update_expert_biases(model: nn.Module, rate: float | None = None) -> None:
    for layer in moe_layers(model):
        layer.update_expert_bias(rate)
