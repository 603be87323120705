"""What the training loop sums for its log rows: each MoE layer's statistics over a step's forwards
(``MoEStatSums``), the running sums since the last row (``RowSums``), and the reductions over
ranks that make them global.

Shapes follow the project's legend (docs/design.md); M counts the MoE layers of the whole model
(whichever pipeline stage runs each), E the experts of one layer.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import zero
from routing_kernels.runtime import first_pass_weight


def all_reduce_(t: torch.Tensor, layout: zero.Layout) -> torch.Tensor:
    """Summed over every rank of the step: dp, then the pipeline stages (a quantity only the last
    stage has is zero on the others)."""
    for group in (layout.dp_group, layout.pp_group):
        if group is not None:
            dist.all_reduce(t, group=group)
    return t


def sum_over_stages(tensors: list[torch.Tensor], layout: zero.Layout) -> list[torch.Tensor]:
    """Each tensor summed over the pipeline stages (one all-reduce): per-MoE-layer statistics are
    already global over dp (the layers reduce them) and each stage fills only its own layers, so
    the sum is every layer's value on every rank; each rank sends the same length, whatever it holds."""
    if layout.pp_group is None:
        return tensors
    flat = torch.cat([t.reshape(-1).double() for t in tensors])
    dist.all_reduce(flat, group=layout.pp_group)
    return list(torch.split(flat, [t.numel() for t in tensors]))


class MoEStatSums:
    """Sums of each MoE layer's statistics over the training forwards since ``reset()``, indexed by
    the layer's position among all MoE layers of the model (whichever pipeline stage runs it);
    collected by forward hooks, so every micro-batch a schedule runs is counted once (not the
    recomputation of activation checkpointing, not validation)."""

    def __init__(self, layers: dict, num_layers: int, num_experts: int, device: torch.device):
        self.num_layers, self.device = num_layers, device
        self.num_experts = num_experts
        self.reset()
        self._hooks = [layer.register_forward_hook(self._hook(i)) for layer, i in layers.items()]

    def reset(self) -> None:
        M, E = self.num_layers, self.num_experts
        self.load_ME = torch.zeros(M, E, dtype=torch.float64, device=self.device)
        self.aux_M = torch.zeros(M, dtype=torch.float64, device=self.device)
        self.z_M = torch.zeros(M, dtype=torch.float64, device=self.device)
        self.drop_M = torch.zeros(M, dtype=torch.float64, device=self.device)

    def _hook(self, i: int):
        def hook(layer, args, out):
            # times 0 in a recomputation, not skipped: a compiled block's recomputation then traces
            # its forward's graph (routing_kernels.runtime.first_pass_weight)
            w = first_pass_weight()
            if layer.training and (w or torch.compiler.is_compiling()):
                self.load_ME[i] += layer.stats.tokens_per_expert.double() * w
                self.aux_M[i] += layer.stats.aux_loss.double() * w
                self.z_M[i] += layer.stats.z_loss.double() * w
                self.drop_M[i] += layer.stats.dropped_fraction.double() * w

        return hook


class RowSums:
    """Running sums since the last log row, over the steps taken (``n`` of ``steps_run``, the rest
    skipped); tensors, so no step waits for the device unless logging. The clock starts at
    construction; ``eval_s`` is the validation time inside it, which the throughput leaves out."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device):
        M, E = num_layers, num_experts
        self.loss = torch.zeros((), device=device)
        self.gnorm = torch.zeros((), device=device)
        self.n = 0
        self.steps_run = 0
        self.load_ME = torch.zeros(M, E, dtype=torch.float64, device=device)
        self.aux_M = torch.zeros(M, dtype=torch.float64, device=device)
        self.drop_M = torch.zeros(M, dtype=torch.float64, device=device)
        self.comm_intra = self.comm_inter = 0  # bytes this rank sent in the steps run (zero.comm's count)
        self.t = time.perf_counter()
        self.eval_s = 0.0

    def add_comm(self, sent: dict) -> None:
        """A step run, taken or skipped: the bytes ``engine.comm_bytes()`` says it sent."""
        self.comm_intra += int(sent["intra"])
        self.comm_inter += int(sent["inter"])

    def add(self, loss: torch.Tensor, gnorm: torch.Tensor, stats: MoEStatSums) -> None:
        """A step taken (not skipped): its loss, gradient norm and MoE statistics."""
        self.loss += loss
        self.load_ME += stats.load_ME
        self.aux_M += stats.aux_M
        self.drop_M += stats.drop_M
        self.gnorm += gnorm.detach()
        self.n += 1
