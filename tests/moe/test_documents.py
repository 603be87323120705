"""Document masking of the open families' options: a packed sequence computes each document as if
alone (logits and gradients), one document is the causal kernel, pipeline stages and activation
checkpointing take documents (tolerance: tests/moe/architectures.py)."""

from __future__ import annotations

import pytest
import torch

from moe import MoEConfig
from moe.model import Transformer
from tests.moe.architectures import (
    _OURS_DEEPSEEK,
    NO_AUX,
    TOL,
    D,
    V,
    _cfg,
    randomize_,
    rel_err,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# the balancing losses are statistics of the whole batch, so they are off: packing changes the batch
DOC_CASES = {
    "gqa_qknorm_moe": dict(
        n_layers=2,
        n_kv_heads=2,
        head_dim=10,
        qk_norm="head",
        qkv_bias=True,
        moe=MoEConfig(d_model=D, d_ff=8, num_experts=4, top_k=2, **NO_AUX),
    ),
    "mla_yarn_moe": dict(
        _OURS_DEEPSEEK,
        q_lora_rank=10,
        rope_interleave=True,
        rope_scaling="yarn",
        rope_factor=4.0,
        rope_original_max_seq_len=8,
        rope_mscale_all_dim=1.0,
    ),
}


def _doc_model(case):
    torch.manual_seed(0)
    model = Transformer(_cfg(max_seq_len=16, **DOC_CASES[case]))
    randomize_(model, seed=3)
    return model


@pytest.mark.parametrize("case", list(DOC_CASES))
def test_packed_documents_compute_as_if_alone(case):
    model = _doc_model(case)
    torch.manual_seed(2)
    a, b = torch.randint(0, V, (1, 6)), torch.randint(0, V, (1, 9))
    w_a, w_b = torch.randn(1, 6, V), torch.randn(1, 9, V)
    packed = torch.cat([a, b], 1)
    doc_ids = torch.tensor([[3] * 6 + [8] * 9])

    def grads_of(loss_fn):
        model.zero_grad()
        loss_fn().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    out = model(packed, doc_ids=doc_ids)
    alone_a, alone_b = model(a), model(b)
    assert rel_err(out[:, :6], alone_a) <= TOL
    assert rel_err(out[:, 6:], alone_b) <= TOL
    for part, (lo, hi), alone, w in (("A", (0, 6), a, w_a), ("B", (6, 15), b, w_b)):
        g_packed = grads_of(lambda: (model(packed, doc_ids=doc_ids)[:, lo:hi] * w).sum())
        g_alone = grads_of(lambda: (model(alone) * w).sum())
        assert set(g_packed) == set(g_alone), part
        for name in g_alone:
            assert rel_err(g_packed[name], g_alone[name]) <= TOL, (part, name)


def test_one_document_is_the_causal_kernel():
    model = _doc_model("gqa_qknorm_moe")
    idx = torch.randint(0, V, (2, 13))
    same = torch.zeros(2, 13, dtype=torch.long)
    assert rel_err(model(idx, doc_ids=same), model(idx)) <= TOL
    # documents change the answer (positions restart, attention stops)
    docs = torch.tensor([[0] * 5 + [1] * 8, [0] * 13])
    out = model(idx, doc_ids=docs)
    assert rel_err(out[1:], model(idx[1:])) <= TOL
    assert rel_err(out[:1, 5:], model(idx[:1, 5:])) <= TOL
    assert not torch.allclose(out[:1, 5:], model(idx)[:1, 5:], atol=1e-3)


def test_pipeline_stages_take_documents():
    model = _doc_model("mla_yarn_moe")
    idx = torch.randint(0, V, (2, 12))
    docs = torch.tensor([[0] * 4 + [1] * 8, [2] * 7 + [0] * 5])
    n = model.num_pipeline_layers
    first, second = model.pipeline_stage(0, 2), model.pipeline_stage(2, n)
    staged = second(first(idx, doc_ids=docs), doc_ids=docs)
    assert rel_err(staged, model(idx, doc_ids=docs)) <= TOL


def test_doc_ids_shape_is_checked():
    model = _doc_model("gqa_qknorm_moe")
    with pytest.raises(ValueError, match="doc_ids"):
        model(torch.zeros(2, 5, dtype=torch.long), doc_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="doc_ids"):
        model(torch.zeros(2, 5, dtype=torch.long), doc_ids=torch.zeros(2, 5))


def test_checkpointed_blocks_take_documents():
    model = _doc_model("gqa_qknorm_moe")
    idx = torch.randint(0, V, (2, 12))
    docs = torch.tensor([[0] * 4 + [1] * 8, [2] * 7 + [0] * 5])
    grads = []
    for ckpt in (False, True):
        model.cfg.checkpoint_activations = ckpt
        model.zero_grad()
        model(idx, doc_ids=docs).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.cfg.checkpoint_activations = False
    assert all(rel_err(a, b) <= TOL for a, b in zip(grads[1], grads[0]))
