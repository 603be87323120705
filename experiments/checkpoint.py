"""The trainer's checkpoints from the command line: consolidate, export to transformers, verify.

    python -m experiments.checkpoint consolidate <checkpoint> <out>   # -> <out>/model.safetensors (+ config)
    python -m experiments.checkpoint export-hf <checkpoint> <out> [--dtype bf16] [--max-shard-bytes N]
                                                                      # -> a transformers directory of its family
    python -m experiments.checkpoint verify <checkpoint>              # every file against its manifest

``<checkpoint>``: one checkpoint (``step_<N>``) or a directory of them (its newest complete one). The
work is ``experiments.training.export``'s; the format is ``zero.checkpoint``'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from experiments.training.checkpointing import is_checkpoint
from experiments.training.export import CheckpointTensors, consolidate, export_hf
from moe.hf.safetensors_io import DEFAULT_SHARD_BYTES
from zero import checkpoint as zc

# CheckpointTensors: the reader the commands use, reachable here for whoever wraps or patches it
__all__ = ["CheckpointTensors", "consolidate", "export_hf", "main"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _resolve(path: Path) -> Path | None:
    """A checkpoint directory, or the newest complete one under a directory of them (None: none)."""
    return path if is_checkpoint(path) else zc.latest_complete(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.checkpoint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    where = "a checkpoint directory (step_<N>), or a directory of them (its newest complete)"
    c = sub.add_parser("consolidate", help="one model.safetensors (+ config) with full weights, from any layout")
    c.add_argument("checkpoint", help=where)
    c.add_argument("out", help="output directory")
    x = sub.add_parser(
        "export-hf",
        help="a transformers checkpoint directory of the model's family (config.json + safetensors), from any layout",
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
            target, family = export_hf(
                found, args.out, dtype=_DTYPES.get(args.dtype), max_shard_bytes=args.max_shard_bytes
            )
            size = sum(p.stat().st_size for p in target.glob("*.safetensors"))
            print(f"wrote a transformers {family} checkpoint to {target} ({size:,} bytes of weights) from {found}")
    except (ValueError, FileExistsError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
