"""The training loop: ``Trainer`` and ``train(cfg)``, which ``python -m experiments.train`` runs.

The configured ``train.batch_size`` is the GLOBAL batch of one optimizer step. A layout with dp
data-parallel ranks gives each rank ``batch_size / dp`` rows of that same global batch (see
``experiments.training.data``), split into ``grad_accum`` micro-batches; each micro-batch loss is
divided by ``grad_accum`` and the gradients are averaged over dp by the ``zero.ZeroEngine`` that
drives every ``parallel.zero_stage``, 0 included, so every layout and accumulation setting trains
the same thing as one process on the whole batch.

A ``Trainer`` is built from the config (``__init__``: check, layout, data, model, engine,
checkpoints, tracking) and ``run()`` loops over the steps: ``train_step`` (``forward_backward_step``
then the engine's step), ``validate``, a log row (``log_row`` then ``publish``), ``save``; at the end
``summary`` and ``report``. Every row also carries ``comm_bytes_intra`` and ``comm_bytes_inter``:
the bytes one rank's engine sent per optimizer step, by link tier (``zero.comm``), averaged over the
world's ranks; evaluation and checkpoint loading run under ``engine.comm.aside()`` and are not in
them, nor is the model's own traffic (the MoE All-to-All, the pipeline's point-to-point).

Shapes follow the project's legend (docs/design.md): B sequences, L
sequence length, V vocabulary, M the MoE layers of the whole model, E the experts of one layer.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

import moe
import zero
from experiments.training.build import (
    build_engine,
    build_layout,
    build_model,
    build_plan,
    device_of,
    precision_context,
    split_model,
)
from experiments.training.checkpointing import TrainCheckpoints
from experiments.training.checks import check_config
from experiments.training.data import LMData, build_data
from experiments.training.evaluate import lm_loss, validation
from experiments.training.hf_init import resolve_init_from
from experiments.training.nonfinite import StepGuard
from experiments.training.optim import lr_at
from experiments.training.peak_memory import PeakMemory
from experiments.training.preflight import held_layout_keys, plan_before_build, world_size
from experiments.training.stats import MoEStatSums, RowSums, all_reduce_, sum_over_stages
from experiments.training.tokenized import fit_model_vocab
from experiments.training.tracking import MetricsFile, finite_or_none, hydra_job_info, make_tracker, to_json
from zero.pipeline import Pipeline


class Trainer:
    """One training run of ``cfg``; see ``train`` for the arguments. Building it checks the config,
    builds every part and loads the checkpoint ``train.resume`` asks for; ``run()`` trains."""

    def __init__(
        self,
        cfg: DictConfig,
        run_dir: str | Path | None = None,
        layout: zero.Layout | None = None,
        data: LMData | None = None,
    ):
        cfg = resolve_init_from(cfg)  # model.init_from: the checkpoint's architecture (config.json only)
        # parallel=auto picks the layout, and the preflight checks its memory, before anything is
        # allocated or any collective runs (from the world size alone: every rank the same)
        world = layout.world if layout is not None else world_size()
        self.plan_info = plan_before_build(cfg, world, held_layout_keys() if cfg.parallel.auto else None)
        plan = build_plan(cfg)  # a bad pipeline config stops here, before any process group
        layout = layout or build_layout(cfg.parallel, cfg.moe.num_experts if cfg.model.moe_every else None)
        check_config(cfg, layout, plan)
        zero.check_same_on_all_ranks(OmegaConf.to_yaml(cfg, resolve=True), "config")  # before any other collective
        self.cfg, self.tcfg, self.plan, self.layout = cfg, cfg.train, plan, layout
        self.rank0 = layout.rank == 0
        self.device = device = device_of(cfg)
        self.run_dir = run_dir = Path(run_dir) if run_dir is not None else None
        if run_dir is not None and self.rank0:
            run_dir.mkdir(parents=True, exist_ok=True)

        data = build_data(cfg.data, seed=cfg.seed) if data is None else dataclasses.replace(data, seed=cfg.seed)
        fit_model_vocab(cfg, data)  # a tokenizer's vocabulary, padded, unless model.init_from fixes it
        self.documents = bool(cfg.data.document_mask)
        if self.documents:  # data without document boundaries stops here, naming itself
            for part in getattr(data, "parts", [data]):
                part.doc_offsets("val")
        if data.vocab_size > cfg.model.vocab_size:
            raise ValueError(f"data vocabulary {data.vocab_size} exceeds model.vocab_size={cfg.model.vocab_size}")
        self.data = data
        # this rank's peak of tensor memory from here (the corpus is not counted): summary.json
        self.memory = PeakMemory(device, int(cfg.train.memory_steps)).start()
        torch.manual_seed(cfg.seed)  # same initial weights on every rank and every rerun
        random.seed(cfg.seed)  # and Python's generator (checkpoints carry its state) for code that uses it
        model = build_model(cfg, layout, plan).to(device)
        model.train()
        if self.tcfg.compile:
            if plan is not None and plan.splits_backward:
                # a zero-bubble schedule runs each block's backward in two passes over one graph (the
                # input gradients with retain_graph=True, then the weight gradients); AOTAutograd's
                # donated buffers (saved tensors its backward frees) allow one pass. torch reads the
                # flag when a graph compiles and at every backward, so it is off for the process
                from torch._functorch import config as functorch_config

                functorch_config.donated_buffer = False
            model.compile_blocks()
        self.params = model.param_counts()
        all_layers = model.moe_layers()  # of the whole model; a pipeline rank runs some of them
        layer_index = {layer: i for i, layer in enumerate(all_layers)}
        # non-finite steps: skip, count, stop; it names every MoE layer of the whole model, and every
        # rank hands the engine the same flags (the layers of other stages count as finite)
        self.guard = StepGuard(model, int(self.tcfg.max_bad_steps), layout.world)
        self.pipe = None
        if plan is not None:
            model, chunks = split_model(model, plan, layout)  # the other stages' layers are dropped here
            self.engine = build_engine(cfg, model, layout, chunks)
            self.pipe = Pipeline(chunks, plan, layout, self.engine, loss_fn=lm_loss, device=device)
        else:
            self.engine = build_engine(cfg, model, layout)
        self.model = model
        self.unigram = data.unigram_entropy("val")
        self.ckpts = TrainCheckpoints(cfg, self.engine, layout, run_dir)
        try:
            self._prepare_run(all_layers, layer_index)
        except BaseException:  # the signal handlers and the checkpoint thread are not left behind
            self.ckpts.close()
            self.memory.close()
            raise
        if self.rank0:
            self._describe()

    def _prepare_run(self, all_layers: list, layer_index: dict) -> None:
        """What the loop starts from: the checkpoint's state, the tracker and metrics.jsonl, the MoE
        statistics hooks, and the step's constants (micro-batches, forwards, tokens)."""
        cfg, tcfg, layout, device = self.cfg, self.tcfg, self.layout, self.device
        # weights, optimizer, buffers and RNG are loaded; the loop's own state comes back here. A load
        # re-gathers the weights (stages 1-2): no part of the first step's comm_bytes
        with self.engine.comm.aside():
            self.resumed = self.ckpts.resume() or {}
        self.start = self.resumed.get("step", 0)
        if self.start > tcfg.steps:  # every rank loaded the same step: every rank stops here, no collective
            raise ValueError(
                f"train.resume: the checkpoint is at step {self.start}, past train.steps={tcfg.steps}: raise "
                f"train.steps above {self.start} to train on from it, or resume from an earlier checkpoint"
            )
        # skipped steps in a row up to the checkpoint
        self.guard.streak = [tuple(s) for s in self.resumed.get("bad_streak", [])]
        self.tracker = make_tracker(
            cfg,
            self.run_dir if self.run_dir is not None else Path("."),
            layout.rank,
            run_id=self.resumed.get("wandb_id"),
        )
        self.metrics = MetricsFile(
            self.run_dir / "metrics.jsonl" if self.run_dir is not None and self.rank0 else None,
            keep_until=self.start if self.resumed else None,
        )
        self.num_moe_layers = len(all_layers)
        self.stats = MoEStatSums(
            {m: layer_index[m] for m in self.model.moe_layers()},
            self.num_moe_layers,
            all_layers[0].cfg.num_experts if all_layers else 0,
            device,
        )
        self.accum = tcfg.grad_accum
        self.micro = tcfg.batch_size // layout.dp // self.accum
        self.forwards = self.accum * (self.plan.microbatches if self.plan is not None else 1)  # of each layer per step
        self.tokens_per_step = tcfg.batch_size * tcfg.seq_len  # global
        # each micro-batch's loss is divided by the micro-batches of the step; the aux losses' gradients
        # must shrink alike
        moe.scale_aux_losses(self.model, 1.0 / self.forwards)
        if self.pipe is not None:
            self.pipe.loss_scale = 1.0 / self.forwards
        self.logged_losses = self.resumed.get("logged_losses", [])
        self.val_loss = self.resumed.get("val_loss")
        self.val_metrics = self.resumed.get("val_metrics", {})
        self.val_history = [tuple(v) for v in self.resumed.get("val_history", [])]

    def _describe(self) -> None:
        params, layout, plan, data = self.params, self.layout, self.plan, self.data
        print(
            f"model: {params['total']:,} parameters, {params['active']:,} active per token; "
            f"{self.num_moe_layers} MoE of {self.cfg.model.n_layers} blocks; layout: {layout.describe()}; "
            f"device {self.device}",
            flush=True,
        )
        if plan is not None:
            print(f"pipeline: {plan.describe()}", flush=True)
        print(f"data: {data.name} {data.info}; train {len(data.train):,} / val {len(data.val):,} tokens", flush=True)

    # ----- one step --------------------------------------------------------------------------------
    def forward_backward_step(
        self, x_BL: torch.Tensor, y_BL: torch.Tensor, doc_BL: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward and backward of this rank's rows of one step, micro-batch by micro-batch; the
        gradients are left for the engine, reduced once (after the last micro-batch). ``doc_BL``:
        each token's document (``data.document_mask``), into every forward, every pipeline stage
        included. Returns the step's mean loss on this rank (zero on pipeline stages but the last)."""
        cfg, device, engine, pipe, accum, micro = self.cfg, self.device, self.engine, self.pipe, self.accum, self.micro
        loss_step = torch.zeros((), device=device)
        for m in range(accum):
            x, y = x_BL[m * micro : (m + 1) * micro].to(device), y_BL[m * micro : (m + 1) * micro].to(device)
            kw = {} if doc_BL is None else {"doc_ids": doc_BL[m * micro : (m + 1) * micro].to(device)}
            if pipe is not None:
                # the schedule splits the rows into the plan's micro-batches; the engine
                # reduces after the last backward of the last round
                with precision_context(cfg, device):
                    losses = pipe.step(
                        x if pipe.is_first else None, y if pipe.is_last else None, reduce=m == accum - 1, **kw
                    )
                loss_step += sum(losses, torch.zeros((), device=device)) / self.forwards
                continue
            # micro-batches before the last only accumulate locally: one reduction per step
            quiet = engine.no_sync() if m < accum - 1 else nullcontext()
            with quiet:
                with precision_context(cfg, device):
                    logits_BLV = self.model(x, **kw)
                loss = lm_loss(logits_BLV, y)
                # the backward needs the loss's log-probabilities, not the logits: held here, they
                # would stay alive through the whole backward (batch x seq x vocab)
                del logits_BLV
                (loss / accum).backward()
            loss_step += loss.detach() / accum
        return loss_step

    def train_step(self, step: int) -> float:
        """Optimizer step ``step`` (counted from 0) on its global batch, added to the row's sums
        unless skipped for a non-finite value; returns its learning rate."""
        tcfg, layout, stats = self.tcfg, self.layout, self.stats
        lr = lr_at(step, self.cfg.optim, tcfg.steps)
        self.engine.lr = lr
        # each of the step's micro-batches is spread over the dp ranks as in one process
        batch = self.data.get_batch(
            "train", step, tcfg.batch_size, tcfg.seq_len, layout.dp_rank, layout.dp, self.forwards, self.documents
        )
        stats.reset()  # this step's MoE statistics, of the layers this rank runs
        loss_step = self.forward_backward_step(*batch)
        # reduce, clip, the optimizer on this rank's shards; the norm before clipping. A loss,
        # aux loss or gradient norm that is non-finite on any rank skips the step on every rank
        # (the loss is the last stage's; other stages hand a zero)
        finite = self.guard.flags(loss_step, stats.aux_M / self.forwards, stats.z_M / self.forwards)
        # the preemption flag rides in the same all-reduce (run() reads it after the step)
        norm = self.engine.step(extra_finite=finite, extra_sums=self.ckpts.stop_flag())
        gnorm = torch.as_tensor(norm, dtype=torch.float32, device=self.device)
        self.memory.step_done()
        self.sums.steps_run += 1
        self.sums.add_comm(self.engine.comm_bytes())  # a skipped step moved its bytes too
        if self.guard.update(self.engine, step + 1):
            self.guard.discard_load(self.model)
        else:
            moe.update_expert_biases(self.model)  # aux-loss-free balancing; a no-op unless moe.expert_bias
            self.sums.add(loss_step, gnorm, stats)
        return lr

    # ----- validation, log rows, checkpoints -------------------------------------------------------
    def validate(self, done: int) -> float:
        """The validation loss after step ``done``, kept in the history; its time is left out of the
        row's throughput."""
        t_eval = time.perf_counter()
        with self.engine.comm.aside():  # stage 3 gathers for it: no part of an optimizer step's bytes
            self.val_metrics = validation(self.model, self.data, self.cfg, self.layout, self.device, self.pipe)
        self.val_loss = self.val_metrics["val_loss"]
        self.val_history.append((done, self.val_loss))
        self.sums.eval_s += time.perf_counter() - t_eval
        return self.val_loss

    def log_row(self, done: int, lr: float, val_loss: float | None) -> dict:
        """The metrics.jsonl row of step ``done``: means over the steps taken since the last row
        (NaN when every one was skipped: null in metrics.jsonl); skipped steps are counted from the
        start of the run. Every rank computes it (its sums are collectives)."""
        sums, layout, M = self.sums, self.layout, self.num_moe_layers
        n = sums.n
        mean = lambda total: total / n if n else math.nan  # noqa: E731
        loss_mean = mean(all_reduce_(sums.loss.clone().reshape(1), layout).item() / layout.dp)
        elapsed = time.perf_counter() - sums.t - sums.eval_s
        row = {
            "step": done,
            "loss": loss_mean,
            "lr": lr,
            "tokens_per_s": sums.steps_run * self.tokens_per_step / max(elapsed, 1e-9),
            "grad_norm": mean(sums.gnorm.item()),
            "skipped_steps": self.engine.skipped_steps,
            **self.comm_per_step(),
        }
        if M:
            E = self.stats.num_experts
            load_ME, aux_M, drop_M = sum_over_stages([sums.load_ME, sums.aux_M, sums.drop_M], layout)
            row["aux_loss"] = mean(aux_M.sum().item() / M / self.forwards)
            row["dropped_fraction"] = mean(drop_M.sum().item() / M / self.forwards)
            load = [[int(c) for c in e] for e in load_ME.view(M, E).tolist()]
            row["load_max_over_mean"] = sum(max(e) / max(sum(e) / len(e), 1e-9) for e in load) / len(load)
            row["expert_load"] = load
        if val_loss is not None:
            row.update(self.val_metrics)  # val_loss, and bits per byte and per-source values where known
        self.logged_losses.append(loss_mean)
        return row

    def comm_per_step(self) -> dict:
        """``comm_bytes_intra`` and ``comm_bytes_inter``: the bytes one rank sent per optimizer step
        over the steps since the last row (skipped ones included), by link tier, as the engine's
        ``zero.comm`` counts them, averaged over every rank of the world (pipeline stages hold
        different layers; dp ranks of a stage send alike). An integer when the mean is one."""
        sent = torch.tensor([self.sums.comm_intra, self.sums.comm_inter], dtype=torch.int64, device=self.device)
        all_reduce_(sent, self.layout)
        per = self.layout.world * max(self.sums.steps_run, 1)
        out = {}
        for key, total in zip(("comm_bytes_intra", "comm_bytes_inter"), sent.tolist()):
            out[key] = total // per if total % per == 0 else total / per
        return out

    def publish(self, row: dict, bar: tqdm) -> None:
        """Rank 0: the row into metrics.jsonl, the tracker and the progress bar."""
        done, moe_layers = row["step"], self.num_moe_layers > 0
        self.metrics.write(row)
        self.tracker.log(row, done)
        if moe_layers:
            self.tracker.log_expert_load(row["expert_load"], done)
        post = {"loss": f"{row['loss']:.3f}", "tok/s": f"{row['tokens_per_s']:.0f}"}
        if moe_layers:
            post.update(aux=f"{row['aux_loss']:.3f}", drop=f"{row['dropped_fraction']:.3f}")
        if self.val_loss is not None:
            post["val"] = f"{self.val_loss:.3f}"
        bar.set_postfix(post, refresh=False)

    def save(self, done: int) -> None:
        """A checkpoint after step ``done`` with the loop's own state and the resolved config."""
        state = {
            "logged_losses": self.logged_losses,
            "val_history": self.val_history,
            "val_loss": self.val_loss,
            "val_metrics": self.val_metrics,
            "wandb_id": self.tracker.run_id,
            "bad_streak": self.guard.streak,
        }
        self.ckpts.save(done, finite_or_none(state), OmegaConf.to_yaml(self.cfg, resolve=True))

    def _new_sums(self) -> RowSums:
        return RowSums(self.num_moe_layers, self.stats.num_experts, self.device)

    # ----- the run ---------------------------------------------------------------------------------
    def run(self, keep_weights: bool = False) -> dict:
        """Train from the resumed step to ``train.steps`` (or to a preemption); returns the summary."""
        tcfg = self.tcfg
        self.sums = self._new_sums()
        status, done = "completed", self.start
        t_start = time.perf_counter()
        bar = tqdm(
            total=tcfg.steps,
            initial=self.start,
            disable=not (self.rank0 and tcfg.progress),
            dynamic_ncols=True,
            file=sys.stderr,
        )
        try:
            for step in range(self.start, tcfg.steps):
                lr = self.train_step(step)
                done = step + 1
                bar.update(1)

                last = done == tcfg.steps
                # SIGTERM/SIGUSR1 on any rank by this step's norm all-reduce: every rank saves and stops here
                stop = self.ckpts.stop_requested(self.engine.last_extra_sums[0])
                # a checkpoint step is a log step: nothing half-summed is lost
                save_now = self.ckpts.due(done, last) or stop
                row_val = self.validate(done) if done % tcfg.eval_every == 0 or last else None
                if done % tcfg.log_every == 0 or last or row_val is not None or self.guard.stopping or save_now:
                    row = self.log_row(done, lr, row_val)
                    if self.rank0:
                        self.publish(row, bar)
                    self.sums = self._new_sums()
                self.guard.check(lr)  # after train.max_bad_steps skipped steps in a row: NonFiniteError, on every rank
                if save_now:
                    self.save(done)
                if stop:
                    status = "preempted"
                    break
        except BaseException:
            bar.close()
            self.metrics.close()
            self.ckpts.close()
            self.memory.close()
            if self.rank0:
                self.tracker.finish(failed=True)
            raise
        bar.close()
        self.metrics.close()
        self.ckpts.close()
        summary = self.summary(status, done, time.perf_counter() - t_start)
        if self.rank0:
            self.report(summary)
        if keep_weights:  # after summary.json: tensors are not JSON
            summary["weights"] = self.engine.full_parameters()  # a collective: every rank calls it
        if status == "preempted":  # last: the signal's previous Python handler (submitit's requeue) may exit
            self.ckpts.hand_over()
        return summary

    def summary(self, status: str, done: int, wall: float) -> dict:
        """What summary.json holds after a run that stopped after step ``done``, ``wall`` s in."""
        tcfg, layout = self.tcfg, self.layout
        return {
            # or "preempted": stopped by SIGTERM/SIGUSR1 (or submitit's signal) after step "last_step", saved there
            "status": status,
            "last_step": done,
            "resumed_from_step": self.start if self.resumed else None,
            "final_val_loss": self.val_loss,
            "final_val": self.val_metrics,  # val_loss, val_bpb, and per source for a mixture
            "unigram_entropy": self.unigram,
            "val_history": self.val_history,
            "train_losses": self.logged_losses,
            "steps": tcfg.steps,
            "tokens": tcfg.steps * self.tokens_per_step,
            "params_total": self.params["total"],
            "params_active": self.params["active"],
            "moe_layers": self.num_moe_layers,
            "skipped_steps": self.engine.skipped_steps,
            "time_s": wall,
            # of the steps this launch trained; null for a launch that resumed a finished run
            "tokens_per_s": (done - self.start) * self.tokens_per_step / wall if done > self.start else None,
            "overrides": hydra_job_info().get("overrides", []),
            "layout": {"world": layout.world, "rank": layout.rank, "dp": layout.dp, "ep": layout.ep, "pp": layout.pp},
            "plan": self.plan_info,  # parallel=auto's pick and the preflight's prediction (null: neither ran)
            "memory": self._memory_summary(),
        }

    def _memory_summary(self) -> dict:
        """Every rank's measured peak of tensor bytes (``peak_memory``; a collective: every rank
        calls it), beside the predicted peak of the busiest rank."""
        layout, mine = self.layout, self.memory.peak()
        peaks = torch.zeros(layout.world, dtype=torch.float64, device=self.device)
        peaks[layout.rank] = -1.0 if mine is None else float(mine)
        all_reduce_(peaks, layout)
        measured = [None if v < 0 else int(v) for v in peaks.tolist()]
        predicted = None
        if self.plan_info:  # on the CPU the offloaded optimizer state is in the same memory
            predicted = self.plan_info["predicted_peak_bytes"]
            predicted += self.plan_info["predicted_host_bytes"] if self.device.type != "cuda" else 0.0
        return {
            "measured_peak_bytes": measured,  # by rank
            "method": self.memory.method,
            "predicted_peak_bytes": predicted,  # the busiest rank's (+ its offloaded state on the CPU)
            "measured_over_predicted": (max(measured) / predicted if predicted and None not in measured else None),
        }

    def report(self, summary: dict) -> None:
        """Rank 0: the summary to the tracker and summary.json, and the closing lines. A launch that
        resumed a finished run (train.resume=auto again: a requeue, a repeated command) trained
        nothing: the run's summary.json and its tracker summary are kept as the run wrote them."""
        steps, done, val_loss, unigram = self.tcfg.steps, summary["last_step"], self.val_loss, self.unigram
        path = self.run_dir / "summary.json" if self.run_dir is not None else None
        if done == self.start and self.resumed:
            kept = path is not None and path.exists()
            self.tracker.finish()
            if path is not None and not kept:
                path.write_text(to_json(summary, indent=1))
            print(
                f"nothing to train: the checkpoint is at step {done}, train.steps={steps}"
                + (f"; {path} kept as the run wrote it" if kept else "")
                + " (raise train.steps to train on)",
                flush=True,
            )
            return
        self.tracker.finish(summary)
        if path is not None:
            path.write_text(to_json(summary, indent=1))
        if summary["status"] == "preempted":
            saved = self.ckpts.ckpt.last_saved
            where = f"checkpoint {saved}" if saved is not None else "no checkpoint (train.checkpoint.every=0 or no dir)"
            print(
                f"preempted after step {done} of {steps}: {where}; launch again with the same checkpoint dir "
                f"(train.resume=auto) to continue",
                flush=True,
            )
        elif val_loss is not None:
            wall = summary["time_s"]
            print(
                f"done: {steps} steps, {summary['tokens']:,} tokens in {wall:.0f} s "
                f"({summary['tokens_per_s']:.0f} tokens/s)\n"
                f"final val loss {val_loss:.4f} nats/token vs byte-unigram baseline {unigram:.4f} (val-set entropy); "
                f"{val_loss / math.log(2):.3f} vs {unigram / math.log(2):.3f} bits"
                + (f"; {self.val_metrics['val_bpb']:.4f} bits per byte" if "val_bpb" in self.val_metrics else ""),
                flush=True,
            )


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
    return Trainer(cfg, run_dir, layout, data).run(keep_weights=keep_weights)
