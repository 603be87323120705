"""The language-modelling loss, and the validation pass that measures it on held-out windows.
Shapes follow the project's legend (docs/design.md): B sequences, L sequence length, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf
from omegaconf import DictConfig

import zero
from experiments.training.build import precision_context
from experiments.training.data import LMData
from experiments.training.stats import all_reduce_
from moe.model import Transformer
from zero.pipeline import Pipeline


def lm_loss(logits_BLV: torch.Tensor, y_BL: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of next-token logits against the targets, in fp32 whatever the autocast."""
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
    documents = bool(cfg.data.get("document_mask", False))
    sum_count = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(tcfg.eval_batches):
        batch = data.get_batch("val", i, tcfg.batch_size, tcfg.seq_len, layout.dp_rank, layout.dp, forwards, documents)
        x_BL, y_BL = batch[:2]
        for a in range(0, x_BL.shape[0], micro):  # micro-batch sized chunks bound the memory
            x, y = x_BL[a : a + micro].to(device), y_BL[a : a + micro].to(device)
            kw = {"doc_ids": batch[2][a : a + micro].to(device)} if documents else {}
            with precision_context(cfg, device):
                if pipe is None:
                    loss_sum = lm_loss(model(x, **kw), y, "sum")
                else:  # equal micro-batches: each one's mean loss times its tokens
                    losses = pipe.eval(x if pipe.is_first else None, y if pipe.is_last else None, **kw)
                    loss_sum = sum(losses, torch.zeros((), device=device)) * (y.numel() / pipe.plan.microbatches)
            count = float(y.numel()) if pipe is None or pipe.is_last else 0.0
            sum_count += torch.stack([loss_sum.double(), torch.tensor(count, dtype=torch.float64, device=device)])
    all_reduce_(sum_count, layout)
    for mod in modules:
        mod.train(was_training)
    return (sum_count[0] / sum_count[1]).item()


def validation(model, data, cfg: DictConfig, layout: zero.Layout, device: torch.device, pipe=None) -> dict:
    """``val_loss`` (nats per token) and, where the data knows its text bytes, ``val_bpb`` (bits per
    byte: nats per token x tokens per byte / ln 2, comparable across tokenizers); for a mixture
    (``data.sources``) also ``val_loss/<name>`` and ``val_bpb/<name>`` per source, each over
    ``train.eval_batches`` batches of that source alone, and the overall values weighted by the
    mixture's probabilities."""
    parts = getattr(data, "parts", None)
    if parts is None:
        loss = evaluate(model, data, cfg, layout, device, pipe)
        bpt = data.bytes_per_token("val")
        return {"val_loss": loss, **({"val_bpb": loss / bpt / math.log(2)} if bpt else {})}
    out, total, total_bytes = {}, 0.0, 0.0
    for part, name, w in zip(parts, data.names, data.probabilities):
        loss = evaluate(model, part, cfg, layout, device, pipe)
        out[f"val_loss/{name}"] = loss
        total += w * loss
        bpt = part.bytes_per_token("val")
        if bpt:
            out[f"val_bpb/{name}"] = loss / bpt / math.log(2)
        total_bytes = total_bytes + w * bpt if bpt and total_bytes is not None else None
    out = {"val_loss": total, **({"val_bpb": total / total_bytes / math.log(2)} if total_bytes else {}), **out}
    return out
