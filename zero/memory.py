"""Model-state memory per rank under each ZeRO stage: predicted from parameter counts, measured from
a running ``ZeroEngine``'s live tensors.

Per parameter, with compute bytes c (2 for bf16, 4 for fp32) and W ranks in its sharding group
(``dp`` for dense parameters, ``edp = dp / ep`` for experts, of which each rank holds ``1 / ep``):
    weights    c (stages 0-2)      c / W (stage 3)
    gradients  c (stages 0-1)      c / W (stages 2-3)
    optimizer  (m + 8) (stage 0)   (m + 8) / W (stages 1-3)   -- Adam moments 8 bytes; the fp32
               master copy m = 4 when it differs from the compute weights (bf16, or offload), else 0
With offload the optimizer bytes live in host memory instead; with ``offload="nvme"`` they live
in the offload files (``files_total``), and so do stage 3's weights (the compute-dtype shard: in the
master file itself when fp32, else c / W more bytes in the files), which then take no device
memory between uses (the host holds ``zero.nvme``'s fixed buffers, which are not counted here). bf16
+ Adam is the seeds' 16 bytes per parameter: a 7B model on 8 ranks costs 112 GB per rank at stage
0, 38.5 at 1, 26.25 at 2, 14 at 3.

    python -m zero.memory --params 7e9 --dp 8            # the table for stages 0-3
    python -m zero.memory --params 1e9 --expert-params 6e9 --dp 8 --ep 4 --stage 3 --offload
    python -m zero.memory --params 7e9 --dp 8 --stage 3 --nvme
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

from routing_kernels.runtime import is_expert_param

from .layout import Layout

_BYTES = {"fp32": 4, "bf16": 2}
KINDS = ("dense", "expert")
FIELDS = ("params", "grads", "optimizer", "optimizer_host")


def count_params(model: nn.Module, layout: Layout | None = None) -> dict[str, int]:
    """Parameters of the whole model, dense and expert (a rank holds 1/ep of the experts)."""
    ep = 1 if layout is None else layout.ep
    dense = sum(p.numel() for p in model.parameters() if p.requires_grad and not is_expert_param(p))
    expert = sum(p.numel() for p in model.parameters() if p.requires_grad and is_expert_param(p))
    return {"dense": dense, "expert": expert * ep}


def _totals(out: dict, files: float = 0) -> dict:
    out["device_total"] = sum(out[k][f] for k in KINDS for f in ("params", "grads", "optimizer"))
    out["host_total"] = sum(out[k]["optimizer_host"] for k in KINDS)
    out["files_total"] = files  # offload="nvme": bytes in the offload files
    return out


_OFFLOADS = {False: "none", True: "cpu", "none": "none", "cpu": "cpu", "nvme": "nvme"}


def predict_memory(
    params,
    *,
    dp: int = 1,
    ep: int = 1,
    stage: int = 0,
    mixed_precision: str = "bf16",
    offload: bool | str = False,
    layout: Layout | None = None,
):
    """Per-rank bytes of weights, gradients and optimizer state, dense and expert separately.

    ``params``: a count of dense parameters, a dict ``{"dense": n, "expert": m}`` over the whole
    model, or an ``nn.Module`` (counted with ``count_params``). ``layout`` overrides ``dp``/``ep``.
    Under pipeline parallelism each stage's ranks hold that stage's parameters only: pass the
    stage's module (what a pipeline rank holds), or a list with one count or dict per stage, which
    gives a list of per-rank results, one per stage (dp and ep are those inside each stage).
    ``offload``: ``"none"`` (False), ``"cpu"`` (True) or ``"nvme"``, as ``ZeroEngine`` takes it.
    """
    if isinstance(params, (list, tuple)):
        if not params:
            raise ValueError("params=[] is empty: give one count or dict per pipeline stage")
        return [
            predict_memory(
                p, dp=dp, ep=ep, stage=stage, mixed_precision=mixed_precision, offload=offload, layout=layout
            )
            for p in params
        ]
    if isinstance(offload, bool) or offload in ("none", "cpu", "nvme"):
        mode = _OFFLOADS[offload]
    else:
        raise ValueError(f"offload={offload!r} must be one of ('none', 'cpu', 'nvme') (or False/True)")
    if layout is not None:
        dp, ep = layout.dp, layout.ep
    if isinstance(params, nn.Module):
        params = count_params(params, layout)
    if isinstance(params, (int, float)):
        params = {"dense": params, "expert": 0}
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} must be one of 0, 1, 2, 3")
    if mixed_precision not in _BYTES:
        raise ValueError(f"mixed_precision={mixed_precision!r} must be one of {tuple(_BYTES)}")
    if dp < 1 or ep < 1 or dp % ep:
        raise ValueError(f"dp={dp}, ep={ep}: both must be >= 1 and ep must divide dp")
    for k in params:
        if k not in KINDS or params[k] < 0:
            raise ValueError(f"params[{k!r}]={params[k]!r}: expected keys {KINDS} with counts >= 0")
    c = _BYTES[mixed_precision]
    master = 4 if (mixed_precision != "fp32" or mode != "none") else 0
    out, files = {}, 0.0
    for kind in KINDS:
        n = params.get(kind, 0) / (ep if kind == "expert" else 1)  # held by this rank
        W = dp // ep if kind == "expert" else dp
        opt = n * (master + 8) / (1 if stage == 0 else W)
        weights = n * c / (W if stage == 3 else 1)
        if mode == "nvme":  # the optimizer state, and stage 3's shards, in the files
            files += opt + (weights if stage == 3 and c != 4 else 0.0)  # fp32: the master is the shard
        out[kind] = {
            "params": 0.0 if mode == "nvme" and stage == 3 else weights,
            "grads": n * c / (W if stage >= 2 else 1),
            "optimizer": opt if mode == "none" else 0.0,
            "optimizer_host": opt if mode == "cpu" else 0.0,
        }
    return _totals(out, files)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def measure_memory(engine) -> dict:
    """The same quantities from the engine's live buffers. Stage 3's gathered (temporary) weights are
    reported apart as ``gathered`` so they can be told from the persistent shards."""
    out = {k: dict.fromkeys(FIELDS, 0) for k in KINDS}
    gathered = 0
    seen = set()

    def add(kind, field, t):
        if t is None or t.untyped_storage().nbytes() == 0:
            return
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return
        seen.add(key)
        out[kind][field] += _nbytes(t)

    for f in engine.flats:
        if f.sharded_params:
            add(f.kind, "params", f.shard_C)  # None under offload="nvme": in the files
            # hpZ's node-local slice lives from a block's first gather to the step, as gathers do
            gathered += _nbytes(f.full_P) + _nbytes(getattr(f, "secondary", None))
        else:
            add(f.kind, "params", f.full_P)
        add(f.kind, "grads", f.grad_full_P)
        add(f.kind, "grads", f.grad_shard_C)
        field = "optimizer_host" if engine.offload else "optimizer"
        if f.separate_master and f.master is not None:  # offload="nvme": in files
            add(f.kind, field, f.master)
        # the optimizer's elementwise state of this flat's shard tensors (Adam's moments, SGD's
        # momentum), created by its first step; scalars such as the step count are left out
        for _, _, _, t in f.shards:
            for v in engine.optimizer.state.get(t, {}).values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    add(f.kind, field, v)
    nvme = getattr(engine, "_nvme", None)
    out = _totals(out, 0 if nvme is None else nvme.need)
    out["gathered"] = gathered
    return out


def format_table(rows: list[tuple[str, dict]], unit: float = 1e9, unit_name: str = "GB") -> str:
    head = (
        f"| stage | weights ({unit_name}) | grads ({unit_name}) | optimizer ({unit_name}) "
        f"| device total ({unit_name}) | host ({unit_name}) |"
    )
    lines = [head, "|" + "---|" * 6]
    for label, m in rows:
        p = sum(m[k]["params"] for k in KINDS)
        g = sum(m[k]["grads"] for k in KINDS)
        o = sum(m[k]["optimizer"] for k in KINDS)
        lines.append(
            f"| {label} | {p / unit:g} | {g / unit:g} | {o / unit:g} "
            f"| {m['device_total'] / unit:g} | {m['host_total'] / unit:g} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m zero.memory", description="Per-rank model-state memory under ZeRO (GB = 1e9 bytes)"
    )
    ap.add_argument("--params", type=float, required=True, help="dense parameters of the whole model (e.g. 7e9)")
    ap.add_argument("--expert-params", type=float, default=0.0, help="expert parameters of the whole model")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--mixed-precision", default="bf16", choices=tuple(_BYTES))
    ap.add_argument("--offload", action="store_true", help="optimizer state and update on the host")
    ap.add_argument("--nvme", action="store_true", help="optimizer state (and stage 3's weights) in files")
    ap.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages holding equal shares of the parameters (the "
        "busiest stage is what counts; world = pp x dp)",
    )
    a = ap.parse_args(argv)
    if a.pp < 1:
        ap.error(f"--pp={a.pp} must be >= 1")
    if a.nvme and a.offload:
        ap.error("--offload and --nvme: give one (--nvme keeps the optimizer state in files, not on the host)")
    rows = []
    for s in a.stage:
        m = predict_memory(
            {"dense": a.params / a.pp, "expert": a.expert_params / a.pp},
            dp=a.dp,
            ep=a.ep,
            stage=s,
            mixed_precision=a.mixed_precision,
            offload="nvme" if a.nvme else a.offload,
        )
        rows.append((str(s), m))
    print(
        f"params={a.params:g} expert_params={a.expert_params:g} pp={a.pp} dp={a.dp} ep={a.ep} {a.mixed_precision}"
        f"{' nvme' if a.nvme else ' offload' if a.offload else ''}, Adam; per rank of a stage"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
