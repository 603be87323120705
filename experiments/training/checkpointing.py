"""Checkpoints in the trainer (``train.checkpoint.*``, ``train.resume``, preemption) and the
consolidation command. The storage format and its guarantees are ``zero.checkpoint``'s.

    python -m experiments.checkpoint consolidate <checkpoint> <out>   # -> <out>/model.safetensors (+ config)
    python -m experiments.checkpoint export-hf <checkpoint> <out> [--dtype bf16] [--max-shard-bytes N]
                                                                      # -> a transformers Mixtral directory

``TrainCheckpoints`` is what ``experiments.train`` calls: ``resume()`` before the loop, ``stop_requested()``
after each step (SIGTERM or SIGUSR1 on any rank, agreed by all), ``due()`` / ``save()``, ``close()``,
and for a preempted run ``hand_over()`` last (submitit's requeue).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

import zero
from moe.hf_mixtral import DEFAULT_SHARD_BYTES, TensorSource, check_exportable, export_mixtral, write_safetensors
from zero import checkpoint as zc

RESUME_CHOICES = ("auto", "none")


def preemption_signals(environ=os.environ) -> tuple[signal.Signals, ...]:
    """SIGTERM and SIGUSR1, and in a submitit job (``SUBMITIT_EXECUTOR`` set) submitit's preemption
    signal too: ``SUBMITIT_PREEMPT_SIGNAL`` without its ``SIG``, USR2 by default, which is what its
    SLURM jobs are sent ``signal_delay_s`` before their time limit (``--signal``)."""
    signals = [signal.SIGTERM, signal.SIGUSR1]
    if environ.get("SUBMITIT_EXECUTOR"):
        name = environ.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2"
        s = getattr(signal, "SIG" + name, None)
        if not isinstance(s, signal.Signals):
            raise ValueError(
                f"SUBMITIT_PREEMPT_SIGNAL={name!r} is not a signal: expected a name without SIG, e.g. USR2, USR1 or TERM"
            )
        if s not in signals:
            signals.append(s)
    return tuple(signals)


class Preemption:
    """SIGTERM and SIGUSR1 (what schedulers send before they stop a job), and submitit's preemption
    signal in a submitit job (``preemption_signals``), set a flag instead of ending the process;
    ``requested()`` is True on every rank once any rank has it (an all-reduce over ``group``, a gloo
    group: a CPU tensor, no device sync). Handlers are installed only in the main thread, and
    ``close()`` puts the previous ones back. The handler that was installed before ours for the
    signal that came is remembered: ``hand_over()``, after the save, runs it when it is a Python
    function (submitit's, which requeues the job)."""

    def __init__(self, group):
        self.group = group
        self.signum: int | None = None
        self._previous = {}
        self._next = None  # the previous handler of the signal that came
        if threading.current_thread() is threading.main_thread():
            for s in preemption_signals():
                self._previous[s] = signal.signal(s, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: stop now, the way the process would have without us
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        self._next = self._previous.get(signum)

    def requested(self) -> bool:
        flag = torch.tensor([0 if self.signum is None else 1], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def hand_over(self) -> None:
        """Once the run has saved and written its summary: the handler that was installed before ours
        for the signal this process received, when it is a Python function, runs now as if the
        signal had just come (after ``close()``, so with the previous handlers back). It may raise
        SystemExit: submitit's checkpoints the job's callable, requeues the job and exits (on its
        rank 0; on other ranks it only logs). SIG_DFL, SIG_IGN, a handler installed outside Python
        or no signal on this rank (another rank's): nothing, and the trainer returns "preempted"."""
        handler, self._next = self._next, None
        if callable(handler):
            name = getattr(handler, "__qualname__", repr(handler))
            print(
                f"handing {signal.Signals(self.signum).name} over to the handler installed before the trainer's "
                f"({getattr(handler, '__module__', '?')}.{name})",
                flush=True,
            )
            handler(self.signum, sys._getframe(0))

    def close(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}


def _checkpoint_or_root(path: Path) -> bool:
    """True if ``path`` is one checkpoint (rather than a directory of them)."""
    return any((path / n).exists() for n in (zc.META, zc.MANIFEST, ".metadata"))


def check_checkpoint_cfg(cfg) -> None:
    """``train.checkpoint.*`` and ``train.resume``, before any collective: errors name the key."""
    c, resume = cfg.train.checkpoint, str(cfg.train.resume)
    if not isinstance(c.every, int) or c.every < 0:
        raise ValueError(f"train.checkpoint.every={c.every!r} is invalid: expected an integer >= 0 (0: no checkpoints)")
    if not isinstance(c.keep_last, int) or c.keep_last < 2:
        raise ValueError(
            f"train.checkpoint.keep_last={c.keep_last!r} is invalid: expected an integer >= 2 (the "
            f"newest checkpoint is complete only once written; an older one must survive meanwhile)"
        )
    if resume not in RESUME_CHOICES and not Path(resume).is_dir():
        raise ValueError(f"train.resume={resume!r} is neither auto, none nor an existing checkpoint directory")
    preemption_signals()  # a bad SUBMITIT_PREEMPT_SIGNAL stops here, before any collective
    if (
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("RANK", "0") == "0"
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ):
        # torchrun shares its rendezvous store with the workers, and a restarted group then reads
        # the previous attempt's addresses and fails to connect (seen with torch 2.13, gloo)
        print(
            "warning: torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment, "
            "or a restarted group fails to connect",
            file=sys.stderr,
            flush=True,
        )


class TrainCheckpoints:
    """The trainer's checkpointing, from ``cfg.train.checkpoint`` and ``cfg.train.resume`` (checked
    by ``check_checkpoint_cfg`` before any collective). On several ranks two gloo groups are created:
    one for DCP (an async save runs its collectives in a background thread) and one for the
    per-step preemption flag."""

    def __init__(self, cfg, engine: zero.ZeroEngine, layout: zero.Layout, run_dir: Path | None):
        check_checkpoint_cfg(cfg)
        c = cfg.train.checkpoint
        self.dir = Path(c.dir) if c.dir else (run_dir / "checkpoints" if run_dir is not None else None)
        self.resume_from = str(cfg.train.resume)
        self.every = int(c.every) if self.dir is not None else 0
        self.layout = layout
        self.rank0 = layout.rank == 0
        multi = layout.world > 1
        self.ckpt = zc.Checkpointer(
            engine,
            self.dir if self.dir is not None else ".",
            keep_last=int(c.keep_last),
            async_save=bool(c.async_save),
            group=zc.new_group() if multi else None,
        )
        self.preemption = Preemption(zc.new_group() if multi else None)
        self.last_saved_step: int | None = None

    def resume(self) -> dict | None:
        """Load the checkpoint ``train.resume`` asks for into the engine (weights, optimizer, buffers,
        RNG); returns the trainer state saved with it (``step``, ``logged_losses``, ...) or None
        for a fresh start."""
        if self.resume_from == "none":
            return None
        if self.resume_from == "auto":
            if self.dir is None:
                return None
            path, check = self.ckpt.latest(), False  # latest() verified it
        else:
            given = Path(self.resume_from)
            path, check = (given, True) if _checkpoint_or_root(given) else (self.ckpt.latest(root=given), False)
            if path is None:
                raise ValueError(f"train.resume={self.resume_from!r} holds no complete checkpoint")
        if path is None:
            return None
        meta = self.ckpt.load(path, check=check)
        self.last_saved_step = int(meta["step"])
        if self.rank0:
            w = meta["layout"]
            print(
                f"resumed from {path} at step {meta['step']} (saved by world={w['world']} pp={w['pp']} dp={w['dp']} "
                f"ep={w['ep']} ZeRO-{w['stage']})",
                flush=True,
            )
        return dict(meta["extra"], step=int(meta["step"]))

    def due(self, done: int, last: bool) -> bool:
        """A periodic save (or the final one) after step ``done``."""
        return self.every > 0 and (done % self.every == 0 or last) and done != self.last_saved_step

    def stop_requested(self) -> bool:
        return self.preemption.requested()

    def save(self, done: int, state: dict, config_yaml: str) -> Path | None:
        """Save after step ``done`` with the trainer's ``state`` (JSON) and the resolved config."""
        if self.every == 0 or done == self.last_saved_step:  # every=0 (or no dir): never, preempted or not
            return None
        path = self.ckpt.save(done, extra=state, files={"config.yaml": config_yaml})
        self.last_saved_step = done
        return path

    def close(self) -> None:
        try:
            self.ckpt.close()
        finally:
            self.preemption.close()

    def hand_over(self) -> None:
        """After a preempted run's save, close() and summary: to the signal's previous handler
        (``Preemption.hand_over``); it may exit the process."""
        self.preemption.hand_over()


# ----- consolidation and export ----------------------------------------------------------------
class CheckpointTensors(TensorSource):
    """The model of a checkpoint (any layout) as named full tensors, read one at a time: every
    parameter in its global shape (``get`` assembles it from the chunks every rank wrote) and every
    saved ``state_dict`` buffer, under the model's names. Shapes and dtypes come from the metadata
    (and the tiny ``shape/`` tensors), so listing them reads no weight. The checkpoint is verified
    against its manifest first (ValueError naming the problem)."""

    def __init__(self, checkpoint: str | Path):
        self.path = Path(checkpoint)
        problem = zc.verify(self.path)
        if problem is not None:
            raise ValueError(f"checkpoint {self.path} is incomplete or corrupt: {problem}")
        saved = zc.SafeReader(self.path).read_metadata().state_dict_metadata
        names = sorted(k[len(zc.PARAM) :] for k in saved if k.startswith(zc.PARAM))
        shapes = {zc.SHAPE + n: torch.empty(saved[zc.SHAPE + n].size, dtype=torch.int64) for n in names}
        zc.read_tensors(self.path, shapes)
        entries = {n: (zc.PARAM + n, torch.Size(shapes[zc.SHAPE + n].tolist())) for n in names}
        entries.update((k[len(zc.BUFFER) :], (k, saved[k].size)) for k in sorted(saved) if k.startswith(zc.BUFFER))
        self._saved = saved
        super().__init__(entries)

    def meta(self, name: str) -> torch.Tensor:
        key, shape = self._state[name]
        return torch.empty(shape, dtype=self._saved[key].properties.dtype, device="meta")

    def _tensor(self, name: str, lo: int | None, hi: int | None) -> torch.Tensor:
        key, shape = self._state[name]
        md = self._saved[key]
        t = torch.empty(md.size, dtype=md.properties.dtype)
        zc.read_tensors(self.path, {key: t})  # a parameter's chunks, from every rank that wrote one
        t = t.view(shape)
        return t if lo is None else t[lo:hi]


def consolidate(checkpoint: str | Path, out: str | Path) -> Path:
    """Write ``<out>/model.safetensors``: every parameter (full, unsharded, in its global shape) and
    every ``state_dict`` buffer of the checkpoint, whatever layout saved it, plus its
    ``config.yaml`` and ``meta.json``. One process, no GPU; one full tensor in memory at a time
    (each is read from its chunks straight into place and written out before the next)."""
    src, out = CheckpointTensors(checkpoint), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = write_safetensors(
        out / "model.safetensors",
        [(n, src.meta(n)) for n in src.keys()],
        ((n, src.get(n)) for n in src.keys()),
        metadata={"format": "pt", "source": str(src.path)},
    )
    for extra in ("config.yaml", zc.META):
        if (src.path / extra).is_file():
            shutil.copyfile(src.path / extra, out / extra)
    return target


def saved_model_config(checkpoint: str | Path):
    """The ``TransformerConfig`` the run that saved ``checkpoint`` trained (its ``config.yaml``)."""
    from omegaconf import OmegaConf

    from experiments.training.loop import model_config  # not at import time: the loop imports this module

    path = Path(checkpoint) / "config.yaml"
    if not path.is_file():
        raise ValueError(
            f"checkpoint {checkpoint} has no config.yaml (the trainer saves the resolved config beside "
            "the shards); without it the model's architecture is unknown"
        )
    return model_config(OmegaConf.load(path))


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write the model of a training checkpoint (any layout) as a transformers Mixtral checkpoint
    directory (``moe.hf_mixtral.export_mixtral``), with the architecture from the checkpoint's
    ``config.yaml``. Reads one parameter at a time (the largest: one layer's ``w1``, ``w3`` or
    ``w2`` over all experts, or the embedding). A config Mixtral cannot compute is a ValueError naming the field."""
    cfg = saved_model_config(checkpoint)
    check_exportable(cfg)  # before reading any tensor
    return export_mixtral(CheckpointTensors(checkpoint), out, cfg, dtype=dtype, max_shard_bytes=max_shard_bytes)


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _resolve(path: Path) -> Path | None:
    """A checkpoint directory, or the newest complete one under a directory of them (None: none)."""
    return path if _checkpoint_or_root(path) else zc.latest_complete(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.checkpoint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    where = "a checkpoint directory (step_<N>), or a directory of them (its newest complete)"
    c = sub.add_parser("consolidate", help="one model.safetensors (+ config) with full weights, from any layout")
    c.add_argument("checkpoint", help=where)
    c.add_argument("out", help="output directory")
    x = sub.add_parser(
        "export-hf", help="a transformers Mixtral checkpoint directory (config.json + safetensors), from any layout"
    )
    x.add_argument("checkpoint", help=where)
    x.add_argument("out", help="output directory (new or empty)")
    x.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="the files' dtype (default: the checkpoint's, fp32)"
    )
    x.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_SHARD_BYTES,
        help="split into model-0000i-of-0000n.safetensors files of at most this size (default 5e9)",
    )
    v = sub.add_parser("verify", help="check every file of a checkpoint against its manifest")
    v.add_argument("checkpoint")
    args = parser.parse_args(argv)
    path = Path(args.checkpoint)
    if args.command == "verify":
        problem = zc.verify(path)
        print(f"{path}: {'complete' if problem is None else problem}")
        return 0 if problem is None else 1
    found = _resolve(path)
    if found is None:
        print(f"error: {path} holds no complete checkpoint", file=sys.stderr)
        return 1
    try:
        if args.command == "consolidate":
            target = consolidate(found, args.out)
            print(f"wrote {target} ({target.stat().st_size:,} bytes) from {found}")
        else:
            target = export_hf(found, args.out, dtype=_DTYPES.get(args.dtype), max_shard_bytes=args.max_shard_bytes)
            size = sum(p.stat().st_size for p in target.glob("*.safetensors"))
            print(f"wrote a transformers Mixtral checkpoint to {target} ({size:,} bytes of weights) from {found}")
    except (ValueError, FileExistsError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
