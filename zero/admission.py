"""Optimizer admission for ``ZeroEngine``: which optimizers may run on ZeRO shard tensors, the
optimizer arguments, the param groups handed to the factory, and the checks on what it builds.
Everything here runs before the engine's first collective, so a refusal stops every rank alike."""

from __future__ import annotations

import torch

import routing_kernels

# optimizers whose update of one element reads other elements of the same parameter: a ZeRO shard
# tensor is a 1-D slice of a flat buffer that holds several parameters end to end and, under
# stages 1-3, cuts through them, so the whole-tensor quantity they need is not there
_WHOLE_TENSOR = {
    "Adafactor": "keeps factored second moments (one statistic per row and per column of each matrix) and scales "
    "each update by its parameter's RMS, which need the parameter's whole 2-D tensor",
    "Muon": "orthogonalises each matrix's update (Newton-Schulz iterations over the parameter's 2-D shape)",
    "LBFGS": "keeps a history of whole flattened parameter vectors and re-evaluates a closure for its line search",
    "SparseAdam": "needs sparse gradients, and ZeRO reduces dense flat gradient buffers",
}
# optimizers known to update each element from its own parameter, gradient and state alone
_ELEMENTWISE = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
    routing_kernels.FusedAdamW,
}


def check_elementwise(opt) -> None:
    """Raise ValueError unless ``opt`` may run on ZeRO shard tensors (see ``zero.engine``'s docstring).
    A class or instance attribute ``elementwise`` (True or False) overrides what the engine knows."""
    name = type(opt).__name__
    flag = getattr(opt, "elementwise", None)
    why = next((_WHOLE_TENSOR[c.__name__] for c in type(opt).__mro__ if c.__name__ in _WHOLE_TENSOR), None)
    if flag is True:
        return
    # the exact class: a subclass may change the update (it declares ``elementwise = True`` if not)
    if flag is None and why is None and type(opt) in _ELEMENTWISE:
        return
    shard = (
        "ZeroEngine gives the optimizer 1-D shard tensors (slices of flat buffers that hold several parameters "
        "end to end and, under stages 1-3, cut through them; under stage 0 too)"
    )
    if why is not None:
        raise ValueError(
            f"optimizer {name} cannot run under ZeroEngine: it {why}; {shard}, so it would compute "
            f"something else than unsharded. Use an elementwise optimizer (AdamW, Adam, SGD, ...)."
        )
    if flag is False:
        raise ValueError(f"optimizer {name} says elementwise = False: its update needs whole tensors, and {shard}")
    raise ValueError(
        f"optimizer {name} is not known to be elementwise: {shard}, which is exact only for an optimizer "
        f"whose update of each element reads just that element's parameter, gradient and state (and "
        f"per-group scalars such as lr or the step count); per-tensor norms (LAMB, LARS) or matrix "
        f"shapes are not. If {name} is elementwise, set the class attribute {name}.elementwise = True"
    )


def resolve_param_groups(param_groups, named) -> tuple[dict, list[dict]]:
    """(param -> group index, each group's options) from the ``param_groups`` argument."""
    if param_groups is None:
        return {p: 0 for _, p in named}, [{}]
    group_of, options = {}, []
    if callable(param_groups):
        for n, p in named:
            opts = param_groups(n, p)
            opts = {} if opts is None else opts
            if not isinstance(opts, dict) or "params" in opts:
                raise ValueError(
                    f"param_groups({n!r}, ...) returned {opts!r}; it must return a dict of group options "
                    f"(e.g. {{'weight_decay': 0.0}}) without 'params'"
                )
            if opts not in options:
                options.append(opts)
            group_of[p] = options.index(opts)
        return group_of, [dict(o) for o in options]
    if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)):
        raise ValueError(
            f"param_groups must be a list of dicts (torch's form) or a function (name, param) -> options, "
            f"got {type(param_groups).__name__}"
        )
    name_of = {id(p): n for n, p in named}  # the trainable parameters
    model_params = {}  # id -> the group that lists it
    for gi, g in enumerate(param_groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"param_groups[{gi}] must be a dict with a 'params' entry, got {g!r:.80}")
        params = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise ValueError(
                    f"param_groups[{gi}]['params'] holds a {type(p).__name__}; it must hold the model's parameters"
                )
            if id(p) in model_params:
                raise ValueError(
                    f"parameter {name_of.get(id(p), '?')} is in param_groups[{model_params[id(p)]}] and "
                    f"param_groups[{gi}]; each parameter belongs to exactly one group"
                )
            model_params[id(p)] = gi
            if id(p) not in name_of and p.requires_grad:
                raise ValueError(
                    f"param_groups[{gi}] holds a tensor of shape {tuple(p.shape)} that is not a trainable "
                    f"parameter of the model"
                )
        options.append({k: v for k, v in g.items() if k != "params"})
    for n, p in named:
        if id(p) not in model_params:
            raise ValueError(f"parameter {n} is in no param group; list every trainable parameter in exactly one group")
        group_of[p] = model_params[id(p)]
    return group_of, options


def _check_optimizer(opt, given: list[list[int]]) -> None:
    """The factory's optimizer must be an elementwise torch optimizer over exactly the groups it was
    given (``given``: the ids of each group's shard tensors)."""
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(
            f"the optimizer factory returned {type(opt).__name__}; it must return a torch.optim.Optimizer "
            f"built over the param groups it is given"
        )
    check_elementwise(opt)
    got = [[id(t) for t in g["params"]] for g in opt.param_groups]
    if got == given:
        return
    shard_ids = {i for g in given for i in g}
    held = [i for g in got for i in g]
    if held and not shard_ids & set(held):
        raise ValueError(
            f"the optimizer from the factory holds {len(held)} tensors and none of the shard tensors it "
            f"was given: build it over the factory's argument (lambda groups: "
            f"torch.optim.AdamW(groups, ...)), not over model.parameters()"
        )
    raise ValueError(
        f"the optimizer from the factory must keep the {len(given)} param groups it is given, in order and "
        f"unchanged (sizes {[len(g) for g in given]}); it has {len(got)} groups of sizes "
        f"{[len(g) for g in got]}"
    )


def optimizer_factory(optimizer, *, lr, betas, eps, weight_decay):
    """The factory ``groups -> optimizer`` the engine calls: ``optimizer`` itself once checked, or
    ``routing_kernels.FusedAdamW`` configured by ``lr, betas, eps, weight_decay``, which configure
    that default only (refused next to a factory)."""
    adamw_kw = {k: v for k, v in dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay).items() if v is not None}
    if optimizer is not None:
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer={type(optimizer).__name__}(...) is an optimizer; pass a factory instead, "
                f"e.g. optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-4): the engine "
                f"builds it over its shard tensors, not over the model's parameters"
            )
        if not callable(optimizer):
            raise ValueError(
                f"optimizer={optimizer!r} must be a callable mapping param groups to a torch.optim.Optimizer"
            )
        if adamw_kw:
            raise ValueError(
                f"{', '.join(f'{k}={v!r}' for k, v in adamw_kw.items())} configure the default "
                f"optimizer only; with optimizer=... give them to the factory"
            )
    lr, betas = adamw_kw.get("lr", 1e-3), adamw_kw.get("betas", (0.9, 0.999))
    eps, weight_decay = adamw_kw.get("eps", 1e-8), adamw_kw.get("weight_decay", 0.0)
    if not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"lr={lr!r} must be a number >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas={betas!r} must be two numbers in [0, 1)")
    if not eps > 0:
        raise ValueError(f"eps={eps!r} must be > 0")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be >= 0")
    if optimizer is None:
        kw = dict(lr=float(lr), betas=tuple(float(b) for b in betas), eps=float(eps), weight_decay=float(weight_decay))
        optimizer = lambda groups: routing_kernels.FusedAdamW(groups, **kw)  # noqa: E731
    return optimizer


def build_optimizer(factory, group_options: list[dict], flats) -> torch.optim.Optimizer:
    """The factory's optimizer over one group per param group (``group_options``), each holding the
    shard tensors of that group in every flat, checked to be elementwise and over exactly those."""
    groups = [
        dict(options, params=[t for f in flats for g, _, _, t in f.shards if g == gi])
        for gi, options in enumerate(group_options)
    ]
    expected = [[id(t) for t in g["params"]] for g in groups]
    try:
        opt = factory(groups)
    except Exception as e:  # e.g. Muon refuses 1-D tensors itself
        raise ValueError(
            f"the optimizer factory failed on the engine's param groups, whose tensors are 1-D fp32 "
            f"shards of flat buffers ({type(e).__name__}: {e}); an optimizer that needs whole "
            f"parameter tensors (Muon's orthogonalised updates, Adafactor's factored moments) "
            f"cannot run under ZeroEngine"
        ) from e
    _check_optimizer(opt, expected)
    return opt
