"""Activation checkpointing whose one recomputation serves every backward pass over the graph:
``checkpoint_once(fn, *args, context_fn=...)``, for a split backward.

``torch.utils.checkpoint`` (non-reentrant) recomputes a checkpointed function once per autograd
graph task that unpacks its saved tensors. A plain backward is one graph task. A split backward
is many: ``torch.distributed.pipelining``'s zero-bubble schedules (``zbv``, ``interleaved_zb``,
``dualpipev``) run the input pass as one ``autograd.grad`` and then the weight pass as one
``autograd.grad`` per parameter group, over the same retained graph. Each of them recomputed the
whole block: measured on ``model=small``'s pp2 (``python -m experiments.bench.plan --part k``),
5.5 recomputations per block and micro-batch under zbv and interleaved_zb and 2.1 under dualpipev
where one was meant, steps 1.5-2.2x slower, and the input pass's recomputed tensors held for the
weight pass beside those each weight group recomputed again (zbv's busiest rank at 94 MB against
49 predicted).

Here the first unpack, in whichever pass, re-runs the forward once (from the inputs as they came,
under the forward's autocast state and random-number state) and hands each recomputed tensor to
the holder autograd keeps for it. A holder lives as long as autograd keeps that saved tensor: the
input pass (``retain_graph=True``) keeps them all for the weight pass, which reads the same
tensors, and they go when the graph does, or node by node in a plain backward. The re-run stops
at the last tensor saved (as torch's early stop). The recomputation is re-entered once per
forward, not per pass, so ``context_fn``'s recomputation context (``recompute_context``: the
forward's replayed collectives taken back) is entered once.

Used by ``moe.model.Transformer`` when ``recompute_once`` is set (``zero.pipeline.Pipeline`` sets
it on its chunks under a split-backward schedule); elsewhere the model keeps torch's checkpoint.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["checkpoint_once"]


class _Holder:
    """What autograd keeps for one saved tensor: nothing until the recomputation fills it."""

    __slots__ = ("value", "__weakref__")

    def __init__(self):
        self.value: torch.Tensor | None = None


class _Stop(Exception):
    """Raised by the recomputation's pack hook at the last saved tensor: the rest of the forward
    is not needed."""


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]


class _Frame:
    """One checkpointed call: its function, its inputs, the holders of what its forward saved."""

    def __init__(self, fn, args, recompute_ctx):
        self.fn, self.args = fn, args
        self.recompute_ctx = recompute_ctx
        self.holders: list[weakref.ref] = []
        self.specs: list[tuple] = []  # (shape, dtype) of each saved tensor, to check the re-run by
        self.done = False
        self.autocast = _autocast_state()
        self.cpu_rng = torch.get_rng_state()
        self.cuda_devices = sorted(
            {a.device.index for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"}
        )
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]

    def pack(self, x: torch.Tensor) -> _Holder:
        h = _Holder()
        self.holders.append(weakref.ref(h))
        self.specs.append((tuple(x.shape), x.dtype))
        return h

    def unpack(self, h: _Holder) -> torch.Tensor:
        if not self.done:
            self.recompute()
        if h.value is None:
            raise RuntimeError(
                "checkpoint_once: a tensor the forward saved was not recomputed (the re-run saved fewer "
                "tensors than the forward: the checkpointed function must save the same tensors each run)"
            )
        return h.value

    def recompute(self) -> None:
        n = len(self.holders)
        i = 0

        def pack(x: torch.Tensor) -> torch.Tensor:
            # returns a detached tensor: the re-run's own graph (thrown away) must not keep a saved
            # output whose grad_fn is the node saving it, a cycle only the garbage collector frees
            # (measured: every micro-batch's recomputed tensors alive to the step's end)
            nonlocal i
            out = x.detach()
            if i < n:
                if (tuple(x.shape), x.dtype) != self.specs[i]:
                    raise RuntimeError(
                        f"checkpoint_once: saved tensor {i} was {self.specs[i]} in the forward and "
                        f"{(tuple(x.shape), x.dtype)} in the recomputation: the checkpointed function must "
                        f"save the same tensors each run"
                    )
                h = self.holders[i]()
                if h is not None:  # a holder autograd already let go of needs nothing
                    h.value = out
            i += 1
            if i >= n:
                raise _Stop
            return out

        args = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in self.args]
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.cuda_devices))
            torch.set_rng_state(self.cpu_rng)
            for d, state in zip(self.cuda_devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, d)
            for device, enabled, dtype in self.autocast:
                if device == "cuda" and not torch.cuda.is_available():
                    continue
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x))
            if self.recompute_ctx is not None:
                stack.enter_context(self.recompute_ctx)
            try:
                self.fn(*args)
            except _Stop:
                pass
        self.done = True
        self.args = None  # the inputs are not needed again


def checkpoint_once(fn, *args, context_fn=None):
    """``fn(*args)``, keeping none of what its forward saves for backward; the first backward pass
    to need any of it re-runs ``fn`` once and every pass after reads the same recomputed tensors.
    ``context_fn``: as ``torch.utils.checkpoint.checkpoint``'s, a pair of context managers, the
    first around the forward, the second around the recomputation."""
    forward_ctx, recompute_ctx = context_fn() if context_fn is not None else (contextlib.nullcontext(), None)
    frame = _Frame(fn, args, recompute_ctx)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), forward_ctx:
        return fn(*args)
