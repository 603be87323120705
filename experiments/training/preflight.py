"""Before the trainer allocates anything or runs a collective: ``parallel=auto`` (the planner's
fastest layout for the world size found) and the preflight (the chosen layout's predicted peak
memory per rank against this device's memory).

Both run on every rank from the config and the world size alone (``world_size``: the process
group's if one exists, else torchrun's or SLURM's environment), so every rank computes the same
plan without a collective. ``zero.plan`` predicts: the model's ``moe.costs`` with the routed
experts' kernel this process runs (``grouped`` on CUDA, ``fused`` on the CPU), the layout's
``LayoutRecord``, and for step times the profile ``train.plan_cluster`` (null: the shipped one of
this device, ``cpu_2core`` on a CPU).

The budget of one rank (``memory_budget``): ``train.preflight_budget_bytes`` when set, else on
CUDA the free memory of this rank's device (``torch.cuda.mem_get_info``), on the CPU the host's
available memory (``MemAvailable`` of /proc/meminfo) shared by the host's ranks. On the CPU the
device is the host, so the offloaded optimizer state counts against the same budget.

``parallel=auto`` ranks every layout the trainer accepts (``experiments.plan.plan_layouts``; the
layout keys given explicitly on the command line are held, as in ``python -m experiments.plan``)
and takes the fastest one predicted to fit the device's *capacity*: the budget key when set, else
the device's total memory (the host's total on the CPU, over its ranks), which is the same on every
rank, unlike what is free at this instant. The preflight then checks the pick against what is free.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

import zero.plan as zplan
from zero.plan import LayoutRecord, Prediction

# the layout keys parallel=auto sets, as LayoutRecord field -> (config section, key)
_TARGETS = {field: tuple(key.split(".")) for field, key in zplan.KEYS.items()}


class PreflightError(ValueError):
    """A layout predicted not to fit (or no layout that fits): the numbers and what would fit."""


def world_size() -> int:
    """Ranks of this run, without a collective: the process group's, else torchrun's or SLURM's."""
    import torch.distributed as dist

    from zero.layout import slurm_environment

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    env = slurm_environment() or os.environ
    return int(env.get("WORLD_SIZE", "1")) if "RANK" in env else 1


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _local_ranks(world: int) -> int:
    """Ranks sharing this host (its memory, on the CPU)."""
    return max(1, min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world))))


def _device(cfg) -> torch.device:
    """This rank's device before ``build_layout`` has set the CUDA device (torchrun's LOCAL_RANK)."""
    if cfg.device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        return torch.device("cpu")
    d = torch.device(cfg.device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return d


def _offload(value) -> bool:
    """``parallel.zero_offload`` as the planner's flag: true, or an offload target other than none."""
    if isinstance(value, str):
        return value.lower() not in ("none", "false", "")
    return bool(value)


def _expert_kernel(device: torch.device) -> str:
    """What the routed experts save per row in this process (``moe.costs``' ``experts``)."""
    from routing_kernels.dispatch import get_expert_backend

    backend = get_expert_backend()
    if backend == "auto":
        return "grouped" if device.type == "cuda" else "fused"
    return "fused" if backend == "cpu_blocks" else "grouped"


def profile_of(cfg, device: torch.device) -> zplan.Profile:
    """``train.plan_cluster``, else the shipped profile of this device (``cpu_2core`` on a CPU, the
    H100/H200/H800 node by the GPU's name), with the routed experts' kernel of this process."""
    name = cfg.train.plan_cluster
    if name is None:
        if device.type == "cuda":
            gpu = torch.cuda.get_device_name(device).upper()
            name = next((f"{g.lower()}_node" for g in ("H100", "H200", "H800") if g in gpu), None)
            if name is None:
                raise ValueError(
                    f"train.plan_cluster is needed: no shipped profile for {gpu!r} (profiles: "
                    f"{zplan.available_profiles()}); measure one with python -m experiments.plan --calibrate"
                )
        else:
            name = "cpu_2core"
    return dataclasses.replace(zplan.load_profile(name), expert_kernel=_expert_kernel(device))


def record_of(cfg, world: int) -> LayoutRecord:
    """The layout the config asks for, as the planner's record."""
    p = cfg.parallel
    pp = int(p.pp)
    v = int(p.pp_virtual_stages) if pp > 1 else 1
    m = (int(p.pp_microbatches) if p.pp_microbatches is not None else 2 * pp * v) if pp > 1 else 1
    return LayoutRecord(
        world=world,
        batch_size=int(cfg.train.batch_size),
        pp=pp,
        ep=int(p.ep),
        ep_dispatch=str(p.get("ep_dispatch", "flat")),
        zero_stage=int(p.zero_stage),
        zero_offload=_offload(p.zero_offload),
        pp_schedule=str(p.pp_schedule) if pp > 1 else None,
        pp_virtual_stages=v,
        pp_microbatches=m,
        checkpoint_activations=bool(cfg.model.checkpoint_activations),
        grad_accum=int(cfg.train.grad_accum),
        mixed_precision=str(p.zero_mixed_precision),
        zero_hpz=bool(p.zero_hpz),
        zero_qwz=bool(p.zero_qwz),
        zero_qgz=bool(p.zero_qgz),
        zero_qgz_bits=int(p.zero_qgz_bits),
        zero_quant_block=int(p.zero_quant_block),
        pp_layers=tuple(int(k) for k in p.pp_layers) if pp > 1 and p.pp_layers is not None else None,
        # carried with pp=1 too: the planner refuses it there, as the trainer does
        pp_overlap=bool(p.get("pp_overlap", False)),
    )


def node_size_of(cfg, world: int) -> int:
    """Ranks per node as ``zero.Layout.build`` takes them: ``parallel.node_size``, else torchrun's
    ``LOCAL_WORLD_SIZE``, else the whole world one node."""
    node_size = cfg.parallel.get("node_size", None)
    if node_size is not None:
        return int(node_size)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() else world


def _meminfo(key: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return float(value.split()[0]) * 1024
    raise KeyError(key)


def memory_budget(cfg, device: torch.device, world: int, capacity: bool = False) -> tuple[float, str]:
    """Bytes one rank may hold and where the figure comes from; ``capacity``: the device's total
    (the same on every rank) rather than what is free now."""
    if cfg.train.preflight_budget_bytes is not None:
        return float(cfg.train.preflight_budget_bytes), "train.preflight_budget_bytes"
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return (float(total), f"{device}'s total memory") if capacity else (float(free), f"free on {device}")
    local = _local_ranks(world)
    try:
        host = _meminfo("MemTotal" if capacity else "MemAvailable")
        what = "host memory" if capacity else "host memory available"
    except (OSError, KeyError):  # no procfs: the physical pages
        host, what = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "host memory"
    return host / local, what + (f" / {local} ranks on this host" if local > 1 else "")


def _need(p: Prediction, device: torch.device) -> float:
    """One rank's bytes against the budget: on the CPU the offloaded state is on the same memory."""
    return p.memory_bytes + (p.host_bytes if device.type != "cuda" else 0.0)


def _gb(x: float) -> str:
    return f"{x / 1e9:.4g} GB"


def fitting_layouts(cfg, world: int, profile: zplan.Profile, budget: float, device: torch.device, fixed=None):
    """Every layout of ``world`` ranks predicted to fit ``budget`` bytes per rank, fastest first."""
    from experiments.plan import plan_layouts

    _, ranked = plan_layouts(cfg, world, profile, fixed)
    return [(r, p) for r, p in ranked if _need(p, device) <= budget]


def predict_config(cfg, world: int, device: torch.device | None = None) -> tuple[LayoutRecord, Prediction] | None:
    """The config's layout and its prediction, or None when the planner cannot judge it: a layout
    the trainer refuses (its own checks name it after this)."""
    from experiments.plan import costs_of

    device = device or _device(cfg)
    rec = record_of(cfg, world)
    profile = profile_of(cfg, device)
    try:
        costs = costs_of(cfg, profile)
    except ValueError:  # a bad model.* / moe.* value: named by the model's own check later
        return None
    node_size = node_size_of(cfg, world)
    problem = zplan.layout_problem(rec, costs.num_layers, costs.num_experts, costs.tied, node_size)
    if problem is not None or rec.micro_rows < 1:
        return None
    if rec.ep_dispatch == "node":
        profile = _on_the_runs_nodes(profile, cfg, world)
    return rec, zplan.predict(rec, costs, profile)


def _on_the_runs_nodes(profile: zplan.Profile, cfg, world: int) -> zplan.Profile:
    """``profile`` on the nodes this run has (``node_size_of``): the node dispatch's two exchanges,
    and which layouts may dispatch so (an ep group over whole nodes), follow the run's nodes,
    whatever the profile was measured on."""
    node_size = node_size_of(cfg, world)
    return profile if node_size == profile.node_size else dataclasses.replace(profile, node_size=node_size)


def preflight(cfg, world: int) -> tuple[LayoutRecord, Prediction] | None:
    """Refuse the config's layout when its predicted peak per rank exceeds this rank's budget
    (``PreflightError`` with the bytes per part and the three fastest layouts that fit); returns
    the layout and its prediction (None when the planner cannot judge it, see ``predict_config``)."""
    device = _device(cfg)
    got = predict_config(cfg, world, device)
    if got is None:
        return None
    rec, p = got
    budget, what = memory_budget(cfg, device, world)
    need = _need(p, device)
    if need <= budget:
        return got
    parts = ", ".join(f"{k} {v:,.0f}" for k, v in p.memory_parts.items() if v)
    host = f"; host (offloaded optimizer state) {p.host_bytes:,.0f}" if p.host_bytes else ""
    fits = fitting_layouts(cfg, world, _on_the_runs_nodes(profile_of(cfg, device), cfg, world), budget, device)[:3]
    if fits:
        alternatives = "; the fastest layouts that fit:\n" + "\n".join(
            f"  {r.label()}: {_gb(_need(q, device))} per rank, {q.step_s:.4g} s/step: {' '.join(r.overrides())}"
            for r, q in fits
        )
    else:
        alternatives = (
            f"; no layout of {world} ranks fits: use more ranks, a smaller train.batch_size or model, or "
            "model.checkpoint_activations=true"
        )
    raise PreflightError(
        f"preflight: layout {rec.label()} is predicted to need {need:,.0f} bytes ({_gb(need)}) per rank, over the "
        f"budget of {budget:,.0f} bytes ({_gb(budget)}, {what}); predicted bytes per part: {parts}{host}"
        f"{alternatives}\n(train.preflight=false skips this check)"
    )


def resolve_auto(cfg, world: int, fixed: dict | None = None) -> tuple[LayoutRecord, Prediction, int]:
    """``parallel.auto``: set the layout keys of ``cfg`` (in place) to the fastest layout of
    ``world`` ranks predicted to fit the device's capacity, holding ``fixed`` (``LayoutRecord``
    fields; a ``parallel.pp_layers`` in the config is held too); returns it, its prediction and the
    number of layouts ranked."""
    from experiments.plan import plan_layouts

    if cfg.parallel.pp_layers is not None:
        fixed = {**(fixed or {}), "pp_layers": [int(k) for k in cfg.parallel.pp_layers]}
    device = _device(cfg)
    profile = _on_the_runs_nodes(profile_of(cfg, device), cfg, world)
    budget, what = memory_budget(cfg, device, world, capacity=True)
    _, ranked = plan_layouts(cfg, world, profile, fixed)
    fits = [(r, p) for r, p in ranked if _need(p, device) <= budget]
    if not fits:
        least_r, least_p = min(ranked, key=lambda rp: _need(rp[1], device))
        raise PreflightError(
            f"parallel=auto: none of the {len(ranked)} layouts of {world} ranks fits {budget:,.0f} bytes per rank "
            f"({what}); the smallest, {least_r.label()}, needs {_need(least_p, device):,.0f}: use more ranks, a "
            "smaller train.batch_size or model"
        )
    rec, p = fits[0]
    for field, (section, key) in _TARGETS.items():
        value = getattr(rec, field)
        if field == "pp_schedule" and value is None:
            continue  # pp=1: the key is unused
        if field == "zero_offload" and isinstance(cfg[section][key], str):
            value = "cpu" if value else "none"
        if field == "pp_layers" and value is not None:
            value = list(value)
        cfg[section][key] = value
    return rec, p, len(ranked)


def plan_summary(got, auto: bool, profile_name: str | None, layouts: int | None = None) -> dict | None:
    """What summary.json and the tracker keep of the plan (None without one)."""
    if got is None:
        return None
    rec, p = got
    out = {
        "auto": auto,
        "layout": rec.label(),
        "overrides": rec.overrides(),
        "predicted_step_s": p.step_s,
        "predicted_peak_bytes": p.memory_bytes,
        "predicted_parts": dict(p.memory_parts),
        "predicted_host_bytes": p.host_bytes,
        "profile": profile_name,
    }
    if layouts is not None:
        out["layouts_ranked"] = layouts
    return out


def held_layout_keys() -> dict:
    """The layout keys the Hydra command line sets explicitly (``LayoutRecord`` fields): what
    ``parallel=auto`` holds; none outside Hydra."""
    from experiments.plan import fixed_keys
    from experiments.training.tracking import hydra_job_info

    return fixed_keys(hydra_job_info().get("overrides", []))


def check_plan_keys(t) -> None:
    """``train.preflight_budget_bytes``, ``train.memory_steps`` and ``train.plan_cluster``, named."""
    if t.preflight_budget_bytes is not None and not t.preflight_budget_bytes > 0:
        raise ValueError(
            f"train.preflight_budget_bytes={t.preflight_budget_bytes!r} is invalid: expected a positive number of "
            "bytes, or null (the device's memory)"
        )
    if not isinstance(t.memory_steps, int) or t.memory_steps < 0:
        raise ValueError(
            f"train.memory_steps={t.memory_steps!r} is invalid: expected an integer >= 0 (0: no CPU meter)"
        )
    if t.plan_cluster is not None:
        try:
            zplan.load_profile(t.plan_cluster)
        except ValueError as e:  # it names the profiles there are
            raise ValueError(f"train.plan_cluster={t.plan_cluster!r} is invalid: {e}") from None


def plan_before_build(cfg, world: int, fixed: dict | None = None) -> dict | None:
    """What the trainer runs first: ``parallel.auto`` (printed on rank 0), then the preflight
    unless ``train.preflight=false``; returns ``plan_summary`` of the layout (None when neither ran
    or the planner cannot judge it)."""
    check_plan_keys(cfg.train)
    got, layouts = None, None
    if cfg.parallel.auto:
        rec, p, layouts = resolve_auto(cfg, world, fixed)
        got = (rec, p)
        if _rank() == 0:
            print(
                f"parallel=auto: {rec.label()} (fastest of {layouts} layouts of {world} ranks; predicted "
                f"{p.step_s:.4g} s/step, {_gb(p.memory_bytes)} per rank): {' '.join(rec.overrides())}",
                flush=True,
            )
    if cfg.train.preflight:
        got = preflight(cfg, world) or got
    if got is None:
        return None
    return plan_summary(got, bool(cfg.parallel.auto), profile_of(cfg, _device(cfg)).name, layouts)
