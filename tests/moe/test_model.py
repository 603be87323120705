"""The reference transformer: causality, MoE placement, parameter accounting, checkpointing."""

from types import SimpleNamespace

import pytest
import torch

from moe import DenseFFN, MoEConfig, MoELayer
from moe.model import Transformer, TransformerConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V, D, F, L = 61, 32, 48, 24  # odd vocabulary and sequence length on purpose


def make(moe_every=1, n_layers=4, E=4, K=2, **kw):
    moe = MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K) if moe_every else None
    cfg = TransformerConfig(
        vocab_size=V, d_model=D, n_layers=n_layers, n_heads=4, d_ff=F, max_seq_len=L, moe_every=moe_every, moe=moe, **kw
    )
    torch.manual_seed(0)
    return Transformer(cfg)


def test_forward_shape_and_causality():
    model = make().eval()
    idx = torch.randint(0, V, (3, L))
    out = model(idx)
    assert out.shape == (3, L, V)
    # changing the future must not change the past (dropless token choice routes each token alone)
    t = 10
    idx2 = idx.clone()
    idx2[:, t + 1 :] = torch.randint(0, V, (3, L - t - 1))
    out2 = model(idx2)
    torch.testing.assert_close(out2[:, : t + 1], out[:, : t + 1], rtol=1e-5, atol=1e-5)  # fp32, same ops
    assert not torch.allclose(out2[:, t + 1 :], out[:, t + 1 :])


def test_positions_matter():
    # without positions, causal attention at the last token sees a SET of earlier tokens; rotary
    # positions make the order of the earlier tokens matter
    model = make(moe_every=0).eval()
    idx = torch.tensor([[3, 5, 8, 13, 21]])
    swapped = torch.tensor([[5, 3, 8, 13, 21]])
    assert not torch.allclose(model(idx)[0, -1], model(swapped)[0, -1], atol=1e-4)


@pytest.mark.parametrize(
    "moe_every,expected",
    [(1, [True] * 4), (2, [False, True, False, True]), (3, [False, False, True, False]), (0, [False] * 4)],
)
def test_moe_placement(moe_every, expected):
    model = make(moe_every=moe_every)
    assert [isinstance(b.ffn, MoELayer) for b in model.blocks] == expected
    assert all(isinstance(b.ffn, DenseFFN) for b, e in zip(model.blocks, expected) if not e)


def test_param_counts():
    dense = make(moe_every=0)
    n_dense = sum(p.numel() for p in dense.parameters())
    assert dense.param_counts()["total"] == dense.param_counts()["active"] == n_dense

    E, K = 4, 2
    model = make(moe_every=2, E=E, K=K)
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * D * F  # w1, w3, w2 of one SwiGLU expert
    counts = model.param_counts()
    assert counts["total"] == total
    assert counts["active"] == total - 2 * (E - K) * per_expert  # 2 MoE blocks of 4

    # Switch comparison: top-1 experts as wide as the dense FFN = dense active params + routers
    switch = make(moe_every=1, E=8, K=1)
    assert switch.param_counts()["active"] == n_dense + 4 * 8 * D


def test_tied_embeddings_counted_once():
    model = make(tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    untied = make(tie_embeddings=False)
    assert untied.param_counts()["total"] - model.param_counts()["total"] == V * D


def test_activation_checkpointing_same_gradients():
    idx = torch.randint(0, V, (2, L))
    grads = []
    for ckpt in (False, True):
        model = make(checkpoint_activations=ckpt)
        loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        # the recomputation in backward must not count router statistics twice
        assert sum(model.blocks[0].ffn.load_since_update) == 2 * L * 2
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)  # fp32 recompute


def test_groups_come_from_layout():
    layout = SimpleNamespace(ep_group=None, dp_group=None, rank=0)
    model = Transformer(make().cfg, layout=layout)
    assert all(m.ep_group is None and m.dp_group is None for m in model.moe_layers())
    with pytest.raises(ValueError, match="either layout or"):
        Transformer(make().cfg, layout=layout, dp_group=object())


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(n_heads=5), "n_heads"),
        (dict(n_heads=32), "n_heads"),  # head dim 1: odd, no rotary pairs
        (dict(moe_every=1, moe=None), "moe"),
        (dict(moe_every=9, moe=MoEConfig(d_model=D, d_ff=F)), "moe_every"),
        (dict(d_model=0), "d_model"),
    ],
)
def test_config_errors_name_the_key(kw, name):
    base = dict(vocab_size=V, d_model=D, n_layers=4, n_heads=4, d_ff=F, max_seq_len=L, moe_every=0, moe=None)
    base.update(kw)
    with pytest.raises(ValueError, match=rf"TransformerConfig\.{name}="):
        TransformerConfig(**base)


def test_unknown_key_and_length():
    with pytest.raises(ValueError, match="d_modle"):
        TransformerConfig.from_dict({"d_modle": 3})
    with pytest.raises(ValueError, match="max_seq_len"):
        make()(torch.zeros(1, L + 1, dtype=torch.long))
