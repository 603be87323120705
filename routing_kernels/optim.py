"""``FusedAdamW``: ``torch.optim.AdamW`` semantics, one ``routing_kernels.fused_adamw`` call per parameter.

On CUDA each call is one Triton kernel (read param, grad and both moments once, write them once);
elsewhere the torch reference runs. The dispatch point decides per call. On the CPU a large
parameter is updated in cache-sized chunks (``_CPU_CHUNK`` elements): the reference's temporaries
then stay small and in cache instead of costing fresh pages every step (about 2x faster on a ZeRO
shard of millions of elements); the arithmetic per element is the same, so chunking changes no bit.

Parameters held in fp32 are updated in place. Parameters in a low-precision dtype (bf16/fp16
compute weights) get an fp32 master copy in the optimizer state; the kernel updates the master and
writes the rounded weights back into the parameter in the same pass, so precision is not lost step
to step. (That differs from ``torch.optim.AdamW`` on a bf16 parameter, which does its arithmetic in
bf16.)

``step(grad_scale=s, param_copies={p: copy})`` are the two extras ``zero.ZeroEngine`` uses
(``fuses_scale_and_copy``): every gradient is multiplied by ``s`` inside the kernel (clipping and
the 1/dp of data parallelism, without a separate pass over the gradients), and an fp32 parameter
``p`` listed in ``param_copies`` has its updated value written into ``copy`` (e.g. bf16 compute
weights) in the same pass.
"""

from __future__ import annotations

import torch

from . import dispatch

_CPU_CHUNK = 1 << 16  # elements: 256 KiB of fp32 per operand, within a core's L2


class FusedAdamW(torch.optim.Optimizer):
    # each element's update reads only its own parameter, gradient and moments: ZeRO may shard it
    elementwise = True
    # step() takes grad_scale= and param_copies= (see the module docstring)
    fuses_scale_and_copy = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
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
    def step(self, closure=None, *, grad_scale: float = 1.0, param_copies: dict | None = None):
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
                elif param_copies is not None and p in param_copies:
                    copy = param_copies[p]
                    if copy.numel() != p.numel() or not copy.is_contiguous():
                        raise ValueError(
                            f"param_copies: a copy of {copy.numel()} elements (contiguous: "
                            f"{copy.is_contiguous()}) for a parameter of {p.numel()}"
                        )
                p_N, g_N, m_N, v_N = (
                    flat.view(-1),
                    grad.reshape(-1),
                    state["exp_avg"].view(-1),
                    state["exp_avg_sq"].view(-1),
                )
                c_N = None if copy is None else copy.view(-1)
                n = p_N.numel()
                chunk = _CPU_CHUNK if p_N.device.type == "cpu" else max(n, 1)
                kw = dict(
                    step=int(state["step"].item()),
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    grad_scale=float(grad_scale),
                )
                for a in range(0, n, chunk):
                    b = min(a + chunk, n)
                    dispatch.fused_adamw(
                        p_N[a:b], g_N[a:b], m_N[a:b], v_N[a:b], param_copy=None if c_N is None else c_N[a:b], **kw
                    )
                if flat is not target:
                    target.copy_(flat)
                if master is not None and copy is not p:
                    p.copy_(copy)
        return loss
