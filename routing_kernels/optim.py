"""``FusedAdamW``: ``torch.optim.AdamW`` semantics, one ``routing_kernels.fused_adamw`` call per parameter.

On CUDA each call is one Triton kernel (read param, grad and both moments once, write them once);
elsewhere the torch reference runs. The dispatch point decides per call.

Parameters held in fp32 are updated in place. Parameters in a low-precision dtype (bf16/fp16
compute weights) get an fp32 master copy in the optimizer state; the kernel updates the master and
writes the rounded weights back into the parameter in the same pass, so precision is not lost step
to step. (That differs from ``torch.optim.AdamW`` on a bf16 parameter, which does its arithmetic in
bf16.)
"""
from __future__ import annotations

import torch

from . import dispatch


class FusedAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        if not 0.0 <= float(lr):
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            # a float32 tensor step, as torch.optim.AdamW keeps it, so state dicts load both ways
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            if p.dtype != torch.float32:
                state["master_param"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format).clone()
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients")
                state = self._init_state(p)
                state["step"] += 1
                grad = p.grad
                if grad.dtype not in (torch.float32, torch.bfloat16):
                    grad = grad.float()  # the kernel reads fp32 or bf16 gradients
                master = state.get("master_param")
                # the kernel works on flat contiguous buffers; a strided fp32 param goes through a
                # contiguous copy that is written back after the step
                target = master if master is not None else p
                flat = target if target.is_contiguous() else target.contiguous()
                copy = None
                if master is not None:
                    copy = p if p.is_contiguous() else torch.empty_like(p, memory_format=torch.contiguous_format)
                dispatch.fused_adamw(
                    flat.view(-1), grad.reshape(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                    step=int(state["step"].item()), lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=1.0,
                    param_copy=None if copy is None else copy.view(-1),
                )
                if flat is not target:
                    target.copy_(flat)
                if copy is not None and copy is not p:
                    p.copy_(copy)
        return loss
