"""Which layout? Every layout the trainer accepts for a model, world size and global batch, each one's
predicted peak memory per rank and step time on a machine profile, ranked fastest first.

    python -m experiments.plan [train overrides] plan.world=8 plan.cluster=h100_node [plan.out=plan.json]
        [plan.top=20] [plan.skew=1.5] [plan.max_virtual=4]
    python -m experiments.plan --calibrate [--out conf/cluster/<name>.yaml] [--base h200_node]

The first form composes the trainer's own config (``conf/train.yaml`` and the same overrides as
``python -m experiments.train``), so the model, ``moe.*``, ``train.batch_size``/``seq_len``,
``precision`` and ``parallel.zero_mixed_precision`` are the run's. A layout key given explicitly
(``parallel.pp=2``, ``parallel.ep=2``, ``parallel.ep_dispatch=node``, ``parallel.zero_stage=3``,
``parallel.zero_offload=true``, ``parallel.pp_schedule=...``, ``parallel.pp_virtual_stages=...``,
``parallel.pp_microbatches=...``, ``model.checkpoint_activations=true``, ``train.grad_accum=...``,
``parallel.pp_layers=[...]``, ``parallel.pp_overlap=true``) is held at that value; every other one is
searched (``ep_dispatch``: ``node`` too wherever the ep group spans two or more of the profile's
nodes; ``pp_overlap``: both ways under dualpipev). Each pipeline is
listed with the trainer's even split of layers and, where it beats that, with its layers cut by
cost (``parallel.pp_layers``, ``zero.plan.split``: the busiest rank's work per micro-batch least).
It prints a table (fastest first: step time, tokens/s, memory per rank, fits or not against the
profile's device memory) and the fastest layout that fits, writes the JSON list
``[{overrides, memory_bytes, memory_parts, step_s, fits, ...}]`` fastest first to ``plan.out``, and
a chart of memory and time per layout beside it (``plan.png``; needs matplotlib, the ``plan`` extra).

``plan.*`` keys (parsed here, never seen by Hydra): ``world`` (ranks, required), ``cluster`` (a
profile name under ``conf/cluster`` or a yaml path, required), ``out`` (JSON path), ``chart`` (PNG
path; default beside ``out``), ``top`` (table rows, default 20), ``skew`` (dropless MoE: worst-case
rows over the mean; default the worst case possible), ``max_virtual`` (interleaved schedules:
the most virtual stages per rank tried), ``zeropp`` (true: also ZeRO++'s hpZ, qwZ and qgZ, every
valid combination, on the profile's nodes; off by default, as qwZ and qgZ quantize what they move;
holding one of ``parallel.zero_hpz``/``zero_qwz``/``zero_qgz`` searches them too).

``--calibrate`` measures the machine it runs on: matmul FLOP/s by size, a large copy's bandwidth,
the non-matmul operators' rates by rows (the norms, rotary and residuals; the FFN activation), the
fixed cost of one forward and one backward operator of this code (a tiny model's steps), the host
optimizer's rate, and each collective by message size on 2
local ranks (gloo on a CPU, between ranks that compute before each call; NCCL on 2+ GPUs; α, β by
least squares), each figure the median of ``--repeats`` measurements (3 on a CPU), and writes a
profile yaml.
With one GPU the collectives cannot be measured: ``--base`` names the profile whose values fill
what was not measured.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import zero.plan as zplan
from experiments.calibrate import (  # noqa: F401  (the calibration's public names, here as before)
    COLL_SIZES,
    background_load,
    measure_collectives,
    measure_device,
    run_calibrate,
)
from zero.plan import LayoutRecord, Prediction

CONF = Path(__file__).resolve().parents[1] / "conf"
PLAN_KEYS = {
    "world": int,
    "cluster": str,
    "out": str,
    "chart": str,
    "top": int,
    "skew": float,
    "max_virtual": int,
    "zeropp": bool,  # parsed by _parse_bool (true/false), not bool()
}
# LayoutRecord field of each trainer key a user may hold fixed
FIXED = {v: k for k, v in zplan.KEYS.items()}


def _parse_bool(v: str) -> bool:
    if v.lower() in ("true", "1", "yes"):
        return True
    if v.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"expected true or false, got {v!r}")


def _parse_offload(v: str) -> bool:
    """``parallel.zero_offload``: none/false or cpu/true (the planner models no NVMe offload)."""
    if v.lower() in ("none", "cpu"):
        return v.lower() == "cpu"
    if v.lower() == "nvme":
        raise ValueError("parallel.zero_offload=nvme: the planner models none and cpu only")
    return _parse_bool(v)


def split_args(argv: list[str]) -> tuple[dict, list[str]]:
    """``plan.*`` values (typed) and the remaining Hydra overrides."""
    plan, rest = {}, []
    for a in argv:
        if a.startswith("plan."):
            key, sep, value = a[len("plan.") :].partition("=")
            if not sep or key not in PLAN_KEYS:
                raise ValueError(
                    f"{a!r}: expected plan.<key>=<value> with key one of {sorted(PLAN_KEYS)} "
                    f"(e.g. plan.world=8 plan.cluster=h100_node)"
                )
            try:
                kind = PLAN_KEYS[key]
                plan[key] = _parse_bool(value) if kind is bool else kind(value)
            except ValueError:
                want = "true or false" if PLAN_KEYS[key] is bool else PLAN_KEYS[key].__name__
                raise ValueError(f"plan.{key}={value!r} is invalid: expected {want}") from None
        else:
            rest.append(a)
    return plan, rest


def fixed_keys(overrides: list[str]) -> dict:
    """The layout keys an override sets explicitly, as ``LayoutRecord`` fields."""
    out = {}
    for o in overrides:
        key, sep, value = o.lstrip("+~").partition("=")
        if not sep or key not in FIXED:
            continue
        field = FIXED[key]
        if field == "zero_offload":
            out[field] = _parse_offload(value)
        elif field in ("checkpoint_activations", "zero_hpz", "zero_qwz", "zero_qgz", "pp_overlap"):
            out[field] = _parse_bool(value)
        elif field in ("pp_schedule", "ep_dispatch"):
            out[field] = value
        elif field in ("pp_microbatches", "pp_layers") and value.lower() in ("null", "none"):
            continue
        elif field == "pp_layers":
            try:
                out[field] = [int(k) for k in value.strip("[]").split(",")]
            except ValueError:
                raise ValueError(f"parallel.pp_layers={value!r} is invalid: expected a list of integers") from None
        else:
            out[field] = int(value)
    return out


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import experiments.training.schema  # noqa: F401  (the schemas and the ${div:} resolver)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("train", overrides=list(overrides))


def _model_config(cfg):
    from experiments.training.schema import model_config

    return model_config(cfg)


def costs_of(cfg, profile: zplan.Profile | None = None) -> zplan.ModelCosts:
    from moe.costs import model_costs

    act = "bf16" if cfg.precision == "bf16" or cfg.parallel.zero_mixed_precision == "bf16" else "fp32"
    kernel = profile.expert_kernel if profile is not None else "grouped"
    return model_costs(_model_config(cfg), int(cfg.train.seq_len), act_dtype=act, experts=kernel)


def plan_layouts(cfg, world: int, profile: zplan.Profile, fixed: dict | None = None, **kw):
    """``[(LayoutRecord, Prediction), ...]`` fastest first for the composed config ``cfg``."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"plan.world={world!r} is invalid: expected a positive integer (the number of ranks)")
    costs = costs_of(cfg, profile)
    skew = kw.pop("skew", None)
    # ZeRO++ is searched when asked (plan.zeropp=true) or when a key of it is held
    zeropp = bool(kw.pop("zeropp", False)) or any(k in (fixed or {}) for k in zplan.ZEROPP)
    p = cfg.parallel
    block = {"zero_quant_block": int(p.zero_quant_block), "zero_qgz_bits": int(p.zero_qgz_bits)}
    recs = zplan.enumerate(
        costs,
        world=world,
        batch_size=int(cfg.train.batch_size),
        mixed_precision=str(p.zero_mixed_precision),
        fixed=fixed,
        zeropp=zeropp,
        node_size=profile.node_size,
        **kw,
    )
    recs = [dataclasses.replace(r, **block) for r in recs]  # the run's quantization settings
    if "pp_layers" not in (fixed or {}):
        # each pipeline also cut by its layers' costs, where that beats the even split
        recs = zplan.with_balanced(recs, costs, profile, skew)
    if not recs:
        raise ValueError(
            f"no layout of {world} ranks is valid for train.batch_size={cfg.train.batch_size}, "
            f"{costs.num_layers} pipeline layers, {costs.num_experts or 'no'} experts"
            + (f" with {fixed}" if fixed else "")
            + ": the batch must split over dp x train.grad_accum (x micro-batches); try another plan.world or batch"
        )
    ranked = [(r, zplan.predict(r, costs, profile, skew=skew)) for r in recs]
    ranked.sort(key=lambda rp: (rp[1].step_s, rp[1].memory_bytes))
    return costs, ranked


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g}"


def table(ranked: list[tuple[LayoutRecord, Prediction]], profile: zplan.Profile, top: int) -> str:
    cap = _gb(profile.device_memory_bytes)
    lines = [
        f"| # | layout | step (s) | tokens/s | memory/rank (GB) | of {cap} GB | fits | bubble |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (rec, p) in enumerate(ranked[:top], 1):
        lines.append(
            f"| {i} | {rec.label()} | {p.step_s:.4g} | {p.tokens_per_s:.4g} | {_gb(p.memory_bytes)} "
            f"| {p.memory_bytes / profile.device_memory_bytes:.0%} | {'yes' if p.fits else 'NO'} | {p.bubble:.2f} |"
        )
    return "\n".join(lines)


def to_json(ranked) -> list[dict]:
    return [
        {"overrides": rec.overrides(), "label": rec.label(), "world": rec.world, **p.to_dict()} for rec, p in ranked
    ]


def chart(ranked, profile: zplan.Profile, path: Path, top: int = 20) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [1, 1.4]})
    for fits, colour in ((True, "tab:blue"), (False, "tab:red")):
        pts = [(p.step_s, p.memory_bytes / 1e9) for _, p in ranked if p.fits == fits]
        if pts:
            ax0.scatter(*zip(*pts), s=8, c=colour, label="fits" if fits else "does not fit", alpha=0.6)
    ax0.axhline(profile.device_memory_bytes / 1e9, color="k", lw=0.8, ls="--", label="device memory")
    ax0.set_xscale("log")
    ax0.set_yscale("log")
    ax0.set_xlabel("predicted step time (s)")
    ax0.set_ylabel("predicted peak memory per rank (GB)")
    ax0.set_title(f"{len(ranked)} layouts on {profile.name}")
    ax0.legend()
    best = ranked[:top]
    names = [r.label() for r, _ in best][::-1]
    y = range(len(best))
    ax1.barh(y, [p.step_s for _, p in best][::-1], color=["tab:blue" if p.fits else "tab:red" for _, p in best][::-1])
    ax1.set_yticks(list(y), names, fontsize=7)
    ax1.set_xlabel("step time (s), fastest on top; red: does not fit")
    twin = ax1.twiny()
    twin.plot([p.memory_bytes / 1e9 for _, p in best][::-1], list(y), "k.", label="memory per rank (GB)")
    twin.set_xlabel("memory per rank (GB, dots)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_plan(argv: list[str]) -> int:
    opts, overrides = split_args(argv)
    for key in ("world", "cluster"):
        if key not in opts:
            raise ValueError(
                f"plan.{key} is required: python -m experiments.plan [train overrides] plan.world=N "
                f"plan.cluster=<profile> (profiles: {zplan.available_profiles()})"
            )
    profile = zplan.load_profile(opts["cluster"])
    fixed = fixed_keys(overrides)
    cfg = compose(overrides)
    if cfg.optim.name != "adamw" and cfg.optim.name != "adam":
        print(
            f"note: the model states assume Adam's two moments; optim.name={cfg.optim.name} keeps fewer",
            file=sys.stderr,
        )
    kw = {k: opts[k] for k in ("skew", "max_virtual", "zeropp") if k in opts}
    costs, ranked = plan_layouts(cfg, opts["world"], profile, fixed, **kw)
    params = costs.param_counts()
    print(
        f"{len(ranked)} layouts of {opts['world']} ranks on {profile.name} ({profile.device}); model "
        f"{params['dense'] + params['expert']:,} parameters ({params['expert']:,} expert), "
        f"{costs.num_layers} pipeline layers; global batch {cfg.train.batch_size} x {cfg.train.seq_len} tokens"
        + (f"; held: {fixed}" if fixed else "")
    )
    print(table(ranked, profile, opts.get("top", 20)))
    if "out" in opts:
        out = Path(opts["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(to_json(ranked), indent=1))
        print(f"wrote {out}")
    chart_path = opts.get("chart") or (str(Path(opts["out"]).with_suffix(".png")) if "out" in opts else None)
    if chart_path:
        try:
            print(f"wrote {chart(ranked, profile, Path(chart_path), opts.get('top', 20))}")
        except ImportError:
            print("no chart: matplotlib is missing (pip install -e '.[plan]')", file=sys.stderr)
    fitting = [(r, p) for r, p in ranked if p.fits]
    if not fitting:
        least = min(ranked, key=lambda rp: rp[1].memory_bytes)
        print(
            f"nothing fits: the smallest layout ({least[0].label()}) needs {_gb(least[1].memory_bytes)} GB per rank "
            f"and {profile.name} has {_gb(profile.device_memory_bytes)} GB; try more ranks (plan.world), "
            f"model.checkpoint_activations=true, a smaller train.batch_size, or another profile",
            file=sys.stderr,
        )
        return 2
    rec, p = fitting[0]
    print(
        f"picked: {rec.label()}: {p.step_s:.4g} s/step, {p.tokens_per_s:.4g} tokens/s, "
        f"{_gb(p.memory_bytes)} GB per rank\n  torchrun --nproc_per_node={rec.world} -m experiments.train "
        + " ".join(overrides + rec.overrides())
    )
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if "--calibrate" in argv:
            return run_calibrate(argv)
        if not argv or argv[0] in ("-h", "--help"):
            print(__doc__)
            return 0
        return run_plan(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
