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
import math
import random
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
from experiments.training import schema  # the config schema (Hydra's ConfigStore) and the ${div:} resolver
from experiments.training.checkpointing import TrainCheckpoints, check_checkpoint_cfg
from experiments.training.data import LMData, build_data
from experiments.training.nonfinite import StepGuard
from experiments.training.tracking import MetricsFile, finite_or_none, hydra_job_info, make_tracker, to_json
from moe.model import Transformer, TransformerConfig
from routing_kernels.runtime import first_pass_weight
from zero.pipeline import Pipeline, PipelinePlan, plan_pipeline


def build_layout(pcfg, num_experts: int | None = None) -> zero.Layout:
    """The single process, or, under torchrun, the groups the ``parallel`` config asks for; sizes are
    validated (naming the numbers) before any collective."""
    if pcfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"parallel.zero_stage={pcfg.zero_stage!r} is invalid: expected 0, 1, 2 or 3")
    if zero.init_distributed(timeout_s=float(pcfg.timeout_s)):
        return zero.Layout.build(
            ep=int(pcfg.ep), pp=int(pcfg.pp), num_experts=num_experts, timeout_s=float(pcfg.timeout_s)
        )
    zero.validate_layout(1, int(pcfg.pp), int(pcfg.ep), num_experts)  # names the numbers when ep > 1 on one process
    return zero.Layout.single()


def build_plan(cfg: DictConfig) -> PipelinePlan | None:
    """The pipeline stages of ``parallel.pp*`` (None for pp=1), validated before any process group
    exists: each error names the keys and the numbers."""
    pcfg = cfg.parallel
    if pcfg.pp == 1:
        return None
    v = int(pcfg.pp_virtual_stages)
    m = int(pcfg.pp_microbatches) if pcfg.pp_microbatches is not None else 2 * int(pcfg.pp) * v
    layers = None if pcfg.pp_layers is None else [int(k) for k in pcfg.pp_layers]
    try:
        return plan_pipeline(
            int(cfg.model.n_layers) + 2,
            pp=int(pcfg.pp),
            pp_schedule=str(pcfg.pp_schedule),
            pp_microbatches=m,
            pp_virtual_stages=v,
            pp_layers=layers,
        )
    except ValueError as e:
        raise ValueError(f"parallel.{e}") from None


def split_model(model: Transformer, plan: PipelinePlan, layout: zero.Layout) -> tuple[Transformer, list[Transformer]]:
    """This pipeline rank's part of ``model``: the module holding all its layers (what the engine
    shards; parameters keep their names) and one module per stage it runs."""
    ranges = [plan.ranges[s] for s in plan.stages_of(layout.pp_rank)]
    return model.keep_layers(ranges), [model.pipeline_stage(lo, hi) for lo, hi in ranges]


def build_engine(
    cfg: DictConfig, model: torch.nn.Module, layout: zero.Layout, chunks: list[torch.nn.Module] | None = None
) -> zero.ZeroEngine:
    """The ``zero.ZeroEngine`` for ``parallel.zero_stage`` (0-3): it owns the gradient reduction,
    clipping and the optimizer of ``optimizer_factory(cfg.optim)``, over two param groups: matrices
    decay, norm gains and other 1-D parameters do not. ``chunks``: the pipeline stages that run
    ``model``'s layers (``split_model``); ZeRO-3 then keeps each block gathered for the step."""
    pcfg, ocfg = cfg.parallel, cfg.optim
    if int(pcfg.zero_stage) == 0 and pcfg.zero_offload:
        raise ValueError("parallel.zero_offload=true needs parallel.zero_stage >= 1")
    factory = optimizer_factory(ocfg)  # a bad optim.* stops here, before the engine's first collective
    wd = float(ocfg.weight_decay)
    pipeline = (
        {}
        if chunks is None
        else dict(
            blocks=zero.default_blocks(model),
            entries=chunks,
            keep_gathered_across_microbatches=int(pcfg.zero_stage) == 3,
        )
    )
    return zero.ZeroEngine(
        model,
        layout,
        stage=int(pcfg.zero_stage),
        optimizer=factory,
        **pipeline,
        param_groups=lambda name, p: {"weight_decay": wd if p.dim() >= 2 else 0.0},
        max_grad_norm=float(cfg.train.grad_clip) if cfg.train.grad_clip > 0 else None,
        offload=bool(pcfg.zero_offload),
        mixed_precision=str(pcfg.zero_mixed_precision),
    )


def model_config(cfg: DictConfig) -> TransformerConfig:
    """The ``TransformerConfig`` of ``cfg.model`` (+ ``cfg.moe`` when any block is MoE), without the
    trainer's ``model.init_from``; configs validate themselves, so a bad value stops here with a
    message naming the key. ``cfg`` may be a checkpoint's saved ``config.yaml``."""
    # plain dicts of the resolved values; a key still ??? fails here naming it (MissingMandatoryValue)
    mcfg = OmegaConf.to_container(cfg.model, resolve=True, throw_on_missing=True)
    for key, *_ in schema.MODEL_TRAINER_FIELDS:
        mcfg.pop(key, None)
    moe_cfg = None
    if mcfg.get("moe_every", 1):
        moe_cfg = moe.MoEConfig.from_dict(OmegaConf.to_container(cfg.moe, resolve=True, throw_on_missing=True))
    return TransformerConfig.from_dict(mcfg, moe=moe_cfg)


def build_model(cfg: DictConfig, layout: zero.Layout | None = None) -> Transformer:
    """The transformer of ``cfg.model`` (+ ``cfg.moe``; see ``model_config``). ``model.init_from``: a
    transformers Mixtral checkpoint directory whose weights replace the initial ones (this rank's
    experts only), after checking that it matches model.* and moe.*."""
    mcfg = model_config(cfg)
    if mcfg.moe is not None and mcfg.moe.router == "expert_choice":
        print(
            "warning: moe.router=expert_choice picks tokens across the whole batch, so a causal LM sees the future through it; its validation loss is optimistic",
            file=sys.stderr,
        )
    model = Transformer(mcfg, layout=layout)
    init_from = cfg.model.get("init_from", None)
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
            raise ValueError(
                f"optim.impl=switchyard is routing_kernels.FusedAdamW, an AdamW; optim.name={name!r} "
                f"needs optim.impl=auto, fused or foreach"
            )
        return lambda groups: routing_kernels.FusedAdamW(groups, **kw)
    cls = _OPTIMIZERS[name]

    def build(groups):
        if impl in ("auto", "fused"):
            try:
                return cls(groups, fused=True, **kw)
            except (RuntimeError, ValueError) as e:
                if impl == "fused":
                    raise ValueError(
                        f"optim.impl=fused is not supported here ({e}); use optim.impl=foreach or auto"
                    ) from e
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
    """Summed over every rank of the step: dp, then the pipeline stages (a quantity only the last
    stage has is zero on the others)."""
    for group in (layout.dp_group, layout.pp_group):
        if group is not None:
            dist.all_reduce(t, group=group)
    return t


def lm_loss(logits_BLV: torch.Tensor, y_BL: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return nnf.cross_entropy(logits_BLV.float().flatten(0, 1), y_BL.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(
    model: Transformer,
    data: LMData,
    cfg: DictConfig,
    layout: zero.Layout,
    device: torch.device,
    pipe: Pipeline | None = None,
) -> float:
    """Mean loss (nats per token) over ``train.eval_batches`` fixed global batches of the validation
    split: the same windows every call and under every layout; under a pipeline, through its
    forward-only schedule."""
    tcfg = cfg.train
    modules = [model] if pipe is None else [model, *(s.submod for s in pipe.stages)]
    was_training = model.training
    for mod in modules:
        mod.eval()
    micro = tcfg.batch_size // layout.dp // tcfg.grad_accum
    forwards = tcfg.grad_accum * (pipe.plan.microbatches if pipe is not None else 1)
    sum_count = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(tcfg.eval_batches):
        x_BL, y_BL = data.get_batch("val", i, tcfg.batch_size, tcfg.seq_len, layout.dp_rank, layout.dp, forwards)
        for a in range(0, x_BL.shape[0], micro):  # micro-batch sized chunks bound the memory
            x, y = x_BL[a : a + micro].to(device), y_BL[a : a + micro].to(device)
            with _autocast(cfg, device):
                if pipe is None:
                    loss_sum = lm_loss(model(x), y, "sum")
                else:  # equal micro-batches: each one's mean loss times its tokens
                    losses = pipe.eval(x if pipe.is_first else None, y if pipe.is_last else None)
                    loss_sum = sum(losses, torch.zeros((), device=device)) * (y.numel() / pipe.plan.microbatches)
            count = float(y.numel()) if pipe is None or pipe.is_last else 0.0
            sum_count += torch.stack([loss_sum.double(), torch.tensor(count, dtype=torch.float64, device=device)])
    _all_reduce_(sum_count, layout)
    for mod in modules:
        mod.train(was_training)
    return (sum_count[0] / sum_count[1]).item()


class MoEStatSums:
    """Sums of each MoE layer's statistics over the training forwards since ``reset()``, indexed by
    the layer's position among all MoE layers of the model (whichever pipeline stage runs it);
    collected by forward hooks, so every micro-batch a schedule runs is counted once (not the
    recomputation of activation checkpointing, not validation)."""

    def __init__(self, layers: dict, num_layers: int, num_experts: int, device: torch.device):
        self.num_layers, self.device = num_layers, device
        self.num_experts = num_experts
        self.reset()
        self._hooks = [layer.register_forward_hook(self._hook(i)) for layer, i in layers.items()]

    def reset(self) -> None:
        self.load_LE = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=self.device)
        self.aux_LQ = torch.zeros(self.num_layers, 2, dtype=torch.float64, device=self.device)  # aux_loss, z_loss
        self.drop_L = torch.zeros(self.num_layers, dtype=torch.float64, device=self.device)

    def _hook(self, i: int):
        def hook(layer, args, out):
            # times 0 in a recomputation, not skipped: a compiled block's recomputation then traces
            # its forward's graph (routing_kernels.runtime.first_pass_weight)
            w = first_pass_weight()
            if layer.training and (w or torch.compiler.is_compiling()):
                self.load_LE[i] += layer.stats.tokens_per_expert.double() * w
                self.aux_LQ[i, 0] += layer.stats.aux_loss.double() * w
                self.aux_LQ[i, 1] += layer.stats.z_loss.double() * w
                self.drop_L[i] += layer.stats.dropped_fraction.double() * w

        return hook


def _sum_over_stages(tensors: list[torch.Tensor], layout: zero.Layout) -> list[torch.Tensor]:
    """Each tensor summed over the pipeline stages (one all-reduce): per-MoE-layer statistics are
    already global over dp (the layers reduce them) and each stage fills only its own layers, so
    the sum is every layer's value on every rank; each rank sends the same length, whatever it holds."""
    if layout.pp_group is None:
        return tensors
    flat = torch.cat([t.reshape(-1).double() for t in tensors])
    dist.all_reduce(flat, group=layout.pp_group)
    return list(torch.split(flat, [t.numel() for t in tensors]))


def _check_train_cfg(cfg: DictConfig, layout: zero.Layout, plan: PipelinePlan | None = None) -> None:
    schema.check_keys(cfg)  # a key added with +key=value that no schema has
    t = cfg.train
    for key in (
        "steps",
        "batch_size",
        "seq_len",
        "grad_accum",
        "log_every",
        "eval_every",
        "eval_batches",
        "max_bad_steps",
    ):
        if not isinstance(t[key], int) or t[key] < 1:
            raise ValueError(f"train.{key}={t[key]!r} is invalid: expected a positive integer")
    if t.batch_size % (layout.dp * t.grad_accum):
        raise ValueError(
            f"train.batch_size={t.batch_size} must be divisible by dp={layout.dp} x train.grad_accum={t.grad_accum}"
        )
    if plan is not None and t.batch_size % (layout.dp * t.grad_accum * plan.microbatches):
        raise ValueError(
            f"train.batch_size={t.batch_size} must be divisible by dp={layout.dp} x train.grad_accum={t.grad_accum} "
            f"x parallel.pp_microbatches={plan.microbatches}: every micro-batch of the pipeline has the same rows"
        )
    if t.grad_clip < 0:
        raise ValueError(f"train.grad_clip={t.grad_clip} is invalid: expected >= 0 (0 disables clipping)")
    check_checkpoint_cfg(cfg)
    if cfg.precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={cfg.precision!r} is invalid: expected 'fp32' or 'bf16'")


def _device(cfg: DictConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(cfg.device)


def train(
    cfg: DictConfig,
    run_dir: str | Path | None = None,
    layout: zero.Layout | None = None,
    data: LMData | None = None,
    *,
    keep_weights: bool = False,
) -> dict:
    """Train per ``cfg``; rank 0 writes ``metrics.jsonl`` and ``summary.json`` into ``run_dir`` (when
    given) and returns the summary dict (other ranks return it too, without writing). ``layout``
    and ``data`` default to what ``cfg.parallel`` and ``cfg.data`` build; a driver running many
    configs on one corpus passes ``data`` to load it once. ``keep_weights``: the returned summary
    (not summary.json) also holds ``"weights"``, this rank's final fp32 weights by parameter name
    (experts: the slice this rank holds); under ZeRO gathering them is a collective, so every rank
    must pass the same value."""
    plan = build_plan(cfg)  # a bad pipeline config stops here, before any process group
    layout = layout or build_layout(cfg.parallel, cfg.moe.num_experts if cfg.model.moe_every else None)
    if layout.pp != cfg.parallel.pp:
        raise ValueError(f"parallel.pp={cfg.parallel.pp} but the layout has pp={layout.pp}")
    _check_train_cfg(cfg, layout, plan)
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
    random.seed(cfg.seed)  # and Python's generator (checkpoints carry its state) for code that uses it
    model = build_model(cfg, layout).to(device)
    model.train()
    if tcfg.compile:
        model.compile_blocks()
    params = model.param_counts()
    all_layers = model.moe_layers()  # of the whole model; a pipeline rank runs some of them
    layer_index = {layer: i for i, layer in enumerate(all_layers)}
    # non-finite steps: skip, count, stop; it names every MoE layer of the whole model, and every
    # rank hands the engine the same flags (the layers of other stages count as finite)
    guard = StepGuard(model, int(tcfg.max_bad_steps), layout.world)
    pipe = None
    if plan is not None:
        model, chunks = split_model(model, plan, layout)  # the other stages' layers are dropped here
        engine = build_engine(cfg, model, layout, chunks)
        pipe = Pipeline(chunks, plan, layout, engine, loss_fn=lm_loss, device=device)
    else:
        engine = build_engine(cfg, model, layout)
    unigram = data.unigram_entropy("val")
    ckpts = TrainCheckpoints(cfg, engine, layout, run_dir)
    resumed = ckpts.resume() or {}  # weights, optimizer, buffers and RNG are loaded; the loop's own state
    start = resumed.get("step", 0)
    guard.streak = [tuple(s) for s in resumed.get("bad_streak", [])]  # skipped steps in a row up to the checkpoint

    tracker = make_tracker(
        cfg, run_dir if run_dir is not None else Path("."), layout.rank, run_id=resumed.get("wandb_id")
    )
    metrics = MetricsFile(
        run_dir / "metrics.jsonl" if run_dir is not None and rank0 else None, keep_until=start if resumed else None
    )
    stats = MoEStatSums(
        {m: layer_index[m] for m in model.moe_layers()},
        len(all_layers),
        all_layers[0].cfg.num_experts if all_layers else 0,
        device,
    )
    accum = tcfg.grad_accum
    micro = tcfg.batch_size // layout.dp // accum
    forwards = accum * (plan.microbatches if plan is not None else 1)  # of each layer per step
    tokens_per_step = tcfg.batch_size * tcfg.seq_len  # global
    # each micro-batch's loss is divided by the micro-batches of the step; the aux losses' gradients
    # must shrink alike
    moe.scale_aux_losses(model, 1.0 / forwards)
    if pipe is not None:
        pipe.loss_scale = 1.0 / forwards

    if rank0:
        print(
            f"model: {params['total']:,} parameters, {params['active']:,} active per token; "
            f"{len(all_layers)} MoE of {cfg.model.n_layers} blocks; layout: {layout.describe()}; device {device}",
            flush=True,
        )
        if plan is not None:
            print(f"pipeline: {plan.describe()}", flush=True)
        print(f"data: {data.name} {data.info}; train {len(data.train):,} / val {len(data.val):,} tokens", flush=True)

    # running sums since the last log row, over the steps taken (n of steps_run); tensors, so no
    # step waits for the device unless logging
    L, E = len(all_layers), stats.num_experts

    def fresh():
        return {
            "loss": torch.zeros((), device=device),
            "gnorm": torch.zeros((), device=device),
            "n": 0,
            "steps_run": 0,
            "load": torch.zeros(L, E, dtype=torch.float64, device=device),
            "aux": torch.zeros(L, dtype=torch.float64, device=device),
            "drop": torch.zeros(L, dtype=torch.float64, device=device),
            "t": time.perf_counter(),
            "eval_s": 0.0,
        }

    acc = fresh()
    logged_losses, val_loss = resumed.get("logged_losses", []), resumed.get("val_loss")
    val_history = [tuple(v) for v in resumed.get("val_history", [])]
    status, done = "completed", start
    t_start = time.perf_counter()
    bar = tqdm(
        total=tcfg.steps, initial=start, disable=not (rank0 and tcfg.progress), dynamic_ncols=True, file=sys.stderr
    )
    try:
        for step in range(start, tcfg.steps):
            lr = lr_at(step, cfg.optim, tcfg.steps)
            engine.lr = lr
            # each of the step's micro-batches is spread over the dp ranks as in one process
            x_BL, y_BL = data.get_batch(
                "train", step, tcfg.batch_size, tcfg.seq_len, layout.dp_rank, layout.dp, forwards
            )
            stats.reset()  # this step's MoE statistics, of the layers this rank runs
            loss_step = torch.zeros((), device=device)
            for m in range(accum):
                x, y = x_BL[m * micro : (m + 1) * micro].to(device), y_BL[m * micro : (m + 1) * micro].to(device)
                if pipe is not None:
                    # the schedule splits the rows into the plan's micro-batches; the engine
                    # reduces after the last backward of the last round
                    with _autocast(cfg, device):
                        losses = pipe.step(
                            x if pipe.is_first else None, y if pipe.is_last else None, reduce=m == accum - 1
                        )
                    loss_step += sum(losses, torch.zeros((), device=device)) / forwards
                    continue
                # micro-batches before the last only accumulate locally: one reduction per step
                quiet = engine.no_sync() if m < accum - 1 else nullcontext()
                with quiet:
                    with _autocast(cfg, device):
                        logits_BLV = model(x)
                    loss = lm_loss(logits_BLV, y)
                    (loss / accum).backward()
                loss_step += loss.detach() / accum
            # reduce, clip, the optimizer on this rank's shards; the norm before clipping. A loss,
            # aux loss or gradient norm that is non-finite on any rank skips the step on every rank
            # (the loss is the last stage's; other stages hand a zero)
            gnorm = torch.as_tensor(
                engine.step(extra_finite=guard.flags(loss_step, stats.aux_LQ / forwards)),
                dtype=torch.float32,
                device=device,
            )
            done = step + 1
            acc["steps_run"] += 1
            if guard.update(engine, done):
                guard.discard_load()
            else:
                moe.update_expert_biases(model)  # aux-loss-free balancing; a no-op unless moe.expert_bias
                acc["loss"] += loss_step
                acc["load"] += stats.load_LE
                acc["aux"] += stats.aux_LQ[:, 0]
                acc["drop"] += stats.drop_L
                acc["gnorm"] += gnorm.detach()
                acc["n"] += 1
            bar.update(1)

            last = done == tcfg.steps
            stop = ckpts.stop_requested()  # SIGTERM/SIGUSR1 on any rank: every rank saves and stops here
            save_now = ckpts.due(done, last) or stop  # a checkpoint step is a log step: nothing half-summed is lost
            row_val = None
            if done % tcfg.eval_every == 0 or last:
                t_eval = time.perf_counter()
                val_loss = row_val = evaluate(model, data, cfg, layout, device, pipe)
                val_history.append((done, val_loss))
                acc["eval_s"] += time.perf_counter() - t_eval
            if done % tcfg.log_every == 0 or last or row_val is not None or guard.stopping or save_now:
                # means over the steps taken since the last row (NaN when every one was skipped:
                # null in metrics.jsonl); skipped steps are counted, from the start of the run
                n = acc["n"]
                mean = lambda total: total / n if n else math.nan  # noqa: E731
                loss_mean = mean(_all_reduce_(acc["loss"].clone().reshape(1), layout).item() / layout.dp)
                elapsed = time.perf_counter() - acc["t"] - acc["eval_s"]
                row = {
                    "step": done,
                    "loss": loss_mean,
                    "lr": lr,
                    "tokens_per_s": acc["steps_run"] * tokens_per_step / max(elapsed, 1e-9),
                    "grad_norm": mean(acc["gnorm"].item()),
                    "skipped_steps": engine.skipped_steps,
                }
                if all_layers:
                    load_LE, aux_L, drop_L = _sum_over_stages([acc["load"], acc["aux"], acc["drop"]], layout)
                    row["aux_loss"] = mean(aux_L.sum().item() / L / forwards)
                    row["dropped_fraction"] = mean(drop_L.sum().item() / L / forwards)
                    load = [[int(c) for c in e] for e in load_LE.view(L, E).tolist()]
                    row["load_max_over_mean"] = sum(max(e) / max(sum(e) / len(e), 1e-9) for e in load) / len(load)
                    row["expert_load"] = load
                if row_val is not None:
                    row["val_loss"] = row_val
                logged_losses.append(loss_mean)
                if rank0:
                    metrics.write(row)
                    tracker.log(row, done)
                    if all_layers:
                        tracker.log_expert_load(row["expert_load"], done)
                    post = {"loss": f"{loss_mean:.3f}", "tok/s": f"{row['tokens_per_s']:.0f}"}
                    if all_layers:
                        post.update(aux=f"{row['aux_loss']:.3f}", drop=f"{row['dropped_fraction']:.3f}")
                    if val_loss is not None:
                        post["val"] = f"{val_loss:.3f}"
                    bar.set_postfix(post, refresh=False)
                acc = fresh()
            guard.check(lr)  # after train.max_bad_steps skipped steps in a row: NonFiniteError, on every rank
            if save_now:
                ckpts.save(
                    done,
                    finite_or_none(
                        {
                            "logged_losses": logged_losses,
                            "val_history": val_history,
                            "val_loss": val_loss,
                            "wandb_id": tracker.run_id,
                            "bad_streak": guard.streak,
                        }
                    ),
                    OmegaConf.to_yaml(cfg, resolve=True),
                )
            if stop:
                status = "preempted"
                break
    except BaseException:
        bar.close()
        metrics.close()
        ckpts.close()
        if rank0:
            tracker.finish(failed=True)
        raise
    bar.close()
    metrics.close()
    ckpts.close()
    wall = time.perf_counter() - t_start
    summary = {
        "status": status,  # or "preempted": stopped by SIGTERM/SIGUSR1 (or submitit's signal) after step "last_step", saved there
        "last_step": done,
        "resumed_from_step": start if resumed else None,
        "final_val_loss": val_loss,
        "unigram_entropy": unigram,
        "val_history": val_history,
        "train_losses": logged_losses,
        "steps": tcfg.steps,
        "tokens": tcfg.steps * tokens_per_step,
        "params_total": params["total"],
        "params_active": params["active"],
        "moe_layers": len(all_layers),
        "skipped_steps": engine.skipped_steps,
        "time_s": wall,
        "tokens_per_s": (done - start) * tokens_per_step / wall,  # of the steps this run trained
        "overrides": hydra_job_info().get("overrides", []),
        "layout": {"world": layout.world, "rank": layout.rank, "dp": layout.dp, "ep": layout.ep, "pp": layout.pp},
    }
    if rank0:
        tracker.finish(summary)
        if run_dir is not None:
            (run_dir / "summary.json").write_text(to_json(summary, indent=1))
        if status == "preempted":
            where = (
                f"checkpoint {ckpts.ckpt.last_saved}"
                if ckpts.ckpt.last_saved is not None
                else "no checkpoint (train.checkpoint.every=0 or no dir)"
            )
            print(
                f"preempted after step {done} of {tcfg.steps}: {where}; launch again with the same checkpoint dir "
                f"(train.resume=auto) to continue",
                flush=True,
            )
        elif val_loss is not None:
            print(
                f"done: {tcfg.steps} steps, {summary['tokens']:,} tokens in {wall:.0f} s ({summary['tokens_per_s']:.0f} tokens/s)\n"
                f"final val loss {val_loss:.4f} nats/token vs byte-unigram baseline {unigram:.4f} (val-set entropy); "
                f"{val_loss / math.log(2):.3f} vs {unigram / math.log(2):.3f} bits",
                flush=True,
            )
    if keep_weights:  # after summary.json: tensors are not JSON
        summary["weights"] = engine.full_parameters()  # a collective: every rank calls it
    if status == "preempted":  # last: the signal's previous Python handler (submitit's requeue) may exit
        ckpts.hand_over()
    return summary


@hydra.main(config_path="../../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    summary = train(cfg, run_dir=HydraConfig.get().runtime.output_dir)
    return summary["final_val_loss"]  # what a Hydra sweeper (e.g. Optuna) minimises


if __name__ == "__main__":
    main()
