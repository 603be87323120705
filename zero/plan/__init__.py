"""The layout planner: every layout of a model on a world size (``enumerate``), each one's peak
memory per rank and step time on a machine profile (``predict``), without running the model.

    from zero import plan
    # the caller builds the costs, e.g. with moe.costs.model_costs (zero itself never imports moe)
    costs = model_costs(transformer_cfg, seq_len=4096, act_dtype="bf16")
    profile = plan.load_profile("h100_node")
    for rec in plan.enumerate(costs, world=64, batch_size=256):
        p = plan.predict(rec, costs, profile)      # Prediction(memory_bytes, memory_parts, step_s, fits, ...)
        print(rec.overrides(), p.memory_bytes, p.step_s, p.fits)
    # a pipeline's layers cut by their costs on this profile (parallel.pp_layers), where that beats the even split
    cut = plan.balance(rec, costs, profile)

``zero`` never imports ``moe``: the costs are the generic ``BlockCost`` records defined here, one
per pipeline layer, which ``moe.costs`` builds from a ``TransformerConfig``.
"""

from __future__ import annotations

from .cost import PARTS, BlockCost, MatMul, ModelCosts, Prediction, predict
from .enumerate import KEYS, ZEROPP, LayoutRecord, enumerate_layouts, layout_problem
from .profile import AlphaBeta, Profile, available_profiles, fit_alpha_beta, load_profile, save_profile
from .split import balance, balanced_split, with_balanced
from .wire import comm_bytes


def enumerate(costs: ModelCosts, *, world: int, batch_size: int, mixed_precision: str = "fp32", **kw):  # noqa: A001
    """Every layout the trainer accepts for ``costs``' model (``enumerate_layouts`` with the layer
    count, expert count and tied layers taken from the costs)."""
    return enumerate_layouts(
        costs.num_layers,
        world=world,
        batch_size=batch_size,
        num_experts=costs.num_experts,
        tied=costs.tied,
        mixed_precision=mixed_precision,
        **kw,
    )


def rank(costs: ModelCosts, profile: Profile, layouts, *, skew: float | None = None):
    """``[(layout, prediction), ...]`` fastest first; those that fit before those that do not."""
    out = [(rec, predict(rec, costs, profile, skew=skew)) for rec in layouts]
    out.sort(key=lambda rp: (not rp[1].fits, rp[1].step_s, rp[1].memory_bytes))
    return out


__all__ = [
    "PARTS",
    "KEYS",
    "ZEROPP",
    "AlphaBeta",
    "BlockCost",
    "LayoutRecord",
    "MatMul",
    "ModelCosts",
    "Prediction",
    "Profile",
    "available_profiles",
    "balance",
    "balanced_split",
    "comm_bytes",
    "enumerate",
    "enumerate_layouts",
    "fit_alpha_beta",
    "layout_problem",
    "load_profile",
    "predict",
    "rank",
    "save_profile",
    "with_balanced",
]
