"""Train a mixture-of-experts language model: ``python -m experiments.train [overrides]``.

The configured ``train.batch_size`` is the GLOBAL batch of one optimizer step. A layout with dp
data-parallel ranks gives each rank ``batch_size / dp`` rows of that same global batch (see
``experiments.data``), split into ``grad_accum`` micro-batches; each micro-batch loss is divided by
``grad_accum`` and the gradients are averaged over dp by the ``zero.ZeroEngine`` that drives every
``parallel.zero_stage``, 0 included, so every layout and accumulation setting trains the same thing
as one process on the whole batch.

The pieces (``build_layout``, ``build_model``, ``build_engine``, ``optimizer_factory``, ``lr_at``,
``evaluate``, ``train``) are plain functions of the config, so tests and other drivers use them
without the CLI. Shapes follow the project's legend (docs/design.md): B sequences, L sequence
length, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as nnf
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

import moe
import routing_kernels
import zero
from experiments import schema  # the config schema (Hydra's ConfigStore) and the ${div:} resolver
from experiments.data import LMData, build_data
from experiments.tracking import MetricsFile, hydra_job_info, make_tracker
from moe.model import Transformer, TransformerConfig


def build_layout(pcfg, num_experts: int | None = None) -> zero.Layout:
    """The single process, or, under torchrun, the groups the ``parallel`` config asks for; sizes are
    validated (naming the numbers) before any collective."""
    if pcfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"parallel.zero_stage={pcfg.zero_stage!r} is invalid: expected 0, 1, 2 or 3")
    if pcfg.pp != 1:
        raise ValueError(f"parallel.pp={pcfg.pp} is not available yet: pipeline parallelism is not implemented, use pp=1")
    if zero.init_distributed(timeout_s=float(pcfg.timeout_s)):
        return zero.Layout.build(ep=int(pcfg.ep), pp=int(pcfg.pp), num_experts=num_experts, timeout_s=float(pcfg.timeout_s))
    zero.validate_layout(1, int(pcfg.pp), int(pcfg.ep), num_experts)  # names the numbers when ep > 1 on one process
    return zero.Layout.single()


def build_engine(cfg: DictConfig, model: torch.nn.Module, layout: zero.Layout) -> zero.ZeroEngine:
    """The ``zero.ZeroEngine`` for ``parallel.zero_stage`` (0-3): it owns the gradient reduction,
    clipping and the optimizer of ``optimizer_factory(cfg.optim)``, over two param groups: matrices
    decay, norm gains and other 1-D parameters do not."""
    pcfg, ocfg = cfg.parallel, cfg.optim
    if int(pcfg.zero_stage) == 0 and pcfg.zero_offload:
        raise ValueError("parallel.zero_offload=true needs parallel.zero_stage >= 1")
    factory = optimizer_factory(ocfg)  # a bad optim.* stops here, before the engine's first collective
    wd = float(ocfg.weight_decay)
    return zero.ZeroEngine(
        model, layout, stage=int(pcfg.zero_stage), optimizer=factory,
        param_groups=lambda name, p: {"weight_decay": wd if p.dim() >= 2 else 0.0},
        max_grad_norm=float(cfg.train.grad_clip) if cfg.train.grad_clip > 0 else None,
        offload=bool(pcfg.zero_offload),
        mixed_precision=str(pcfg.zero_mixed_precision),
    )


def build_model(cfg: DictConfig, layout: zero.Layout | None = None) -> Transformer:
    """The transformer of ``cfg.model`` (+ ``cfg.moe`` when any block is MoE); configs validate
    themselves, so a bad value stops here with a message naming the key. ``model.init_from``: a
    transformers Mixtral checkpoint directory whose weights replace the initial ones (this rank's
    experts only), after checking that it matches model.* and moe.*."""
    # plain dicts of the resolved values; a key still ??? fails here naming it (MissingMandatoryValue)
    mcfg = OmegaConf.to_container(cfg.model, resolve=True, throw_on_missing=True)
    init_from = mcfg.pop("init_from", None)
    moe_cfg = None
    if mcfg.get("moe_every", 1):
        moe_cfg = moe.MoEConfig.from_dict(OmegaConf.to_container(cfg.moe, resolve=True, throw_on_missing=True))
        if moe_cfg.router == "expert_choice":
            print("warning: moe.router=expert_choice picks tokens across the whole batch, so a causal LM sees the future through it; its validation loss is optimistic", file=sys.stderr)
    model = Transformer(TransformerConfig.from_dict(mcfg, moe=moe_cfg), layout=layout)
    if init_from:
        from moe.hf_mixtral import import_mixtral  # needs the [hf] extra

        import_mixtral(init_from, model)
    return model


_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
_IMPLS = ("auto", "fused", "foreach", "switchyard")


def optimizer_factory(ocfg):
    """``groups -> torch.optim.Optimizer`` for ``optim.name`` (``adamw``, ``adam`` or ``sgd`` with
    ``optim.momentum``, default 0.9) and ``optim.impl``: ``fused`` (torch's fused kernel), ``foreach``,
    ``auto`` (fused where the optimizer's device supports it, else foreach), or ``switchyard``
    (``routing_kernels.FusedAdamW``: our Triton kernel on CUDA, its reference elsewhere; adamw only).
    The engine calls it over its shard tensors; weight decay comes with each param group."""
    name, impl = ocfg.name, ocfg.impl
    if name not in _OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is invalid: expected one of {tuple(_OPTIMIZERS)}")
    if impl not in _IMPLS:
        raise ValueError(f"optim.impl={impl!r} is invalid: expected one of {_IMPLS}")
    if name == "sgd":
        kw = dict(lr=float(ocfg.lr), momentum=float(ocfg.momentum))
    else:
        kw = dict(lr=float(ocfg.lr), betas=tuple(float(b) for b in ocfg.betas), eps=float(ocfg.eps))
    if impl == "switchyard":
        if name != "adamw":
            raise ValueError(f"optim.impl=switchyard is routing_kernels.FusedAdamW, an AdamW; optim.name={name!r} "
                             f"needs optim.impl=auto, fused or foreach")
        return lambda groups: routing_kernels.FusedAdamW(groups, **kw)
    cls = _OPTIMIZERS[name]

    def build(groups):
        if impl in ("auto", "fused"):
            try:
                return cls(groups, fused=True, **kw)
            except (RuntimeError, ValueError) as e:
                if impl == "fused":
                    raise ValueError(f"optim.impl=fused is not supported here ({e}); use optim.impl=foreach or auto") from e
        return cls(groups, foreach=True, **kw)
    return build


def lr_at(step: int, ocfg, total_steps: int) -> float:
    """Linear warmup over ``warmup_steps`` then cosine to ``lr * min_lr_ratio`` at ``total_steps``;
    ``step`` counts from 0 (the step about to be taken)."""
    lr, warmup = float(ocfg.lr), int(ocfg.warmup_steps)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(total_steps - warmup, 1)
    floor = lr * float(ocfg.min_lr_ratio)
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _autocast(cfg, device: torch.device):
    if cfg.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def _all_reduce_(t: torch.Tensor, layout: zero.Layout) -> torch.Tensor:
    if layout.dp_group is not None:
        dist.all_reduce(t, group=layout.dp_group)
    return t


@torch.no_grad()
def evaluate(model: Transformer, data: LMData, cfg: DictConfig, layout: zero.Layout, device: torch.device) -> float:
    """Mean loss (nats per token) over ``train.eval_batches`` fixed global batches of the validation
    split: the same windows every call and under every layout."""
    tcfg = cfg.train
    was_training = model.training
    model.eval()
    micro = tcfg.batch_size // layout.dp // tcfg.grad_accum
    sum_count = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(tcfg.eval_batches):
        x_BL, y_BL = data.get_batch("val", i, tcfg.batch_size, tcfg.seq_len, layout.dp_rank, layout.dp)
        for a in range(0, x_BL.shape[0], micro):  # micro-batch sized chunks bound the memory
            x, y = x_BL[a : a + micro].to(device), y_BL[a : a + micro].to(device)
            with _autocast(cfg, device):
                logits_BLV = model(x)
            loss_sum = nnf.cross_entropy(logits_BLV.float().flatten(0, 1), y.flatten(), reduction="sum")
            sum_count += torch.stack([loss_sum.double(), torch.tensor(float(y.numel()), dtype=torch.float64, device=device)])
    _all_reduce_(sum_count, layout)
    model.train(was_training)
    return (sum_count[0] / sum_count[1]).item()


def _check_train_cfg(cfg: DictConfig, layout: zero.Layout) -> None:
    schema.check_keys(cfg)  # a key added with +key=value that no schema has
    t = cfg.train
    for key in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_every", "eval_batches"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise ValueError(f"train.{key}={t[key]!r} is invalid: expected a positive integer")
    if t.batch_size % (layout.dp * t.grad_accum):
        raise ValueError(f"train.batch_size={t.batch_size} must be divisible by dp={layout.dp} x train.grad_accum={t.grad_accum}")
    if t.grad_clip < 0:
        raise ValueError(f"train.grad_clip={t.grad_clip} is invalid: expected >= 0 (0 disables clipping)")
    if cfg.precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={cfg.precision!r} is invalid: expected 'fp32' or 'bf16'")


def _device(cfg: DictConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(cfg.device)


def train(cfg: DictConfig, run_dir: str | Path | None = None, layout: zero.Layout | None = None, data: LMData | None = None,
          *, keep_weights: bool = False) -> dict:
    """Train per ``cfg``; rank 0 writes ``metrics.jsonl`` and ``summary.json`` into ``run_dir`` (when
    given) and returns the summary dict (other ranks return it too, without writing). ``layout``
    and ``data`` default to what ``cfg.parallel`` and ``cfg.data`` build; a driver running many
    configs on one corpus passes ``data`` to load it once. ``keep_weights``: the returned summary
    (not summary.json) also holds ``"weights"``, this rank's final fp32 weights by parameter name
    (experts: the slice this rank holds); under ZeRO gathering them is a collective, so every rank
    must pass the same value."""
    layout = layout or build_layout(cfg.parallel, cfg.moe.num_experts if cfg.model.moe_every else None)
    _check_train_cfg(cfg, layout)
    zero.check_same_on_all_ranks(OmegaConf.to_yaml(cfg, resolve=True), "config")  # before any other collective
    rank0 = layout.rank == 0
    tcfg = cfg.train
    device = _device(cfg)
    run_dir = Path(run_dir) if run_dir is not None else None
    if run_dir is not None and rank0:
        run_dir.mkdir(parents=True, exist_ok=True)

    data = build_data(cfg.data, seed=cfg.seed) if data is None else dataclasses.replace(data, seed=cfg.seed)
    if data.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"data vocabulary {data.vocab_size} exceeds model.vocab_size={cfg.model.vocab_size}")
    torch.manual_seed(cfg.seed)  # same initial weights on every rank and every rerun
    model = build_model(cfg, layout).to(device)
    model.train()
    engine = build_engine(cfg, model, layout)
    params = model.param_counts()
    unigram = data.unigram_entropy("val")

    tracker = make_tracker(cfg, run_dir if run_dir is not None else Path("."), layout.rank)
    metrics = MetricsFile(run_dir / "metrics.jsonl" if run_dir is not None and rank0 else None)
    layers = model.moe_layers()
    accum = tcfg.grad_accum
    micro = tcfg.batch_size // layout.dp // accum
    tokens_per_step = tcfg.batch_size * tcfg.seq_len  # global
    # a micro-batch's loss is divided by accum; the aux losses' gradients must shrink alike
    moe.scale_aux_losses(model, 1.0 / accum)

    if rank0:
        print(f"model: {params['total']:,} parameters, {params['active']:,} active per token; "
              f"{len(layers)} MoE of {cfg.model.n_layers} blocks; layout: {layout.describe()}; device {device}", flush=True)
        print(f"data: {data.name} {data.info}; train {len(data.train):,} / val {len(data.val):,} tokens", flush=True)

    # running sums since the last log row; tensors, so no step waits for the device unless logging
    def fresh():
        return {"loss": torch.zeros((), device=device), "aux": torch.zeros((), device=device), "drop": torch.zeros((), device=device), "gnorm": torch.zeros((), device=device), "n": 0,
                "load": [torch.zeros(l.cfg.num_experts, dtype=torch.long, device=device) for l in layers], "t": time.perf_counter(), "eval_s": 0.0}

    acc = fresh()
    logged_losses, val_loss, val_history = [], None, []
    t_start = time.perf_counter()
    bar = tqdm(total=tcfg.steps, disable=not (rank0 and tcfg.progress), dynamic_ncols=True, file=sys.stderr)
    try:
        for step in range(tcfg.steps):
            lr = lr_at(step, cfg.optim, tcfg.steps)
            engine.lr = lr
            x_BL, y_BL = data.get_batch("train", step, tcfg.batch_size, tcfg.seq_len, layout.dp_rank, layout.dp)
            for m in range(accum):
                x, y = x_BL[m * micro : (m + 1) * micro].to(device), y_BL[m * micro : (m + 1) * micro].to(device)
                # micro-batches before the last only accumulate locally: one reduction per step
                quiet = engine.no_sync() if m < accum - 1 else nullcontext()
                with quiet:
                    with _autocast(cfg, device):
                        logits_BLV = model(x)
                    loss = nnf.cross_entropy(logits_BLV.float().flatten(0, 1), y.flatten())
                    (loss / accum).backward()
                acc["loss"] += loss.detach() / accum
                for i, layer in enumerate(layers):
                    acc["load"][i] += layer.stats.tokens_per_expert
                if layers:
                    acc["aux"] += sum(l.stats.aux_loss.float() for l in layers) / len(layers) / accum
                    acc["drop"] += sum(l.stats.dropped_fraction.float() for l in layers) / len(layers) / accum
            # reduce, clip, the optimizer on this rank's shards; the norm before clipping
            gnorm = torch.as_tensor(engine.step(), dtype=torch.float32, device=device)
            moe.update_expert_biases(model)  # aux-loss-free balancing; a no-op unless moe.expert_bias
            acc["gnorm"] += gnorm.detach()
            acc["n"] += 1
            done = step + 1
            bar.update(1)

            last = done == tcfg.steps
            row_val = None
            if done % tcfg.eval_every == 0 or last:
                t_eval = time.perf_counter()
                val_loss = row_val = evaluate(model, data, cfg, layout, device)
                val_history.append((done, val_loss))
                acc["eval_s"] += time.perf_counter() - t_eval
            if done % tcfg.log_every == 0 or last or row_val is not None:
                n = acc["n"]
                loss_mean = _all_reduce_(acc["loss"].clone().reshape(1), layout).item() / layout.dp / n
                elapsed = time.perf_counter() - acc["t"] - acc["eval_s"]
                row = {
                    "step": done,
                    "loss": loss_mean,
                    "lr": lr,
                    "tokens_per_s": n * tokens_per_step / max(elapsed, 1e-9),
                    "grad_norm": acc["gnorm"].item() / n,
                }
                if layers:
                    # the MoE statistics are already global over dp (the layer reduces them)
                    row["aux_loss"] = acc["aux"].item() / n
                    row["dropped_fraction"] = acc["drop"].item() / n
                    load = [l.tolist() for l in acc["load"]]
                    row["load_max_over_mean"] = sum(max(e) / max(sum(e) / len(e), 1e-9) for e in load) / len(load)
                    row["expert_load"] = load
                if row_val is not None:
                    row["val_loss"] = row_val
                logged_losses.append(loss_mean)
                if rank0:
                    metrics.write(row)
                    tracker.log(row, done)
                    if layers:
                        tracker.log_expert_load(row["expert_load"], done)
                    post = {"loss": f"{loss_mean:.3f}", "tok/s": f"{row['tokens_per_s']:.0f}"}
                    if layers:
                        post.update(aux=f"{row['aux_loss']:.3f}", drop=f"{row['dropped_fraction']:.3f}")
                    if val_loss is not None:
                        post["val"] = f"{val_loss:.3f}"
                    bar.set_postfix(post, refresh=False)
                acc = fresh()
    except BaseException:
        bar.close()
        metrics.close()
        if rank0:
            tracker.finish(failed=True)
        raise
    bar.close()
    metrics.close()
    wall = time.perf_counter() - t_start
    summary = {
        "final_val_loss": val_loss,
        "unigram_entropy": unigram,
        "val_history": val_history,
        "train_losses": logged_losses,
        "steps": tcfg.steps,
        "tokens": tcfg.steps * tokens_per_step,
        "params_total": params["total"],
        "params_active": params["active"],
        "moe_layers": len(layers),
        "time_s": wall,
        "tokens_per_s": tcfg.steps * tokens_per_step / wall,
        "overrides": hydra_job_info().get("overrides", []),
        "layout": {"world": layout.world, "rank": layout.rank, "dp": layout.dp, "ep": layout.ep, "pp": layout.pp},
    }
    if rank0:
        tracker.finish(summary)
        if run_dir is not None:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"done: {tcfg.steps} steps, {summary['tokens']:,} tokens in {wall:.0f} s ({summary['tokens_per_s']:.0f} tokens/s)\n"
              f"final val loss {val_loss:.4f} nats/token vs byte-unigram baseline {unigram:.4f} (val-set entropy); "
              f"{val_loss / math.log(2):.3f} vs {unigram / math.log(2):.3f} bits", flush=True)
    if keep_weights:  # after summary.json: tensors are not JSON
        summary["weights"] = engine.full_parameters()  # a collective: every rank calls it
    return summary


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    summary = train(cfg, run_dir=HydraConfig.get().runtime.output_dir)
    return summary["final_val_loss"]  # what a Hydra sweeper (e.g. Optuna) minimises


if __name__ == "__main__":
    main()
