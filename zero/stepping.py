"""``ZeroEngine``'s optimizer step: clipping, the optimizer over the shard tensors (in memory or
streamed through ``zero.nvme``), the refreshed compute weights, and the skip of a non-finite step.

Non-finite steps: ``step()`` skips, on every rank alike, a step whose gradient norm is not finite
(a NaN or inf gradient on any rank, or a norm that overflows fp32) or whose ``extra_finite`` flags
(the caller's own checks, e.g. ``engine.step(extra_finite=torch.isfinite(loss))``: a loss that is
NaN on one rank only) are False on any rank. The flags ride in the all-reduce that sums the norm,
so the decision costs no extra collective and no extra host sync. A skipped step changes nothing:
weights, optimizer state (moments and step counts) and ``step_count`` stay as they were, the
gradients are dropped, and stage 3 frees its gathered weights as after a normal step. So a step
never writes a non-finite gradient into the weights; ``weights_finite()`` checks the weights
themselves (a collective). After each step: ``last_grad_norm`` (what step() returned),
``last_step_skipped``, ``skipped_steps`` (the total) and ``last_nonfinite`` (for each entry of
``extra_finite``, flattened, the number of ranks on which it was False). ``step(...,
skip_if_nonfinite=False)`` applies the step anyway.

``step(extra_sums=...)``: any other per-rank values the caller wants summed over every rank (the
trainer's preemption flag), in the same all-reduce: ``last_extra_sums`` after the step, whether it
was taken or skipped. A flag every rank must agree on after each step then costs no collective of
its own.
"""

from __future__ import annotations

import math

import torch


class OptimizerStep:
    """Mixed into ``ZeroEngine``: ``step()``, ``lr`` and ``weights_finite()``. Reads the engine's
    ``flats``, ``units``, ``stage``, ``layout``, ``device``, ``optimizer``, ``max_grad_norm``, ``comm`` and
    ``_nvme``; updates ``step_count``, ``skipped_steps`` and the ``last_*`` fields; calls the reduction's
    ``_finish_backward``, ``_reduce_all``, ``_wait_reductions`` and ``_global_grad_norm`` (``zero.reduction``)
    and ``_free_unit`` (``zero.gather``)."""

    @torch.no_grad()
    def weights_finite(self) -> bool:
        """True when every trainable weight is finite, on every rank: each rank checks the master
        weights its optimizer updates (its shards; all of them under stage 0) and one all-reduce
        over dp (and pp) combines them. A collective: every rank must call it."""
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        if self._nvme is not None:  # the master weights are in files: streamed through the buffers
            bad += self._nvme.nonfinite_count()
        else:
            for f in self.flats:
                for _, _, _, t in f.shards:
                    bad += (~torch.isfinite(t)).sum().to(self.device, torch.float32)
        for group in (self.layout.dp_group, self.layout.pp_group):
            if group is not None:
                self.comm.all_reduce(bad, group, label="inspect")
        return bad.item() == 0

    @property
    def lr(self) -> float:
        """The learning rate of every optimizer group (an error if they differ: read
        ``engine.optimizer.param_groups`` then)."""
        lrs = {g["lr"] for g in self.optimizer.param_groups}
        if len(lrs) != 1:
            raise AttributeError(
                f"the optimizer's groups have different learning rates {sorted(lrs)}; "
                f"read them from engine.optimizer.param_groups"
            )
        return next(iter(lrs))

    @lr.setter
    def lr(self, value: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = value

    @torch.no_grad()
    def step(
        self,
        extra_finite: torch.Tensor | None = None,
        *,
        skip_if_nonfinite: bool = True,
        extra_sums: torch.Tensor | None = None,
    ) -> float:
        """Clip, run the optimizer on every shard tensor, refresh the compute weights, drop the
        gradients. Returns the global gradient 2-norm before clipping (each parameter counted once).

        A non-finite step is skipped on every rank (see the module docstring):
        when the norm, or any entry of any rank's ``extra_finite`` (a bool tensor, True where the
        caller's quantity is finite, e.g. ``torch.isfinite(loss)``; the same shape on every rank),
        is not finite, nothing is updated and the gradients are dropped. ``extra_finite`` travels in
        the norm's all-reduce. ``skip_if_nonfinite=False`` steps anyway (the old behaviour).
        ``extra_sums`` (a floating-point tensor, the same shape on every rank) travels there too:
        its entries summed over every rank, flattened, are ``last_extra_sums``; they skip nothing."""
        if extra_finite is not None and not (
            isinstance(extra_finite, torch.Tensor) and extra_finite.dtype == torch.bool
        ):
            got = (
                f"a tensor of dtype {extra_finite.dtype}"
                if isinstance(extra_finite, torch.Tensor)
                else type(extra_finite).__name__
            )
            raise ValueError(
                f"extra_finite must be a bool tensor (True where the quantity is finite, e.g. "
                f"torch.isfinite(loss)), got {got}"
            )
        if extra_sums is not None and not (isinstance(extra_sums, torch.Tensor) and extra_sums.is_floating_point()):
            got = f"a tensor of dtype {extra_sums.dtype}" if isinstance(extra_sums, torch.Tensor) else type(extra_sums)
            raise ValueError(
                f"extra_sums must be a floating-point tensor (per-rank values to sum over every rank), got {got}"
            )
        if self._backward_open:
            self._finish_backward()
        if self._unreduced:  # every backward of this step ran under no_sync: reduce now
            self._reduce_all()
        if self._reducing:  # start_reduction() launched it
            self._wait_reductions()
        if not self._reduced:
            raise RuntimeError("step() found no gradients: run a backward pass since the last step() or zero_grad()")
        self._reduced = False
        # the reduction summed over the group: 1/dp makes dense gradients the dp mean and expert
        # gradients (summed over ep by the All-to-All and over edp here) the global-batch ones
        grad_scale = 1.0 / self.layout.dp
        norm, self.last_nonfinite, self.last_extra_sums = self._global_grad_norm(extra_finite, extra_sums)
        self.last_grad_norm = norm
        self.last_step_skipped = skip_if_nonfinite and (not math.isfinite(norm) or any(self.last_nonfinite))
        if self.last_step_skipped:  # the same decision on every rank: the inputs were all-reduced
            self.skipped_steps += 1
            self._release_step()
            return norm
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_'s coefficient, folded into the same factor
            grad_scale *= min(1.0, self.max_grad_norm / (norm + 1e-6))
        self.step_count += 1
        if self._nvme is not None:  # master weights and state stream through zero.nvme's buffers
            self._nvme.step(grad_scale)
        else:
            self._update_shards(grad_scale)
        handles = [h for h in (f.launch_param_gather() for f in self.flats) if h is not None]
        for h in handles:
            h.wait()
        self._release_step()
        return norm

    def _update_shards(self, grad_scale: float) -> None:
        """The optimizer over the shard tensors in memory, then the compute weights from the masters."""
        copies, copy_after = {}, []
        shards = []
        for f in self.flats:
            if not f.shards:
                continue
            grad = f.reduced_grad()
            if grad.device != f.master.device or grad.dtype != torch.float32:
                # bf16 or offloaded: one fp32 copy on the optimizer's device for the whole shard
                grad = grad.to(f.master.device, dtype=torch.float32)
            if not self._fused_step and grad_scale != 1.0:
                grad.mul_(grad_scale)  # in place: the reduced gradient is consumed by this step
            opt_lo = f.opt_range[0]
            for _, a, b, t in f.shards:
                t.grad = grad[a - opt_lo : b - opt_lo]
                shards.append(t)
            if f.separate_master:
                if self._fused_step and f.own_compute.device == f.master.device:
                    # the kernel writes the (bf16) compute weights in the same pass
                    for _, a, b, t in f.shards:
                        copies[t] = f.own_compute[a - opt_lo : b - opt_lo]
                else:  # offloaded to the host: one transfer after the update, not one per tensor
                    copy_after.append(f)
        if self._fused_step:
            self.optimizer.step(grad_scale=grad_scale, param_copies=copies)
        else:
            self.optimizer.step()
        for t in shards:
            t.grad = None
        for f in copy_after:
            f.own_compute.copy_(f.master, non_blocking=True)

    def _release_step(self) -> None:
        """The end of every step, taken or skipped: the gradients are consumed, and under stage 3
        the gathered weights are freed (stale after an update; the next forward gathers anew)."""
        for f in self.flats:
            f.discard_grads()
        if self.stage == 3:
            for u in self.units:
                self._free_unit(u)
        self.comm.end_step()
