"""``ZeroEngine``'s backward side: each gradient moved into its flat buffer as it arrives, a
unit's reduction launched as soon as its last gradient has arrived (in the same order on every
rank), the wait for them, and the global gradient norm."""

from __future__ import annotations

import math

import torch

from .units import Unit

WAIT_RANGE = "zero.wait_reductions"  # the profiler range around the wait for a step's reductions


class GradReduction:
    """Mixed into ``ZeroEngine``: gradient arrival and reduction. Owns ``_where``, ``_grad_hooks``
    and the per-step flags below; reads the engine's ``units``, ``flats``, ``stage``,
    ``keep_gathered``, ``layout``, ``device`` and ``comm`` (``zero.comm``), the forward order ``_fwd_order`` and
    ``_free_unit`` (``zero.gather``)."""

    def _init_reduction(self) -> None:
        self._where = {}
        self._grad_hooks = []
        for u in self.units:
            for f in u.flats:
                for i, p in enumerate(f.params):
                    self._where[p] = (u, f, i)
                    p.grad = None
                    self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._sync = True  # False inside no_sync()
        self._bwd_queue: list[Unit] = []  # reduction order of the current backward
        self._backward_open = False  # a backward has started and not yet been finished
        self._unreduced = False  # local gradients accumulated under no_sync, not yet reduced
        self._reducing = False  # reductions launched by start_reduction(), not yet waited for
        self._reduced = False  # reduced gradients wait for step()

    def _open_backward(self) -> None:
        if not self._backward_open:
            if self._sync and self._reduced:
                raise RuntimeError(
                    "a second backward outside no_sync() before step(): gradients were already "
                    "reduced; run every micro-batch but the last inside engine.no_sync()"
                )
            self._backward_open = True
            self._bwd_queue = list(dict.fromkeys(reversed(self._fwd_order)))  # a unit run twice reduces once
            self._bwd_queue += [u for u in self.units if u not in self._bwd_queue]
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad(self, p: torch.Tensor) -> None:
        self._open_backward()
        unit, flat, index = self._where[p]
        flat.accumulate(index, p.grad)
        p.grad = None  # the flat buffer holds it now
        unit.arrived += 1
        if unit.arrived == unit.expected:
            unit.ready = True
            if self.stage == 3 and not unit.is_root and not self.keep_gathered:
                self._free_unit(unit)
            if self._sync:
                self._launch_ready()

    def _launch_ready(self) -> None:
        # reductions start strictly in queue order, so every rank issues the same sequence of
        # collectives on each group even if its gradients arrive in a different order
        for u in self._bwd_queue:
            if u.launched:
                continue
            if not u.ready:
                break
            self._launch(u)

    def _launch(self, unit: Unit) -> None:
        unit.launched = True
        unit.handles = [h for h in (f.launch_reduce() for f in unit.flats) if h is not None]

    def _finish_backward(self) -> None:
        if not self._backward_open:
            return
        self._backward_open = False
        if self._sync:
            for u in self._bwd_queue:  # units whose gradients never (all) arrived still reduce
                if not u.launched:
                    self._launch(u)
            self._wait_reductions()
        else:
            self._unreduced = True
            for u in self.units:
                u.arrived, u.ready = 0, False
        if self.stage == 3 and not (self.keep_gathered and not self._sync):
            for u in self.units:
                self._free_unit(u)

    def _reduce_all(self, wait: bool = True) -> None:
        self._bwd_queue = list(dict.fromkeys(reversed(self._fwd_order)))  # a unit run twice reduces once
        self._bwd_queue += [u for u in self.units if u not in self._bwd_queue]
        for u in self._bwd_queue:
            self._launch(u)
        self._unreduced = False
        self._reducing = True
        if wait:
            self._wait_reductions()

    def _wait_reductions(self) -> None:
        # named for the CPU memory meter (experiments.training.peak_memory): a copy the collective
        # library made of its input is gone by this range's end, wherever its free was
        with torch.profiler.record_function(WAIT_RANGE):
            for u in self._bwd_queue:
                for h in u.handles:
                    h.wait()
                for f in u.flats:
                    f.finish_reduce()
                u.handles, u.launched, u.ready, u.arrived = [], False, False, 0
        self._unreduced = False
        self._reducing = False
        self._reduced = True

    def _global_grad_norm(
        self, extra_finite: torch.Tensor | None = None, extra_sums: torch.Tensor | None = None
    ) -> tuple[float, list[int], list[float]]:
        """The global gradient norm, for each entry of ``extra_finite`` the number of ranks on which
        it is False, and each entry of ``extra_sums`` summed over the ranks: one all-reduce over dp
        (and pp) carries them all, and a non-finite gradient on any rank makes the summed square
        non-finite everywhere."""
        # each rank's norm slices are disjoint: dense over dp, expert slices over edp and distinct
        # experts over ep, so one sum over dp (and pp) counts every parameter once
        sq = torch.zeros(1, dtype=torch.float32, device=self.device)
        for f in self.flats:
            g = f.norm_slice()
            sq += torch.linalg.vector_norm(g, dtype=torch.float32).square().to(self.device)
        parts = [sq]
        if extra_finite is not None:
            parts.append((~extra_finite.reshape(-1)).to(self.device, torch.float32))
        if extra_sums is not None:
            parts.append(extra_sums.reshape(-1).to(self.device, torch.float32))
        sq = torch.cat(parts) if len(parts) > 1 else sq
        layout = self.layout
        if layout.dp_group is not None:
            self.comm.all_reduce(sq, layout.dp_group, label="grad_norm")
        if layout.pp_group is not None:
            self.comm.all_reduce(sq, layout.pp_group, label="grad_norm")
        values = sq.tolist()  # the step's one host sync
        n = 0 if extra_finite is None else extra_finite.numel()
        return math.sqrt(values[0]) / layout.dp, [int(v) for v in values[1 : 1 + n]], values[1 + n :]
