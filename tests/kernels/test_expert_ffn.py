"""``routing_kernels.expert_ffn``, every backend, against the fp64 per-expert loop: outputs and the
gradients of the input, every weight and (tokens mode) the combine weights.

Rows mode is what expert parallelism runs between its exchanges; tokens mode is the local layer.
The CPU backend runs here in two lanes with 3-row blocks, so every expert's rows span several
blocks taken by either lane, and weight gradients accumulate across blocks.
"""

from __future__ import annotations

import pytest
import torch

import routing_kernels as rk
import routing_kernels.dispatch as dispatch
from routing_kernels import reference
from routing_kernels.cpu import forced_schedule

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# relative to the largest reference value: fp32 sums of at most ~100 terms round at ~6e-8 each;
# a wrong row, expert or weight gives an O(1) error
TOL = 2e-5
BACKENDS = ["cpu_blocks", "loop"] + (["grouped_mm"] if hasattr(torch, "_grouped_mm") else [])


def _weights(X, D, F, swiglu, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.rand(*s, generator=g) - 0.5).requires_grad_(True)
    return mk(X, D, F), (mk(X, D, F) if swiglu else None), mk(X, F, D)


def _routing(T, K, X, seed, drop=0.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(X, generator=g)[:K] for _ in range(T)])
    if drop:
        ids[torch.rand(T, K, generator=g) < drop] = -1
    w = torch.rand(T, K, generator=g).requires_grad_(True)
    return ids, w


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    live = [t for t in inputs if t is not None]
    return list(torch.autograd.grad(out, live, g, allow_unused=True, materialize_grads=True))


def _close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if b.numel() == 0:
        return
    err = (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-6)
    assert err <= TOL, f"{what}: relative error {err:.2e} > {TOL}"


@pytest.fixture
def small_blocks_in_lanes():
    # yields the lane count of every pass of the CPU block path
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    with forced_schedule(lanes=2, block_rows=3) as log:
        yield log.lanes
    torch.set_num_threads(n)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts,swiglu", [([5, 0, 7, 1], True), ([9, 4, 0], False), ([0, 0], True), ([13], True)])
def test_rows_mode_matches_reference(backend, counts, swiglu, small_blocks_in_lanes):
    D, F = 12, 8
    x = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    w1, w3, w2 = _weights(len(counts), D, F, swiglu)
    with rk.use_expert_backend(backend):
        assert rk.expert_backend(x, w1, w3, w2) == (backend if sum(counts) or backend != "grouped_mm" else "loop")
        out = rk.expert_ffn(x, counts, w1, w3, w2)
    ref = reference.expert_ffn(x.double(), counts, *(None if w is None else w.double() for w in (w1, w3, w2)))
    _close(out, ref, "output")
    for name, a, b in zip(["x", "w1", "w3", "w2"], _grads(out, [x, w1, w3, w2]), _grads(ref, [x, w1, w3, w2])):
        _close(a, b, f"d {name}")
    if backend == "cpu_blocks" and sum(counts) >= 6:
        assert small_blocks_in_lanes and all(n == 2 for n in small_blocks_in_lanes)


def _tokens_reference(x, ids, w, w1, w3, w2):
    # token by token, in fp64: out[t] = sum_k w[t, k] * ffn_{ids[t, k]}(x[t])
    rows = []
    for t in range(x.shape[0]):
        acc = x[t].double() * 0  # keeps the graph when every slot is dropped
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            h = x[t].double() @ w1[e].double()
            act = (
                torch.nn.functional.silu(h) * (x[t].double() @ w3[e].double())
                if w3 is not None
                else torch.nn.functional.gelu(h)
            )
            acc = acc + w[t, k].double() * (act @ w2[e].double())
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "T,K,X,drop,swiglu", [(23, 2, 5, 0.0, True), (17, 3, 4, 0.3, False), (3, 2, 8, 0.0, True), (9, 1, 3, 1.0, True)]
)
def test_tokens_mode_matches_token_by_token(backend, T, K, X, drop, swiglu, small_blocks_in_lanes):
    D, F = 12, 8
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    ids, w = _routing(T, K, X, seed=4, drop=drop)
    w1, w3, w2 = _weights(X, D, F, swiglu, seed=5)
    counts, _, dest = rk.routing_metadata(ids, X)
    with rk.use_expert_backend(backend):
        out = rk.expert_ffn(x, counts.tolist(), w1, w3, w2, dest_TK=dest, weights_TK=w)
    ref = _tokens_reference(x, ids, w, w1, w3, w2)
    _close(out, ref, "output")
    inputs = [x, w, w1, w3, w2]
    for name, a, b in zip(["x", "weights", "w1", "w3", "w2"], _grads(out, inputs), _grads(ref, inputs)):
        _close(a, b, f"d {name}")


def test_dispatch_picks_and_refuses():
    x = torch.randn(6, 4)
    w1, w3, w2 = _weights(2, 4, 3, True)
    assert rk.expert_backend(x, w1, w3, w2) == "cpu_blocks"  # auto on the CPU
    with rk.use_backend("reference"):
        assert rk.expert_backend(x, w1, w3, w2) == "loop"
    with rk.use_expert_backend("grouped_mm"):
        # an operand at an odd offset (a ZeRO flat buffer can hand one out): _grouped_mm refuses it
        odd = torch.randn(6 * 4 + 1)[1:].view(6, 4)
        assert rk.expert_backend(odd, w1, w3, w2) == "loop"
        # rows of 3 fp32 values: a 12-byte stride
        assert rk.expert_backend(x, *_weights(2, 4, 3, True)) == "loop"
        assert rk.expert_backend(x, *_weights(2, 4, 4, True)) == (
            "grouped_mm" if hasattr(torch, "_grouped_mm") else "loop"
        )
    with pytest.raises(ValueError, match="3 segment counts for 2 experts"):
        rk.expert_ffn(x, [2, 2, 2], w1, w3, w2)
    with pytest.raises(ValueError, match="dest_TK and weights_TK go together"):
        rk.expert_ffn(x, [3, 3], w1, w3, w2, dest_TK=torch.zeros(6, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="'gpu' is not one of"):
        rk.set_expert_backend("gpu")
    with pytest.raises(ValueError, match="the counts add up to 7 rows, more than the bound num_rows=6"):
        with rk.use_expert_backend("cpu_blocks"):
            rk.expert_ffn(x, [3, 4], w1, w3, w2)
    # rows past the counts' sum (x sized by a bound) belong to no expert: zeros, on every backend
    for backend in ("cpu_blocks", "loop"):
        with rk.use_expert_backend(backend):
            y = rk.expert_ffn(x, [2, 3], w1, w3, w2)
            assert torch.equal(y[5], torch.zeros(4)) and not torch.equal(y[4], torch.zeros(4))
    assert set(dispatch._EXPERT_IMPLS) == set(dispatch._experts.valid) - {"auto"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens,swiglu", [(True, True), (True, False), (False, True), (False, False)])
def test_split_backward_computes_each_gradient_once(backend, tokens, swiglu, small_blocks_in_lanes, monkeypatch):
    """The zero-bubble schedules' split backward: torch runs the expert node's backward once for
    the inputs' gradients (x, the combine weights) and again for the weights'. Each pass gives the
    reference's gradients, the input pass runs no weight-gradient product and the weight pass
    computes no input gradient (either would be thrown away, then done again by the other pass).
    Rows mode (expert parallelism's, no combine weights) and GELU (no w3) leave inputs out of the
    node's edges, which must not shift the weights' place among them."""
    import routing_kernels.cpu.blocks as blocks

    T, K, X, D, F = 19, 2, 4, 12, 8
    ids, w = _routing(T, K, X, seed=7)
    counts, _, dest = rk.routing_metadata(ids, X)
    rows = T if tokens else T * K  # rows mode: the rows already in expert order
    x = torch.randn(rows, D, generator=torch.Generator().manual_seed(6)).requires_grad_(True)
    w1, w3, w2 = _weights(X, D, F, swiglu, seed=8)
    params = [p for p in (w1, w3, w2) if p is not None]
    products = []
    real = blocks._mm_into
    monkeypatch.setattr(blocks, "_mm_into", lambda *a: (products.append(a), real(*a)))
    with rk.use_expert_backend(backend):
        if tokens:
            out = rk.expert_ffn(x, counts.tolist(), w1, w3, w2, dest_TK=dest, weights_TK=w)
        else:
            out = rk.expert_ffn(x, counts.tolist(), w1, w3, w2)
    inputs = [x, w] if tokens else [x]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    dinputs = torch.autograd.grad(out, inputs, g, retain_graph=True)
    assert not products, f"the input pass ran {len(products)} weight-gradient products"
    calls = []
    real_backward = blocks.blocks_backward
    monkeypatch.setattr(blocks, "blocks_backward", lambda *a, **k: (calls.append(a[12:14]), real_backward(*a, **k))[1])
    dparams = torch.autograd.grad(out, params, g)
    if backend == "cpu_blocks":
        assert calls == [(False, False)], f"the weight pass asked for the inputs' gradients: {calls}"
        assert products, "the weight pass ran no weight-gradient product"
    if tokens:
        ref = _tokens_reference(x, ids, w, w1, w3, w2)
    else:
        ref = reference.expert_ffn(
            x.double(), counts.tolist(), *(None if p is None else p.double() for p in (w1, w3, w2))
        )
    want = torch.autograd.grad(ref, inputs + params, g.double())
    for a, b, name in zip([*dinputs, *dparams], want, ["x", "weights", "w1", "w3", "w2"] if tokens else ["x", *"123"]):
        _close(a, b, f"d {name}")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("swiglu", [True, False])
def test_grouped_mm_saves_the_rows_and_hidden_projections_only(swiglu):
    # what moe.costs charges the GPU's grouped path per row: its input row and the hidden
    # projections (h1, h3), from which the backward recomputes the activation; autograd alone would
    # also keep silu's output and the product (4F a row, not 2F). Exactly: the rows, the hidden
    # projections and the int32 segment ends, weights aside
    counts, D, F = [5, 0, 7, 4], 12, 8
    x = torch.randn(sum(counts), D).requires_grad_(True)
    weights = _weights(len(counts), D, F, swiglu)
    skip = {w.untyped_storage().data_ptr() for w in weights if w is not None}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with rk.use_expert_backend("grouped_mm"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rk.expert_ffn(x, torch.tensor(counts), *weights)
    S, hidden = sum(counts), (2 if swiglu else 1) * F
    assert sum(seen.values()) == 4 * S * (D + hidden) + 4 * len(counts) + S  # and the kept-rows mask (bool)
