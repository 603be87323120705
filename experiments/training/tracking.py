"""Experiment tracking: metrics.jsonl always, wandb when ``logger=wandb``, and a multirun summary.

wandb is imported here and only when a wandb logger is built, so ``moe``/``zero`` never depend on it
and ``logger=none`` runs without it installed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from zero.checkpoint import write_durably

try:
    from hydra.core.hydra_config import HydraConfig
    from hydra.experimental.callback import Callback
except ImportError:  # tracking without Hydra (a plain script) still works
    HydraConfig, Callback = None, object


def hydra_job_info() -> dict:
    """Multirun identity of the current Hydra job, empty outside Hydra."""
    if HydraConfig is None or not HydraConfig.initialized():
        return {}
    hc = HydraConfig.get()
    info = {"job_name": hc.job.name, "overrides": list(hc.overrides.task), "mode": str(hc.mode)}
    if hc.mode is not None and hc.mode.name == "MULTIRUN":
        # one group per sweep: the job name plus the sweep folder (date_time), unique per launch
        info["group"] = f"{hc.job.name}-" + "_".join(Path(hc.sweep.dir).parts[-2:])
        info["name"] = f"{hc.job.num}:{hc.job.override_dirname}" if hc.job.override_dirname else str(hc.job.num)
    return info


class Tracker:
    """``logger=none``: metrics.jsonl is written by the training loop; nothing else to do."""

    run_id: str | None = None  # what a resumed run passes back to continue the same tracked run

    def log(self, metrics: dict, step: int) -> None:
        pass

    def log_expert_load(self, load_ME: list[list[int]], step: int) -> None:
        pass

    def finish(self, summary: dict | None = None, failed: bool = False) -> None:
        pass


class WandbTracker(Tracker):
    def __init__(self, cfg: DictConfig, run_dir: Path, run_id: str | None = None):
        import wandb

        lcfg = cfg.logger
        job = hydra_job_info()
        self.wandb = wandb
        self.expert_load = bool(lcfg.expert_load)
        self.run = wandb.init(
            project=lcfg.project,
            entity=lcfg.entity,
            mode=lcfg.mode,
            group=lcfg.group or job.get("group"),
            name=job.get("name"),
            tags=list(lcfg.tags),
            dir=str(run_dir),
            # resolved, so wandb shows values rather than ${...} strings
            config=OmegaConf.to_container(cfg, resolve=True),
            # a run resumed from a checkpoint continues the run that saved it
            id=run_id,
            resume="allow" if run_id else None,
        )
        self.run_id = self.run.id

    def log(self, metrics: dict, step: int) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}, step=step)

    def log_expert_load(self, load_ME: list[list[int]], step: int) -> None:
        if not self.expert_load:
            return
        out = {}
        for i, load_E in enumerate(load_ME):
            counts = np.asarray(load_E, dtype=np.float64)
            # bins are expert ids, heights the tokens each expert received since the last log:
            # the histogram panel then shows the load of every expert over time
            out[f"expert_load/layer{i}"] = self.wandb.Histogram(np_histogram=(counts, np.arange(len(counts) + 1)))
            out[f"expert_load/layer{i}_max_over_mean"] = float(counts.max() / max(counts.mean(), 1e-9))
        self.run.log(out, step=step)

    def finish(self, summary: dict | None = None, failed: bool = False) -> None:
        if summary:
            for k, v in summary.items():
                if isinstance(v, (int, float, str)):
                    self.run.summary[k] = v
                elif isinstance(v, dict):  # one level down: plan/layout, memory/predicted_peak_bytes, ...
                    for sub, x in v.items():
                        if isinstance(x, (int, float, str)):
                            self.run.summary[f"{k}/{sub}"] = x
        self.run.finish(exit_code=1 if failed else 0)  # a crashed run shows as failed, not finished


def make_tracker(cfg: DictConfig, run_dir: Path, rank: int, run_id: str | None = None) -> Tracker:
    name = cfg.logger.name
    if name not in ("wandb", "none"):
        raise ValueError(f"logger.name={name!r} is invalid: expected 'wandb' or 'none'")
    if rank != 0 or name == "none":
        return Tracker()
    return WandbTracker(cfg, run_dir, run_id)


def finite_or_none(value):
    """``value`` with every non-finite float (also inside lists, tuples and dicts) replaced by None:
    JSON has no NaN or Infinity (``json.dumps`` would write them as invalid tokens)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def to_json(value, **kw) -> str:
    """Strict JSON: a non-finite float is written as null."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kw)


class MetricsFile:
    """metrics.jsonl: one JSON object per logged step, flushed as it goes so a killed run keeps its
    rows; a non-finite value is written as null. ``keep_until``: a run resumed at that step into the
    same run dir keeps the rows up to it (a killed run may have logged steps after its last
    checkpoint: they are trained again) and appends."""

    def __init__(self, path: Path | None, keep_until: int | None = None):
        self.f = None
        if path is None:
            return
        path = Path(path)
        if keep_until is not None and path.is_file():
            lines = [row for row in path.read_text().splitlines() if row.strip()]
            try:
                json.loads(lines[-1]) if lines else None
            except json.JSONDecodeError:  # a row cut short by a kill: a step after the checkpoint
                lines.pop()
            kept = [row for row in lines if json.loads(row)["step"] <= keep_until]
            # the kept rows replace the file in one rename: truncating it in place and writing them
            # back would leave it empty (every earlier row lost) if this process were killed before
            # its first flush, and the next resume would keep nothing
            write_durably(path, "".join(line + "\n" for line in kept).encode())
            self.f = open(path, "a")
        else:
            self.f = open(path, "w")

    def write(self, row: dict) -> None:
        if self.f is not None:
            self.f.write(to_json(row) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def read_sweep(sweep_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(Path(sweep_dir).glob("*/summary.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        s = json.loads(path.read_text())
        s["job"] = path.parent.name
        rows.append(s)
    return rows


def format_sweep(rows: list[dict]) -> str:
    lines = [
        f"{'job':>4}  {'final val loss':>14}  {'unigram':>7}  {'active':>9}  {'total':>9}  {'tokens':>9}  overrides"
    ]
    for r in rows:
        val = r["final_val_loss"]  # null in summary.json when it was not finite
        val = f"{val:>14.4f}" if val is not None else f"{'null':>14}"
        lines.append(
            f"{r['job']:>4}  {val}  {r['unigram_entropy']:>7.4f}  {r['params_active']:>9,}  "
            f"{r['params_total']:>9,}  {r['tokens']:>9,}  {' '.join(r.get('overrides', []))}"
        )
    return "\n".join(lines)


class SweepSummary(Callback):
    """After a Hydra multirun, print every job's final numbers side by side and keep them in
    ``<sweep dir>/sweep_summary.json`` (each job writes its own ``summary.json``)."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every rank runs the sweep; one reports
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = read_sweep(sweep_dir)
        if not rows:
            return
        (sweep_dir / "sweep_summary.json").write_text(to_json(rows, indent=1))
        print(f"\nsweep {sweep_dir} (validation loss in nats per token):\n" + format_sweep(rows), flush=True)
