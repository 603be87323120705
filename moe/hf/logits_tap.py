"""How a patched layer's router logits reach transformers' output recorder, which collects them for
the model's balancing loss and ``output_router_logits``: a tap module that passes for the stock
router (``tap_class``), and the hooks moved over when a model that already recorded is patched or
unpatched (``hook_if_already_hooked``). Shared by ``moe.hf.patch`` and ``moe.hf.stock``; imports
transformers only when it hooks."""

from __future__ import annotations

import torch.nn as nn


class RouterLogitsTap(nn.Module):
    """Identity on the router logits, returned as ``(logits, None, None)`` like the stock router's
    ``(logits, weights, indices)``.

    ``patch`` gives each layer an instance of a subclass that also derives from the stock router
    class, so transformers' output recorder (which hooks modules by ``isinstance`` of the router
    class) records the patched layer's logits where it recorded the stock router's."""

    def __init__(self):
        nn.Module.__init__(self)

    def forward(self, logits_TE):
        return (logits_TE, None, None)

    def __reduce__(self):
        # the class is made at run time (``tap_class``), so pickle cannot find it by name: a pickled
        # (or deep-copied) tap is rebuilt from the stock router class, which it can
        router_cls = next(c for c in type(self).__bases__ if c is not RouterLogitsTap)
        return _new_tap, (router_cls,), self.__dict__


_TAP_CLASSES: dict[type, type] = {}


def tap_class(router_cls: type) -> type:
    if router_cls not in _TAP_CLASSES:
        _TAP_CLASSES[router_cls] = type(
            f"{router_cls.__name__}LogitsTap",
            (RouterLogitsTap, router_cls),
            {"__init__": RouterLogitsTap.__init__, "forward": RouterLogitsTap.forward},
        )
    return _TAP_CLASSES[router_cls]


def _new_tap(router_cls: type) -> RouterLogitsTap:
    return tap_class(router_cls).__new__(tap_class(router_cls))


def hook_if_already_hooked(model: nn.Module, recorders: list[nn.Module]) -> None:
    # transformers installs its output-recording hooks lazily, once per (sub)model, on the first
    # forward that records something; where that already happened, the modules that carried the
    # hooks are gone (patch: the stock routers; unpatch: the taps), so the new ``recorders`` (taps
    # or stock routers, both returning ``(logits, ...)``) are hooked here
    hooked = [m for m in model.modules() if getattr(m, "_output_capturing_hooks_installed", False)]
    if not hooked:
        return
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder, install_output_capuring_hook

    done = set()
    for sub in hooked:
        # keyed by str(class) in every 5.x (5.24 wraps the dict in a class whose .get takes the model;
        # plain dict.get with the key works on both)
        specs = (dict.get(_CAN_RECORD_REGISTRY, str(sub.__class__)) or {}).get("router_logits")
        if specs is None:
            continue
        inside = {id(m) for m in sub.modules()}
        for spec in specs if isinstance(specs, list) else [specs]:
            index = spec.index if isinstance(spec, OutputRecorder) else 1
            for rec in recorders:
                if id(rec) in inside and id(rec) not in done:
                    install_output_capuring_hook(rec, "router_logits", index)
                    done.add(id(rec))
