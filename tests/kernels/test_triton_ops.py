"""Triton routing kernels against their torch references, on the CPU under TRITON_INTERPRET=1.

Shapes follow the project's legend (docs/design.md).

Sizes are tiny on purpose (the interpreter runs every program in numpy) but chosen so every mask is
hit: T and D are not multiples of the block, several tiles per dimension (explicit small blocks),
k = 1 and k > 1, empty experts, dropped assignments (-1), fp32 and bf16.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch


def _set_interpret(value):
    previous = os.environ.get("TRITON_INTERPRET")
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value
    return previous


# Triton picks the interpreter when a function is decorated, which happens for its own library
# functions at `import triton`, and reads the variable again while launching. So it is set around
# the first import and again for the duration of this module's tests (fixture below), and restored
# in between so that it does not leak into other test modules of the same session. If triton was
# imported earlier in this process without it, the interpreter cannot be switched on any more: then
# the tests run in a fresh interpreter process instead (test_in_fresh_process).
_previous = _set_interpret("1")
try:
    triton_ops = importlib.import_module("routing_kernels.triton_ops")
    import triton.language.standard as _tl_standard

    IN_PROCESS = triton_ops.INTERPRETED and type(_tl_standard.sum).__name__ == "InterpretedFunction"
finally:
    _set_interpret(_previous)

import routing_kernels as rk  # noqa: E402
from routing_kernels import reference as ref  # noqa: E402

# Tolerances. Row moves (permute forward) are copies and must be exact. Sums of K rows are
# accumulated in fp32 by the kernels, while the reference rounds in the tensor dtype; and Triton's
# interpreter truncates fp32 -> bf16 where the GPU rounds to nearest (weights and outputs). So bf16
# results may differ by about two bf16 ulps (2^-7 relative); fp32 ones by reassociation only.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    previous = _set_interpret("1")
    yield
    _set_interpret(previous)


@pytest.fixture(autouse=True)
def _triton_backend(request):
    if not IN_PROCESS and request.node.originalname != "test_in_fresh_process":
        pytest.skip("triton was imported earlier without TRITON_INTERPRET=1; test_in_fresh_process runs this")
    torch.manual_seed(0)  # data does not depend on which tests ran before
    with rk.use_backend("triton"):
        yield


def _ids(T, K, E, *, drop=0.0, only=None, seed=0):
    """Top-k expert ids (distinct per token); ``only`` restricts them to some experts (the others are
    empty); a fraction ``drop`` becomes -1."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(only if only is not None else range(E))
    scores = torch.rand(T, len(pool), generator=g)
    ids_TK = pool[scores.topk(K, dim=1).indices]
    ids_TK[torch.rand(T, K, generator=g) < drop] = -1
    return ids_TK


# (T, K, E, drop, only): odd T, k = 1 and k > 1, k = E, a prime E, empty experts, dropped slots,
# a single token, everything dropped
ROUTINGS = [
    (37, 3, 5, 0.2, None),
    (50, 1, 7, 0.0, [1, 4]),
    (19, 4, 4, 0.1, None),
    (1, 2, 13, 0.0, None),
    (23, 2, 11, 0.3, [0, 5, 6, 10]),
    (9, 2, 3, 1.0, None),
]


@pytest.mark.parametrize("T,K,E,drop,only", ROUTINGS)
def test_routing_metadata_bit_identical(T, K, E, drop, only):
    ids_TK = _ids(T, K, E, drop=drop, only=only)
    got = triton_ops.routing_metadata(ids_TK, E)
    want = ref.routing_metadata(ids_TK, E)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_routing_metadata_across_blocks(dtype):
    # small blocks so the per-expert scan crosses blocks (and its own loop over block chunks) and
    # the stable order must hold across block boundaries; all tokens to expert 2 is the worst case
    ids_TK = _ids(61, 3, 6, drop=0.15, only=[0, 2, 3, 5], seed=3).to(dtype)
    ids_TK[40:] = torch.where(ids_TK[40:] >= 0, 2, -1)
    for block_a, block_b in [(16, 4), (16, 2), (32, 16)]:
        got = triton_ops.routing._routing_metadata_launch(ids_TK, 6, block_a=block_a, block_b=block_b)
        for g, w in zip(got, ref.routing_metadata(ids_TK, 6)):
            assert torch.equal(g, w)


def test_routing_metadata_many_experts_and_no_tokens():
    # E = 300 pads to 512 columns and shrinks the assignment block to 16, so 200 assignments span
    # 13 blocks with the default sizes
    ids_TK = _ids(100, 2, 300, drop=0.05, seed=4)
    for g, w in zip(rk.routing_metadata(ids_TK, 300), ref.routing_metadata(ids_TK, 300)):
        assert torch.equal(g, w)
    empty = torch.empty(0, 2, dtype=torch.long)
    for g, w in zip(rk.routing_metadata(empty, 4), ref.routing_metadata(empty, 4)):
        assert torch.equal(g, w)


def _route(T, K, E, drop, only, seed=0):
    _, offsets_E1, dest_TK = ref.routing_metadata(_ids(T, K, E, drop=drop, only=only, seed=seed), E)
    return dest_TK, int(offsets_E1[-1])


# (T, K, E, D, drop, only, blocks): D not a power of two; blocks = (BLOCK_T, BLOCK_D) override the
# launcher's choice so T and D each span several ragged tiles (None: the launcher's own choice)
ROW_CASES = [
    (37, 3, 5, 13, 0.2, None, None),
    (37, 3, 5, 13, 0.2, None, (4, 8)),
    (50, 1, 7, 24, 0.0, [1, 4], (8, 16)),
    (11, 2, 6, 5, 0.4, [0, 3, 5], (2, 4)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,E,D,drop,only,blocks", ROW_CASES)
def test_permute_forward_backward(T, K, E, D, drop, only, blocks, dtype):
    dest_TK, S = _route(T, K, E, drop, only)
    bt, bd = blocks or (None, None)
    x_TD = torch.randn(T, D).to(dtype)
    x_SD = triton_ops.rows._permute_launch(x_TD, dest_TK, S, block_t=bt, block_d=bd)
    assert torch.equal(x_SD, ref.permute(x_TD, dest_TK, S))  # a copy: exact
    # the naive oracle: every kept (t, k) lands on its row
    for t, k in (dest_TK >= 0).nonzero().tolist():
        assert torch.equal(x_SD[dest_TK[t, k]], x_TD[t])
    g_SD = torch.randn(S, D).to(dtype)
    got = triton_ops.rows._permute_bwd_launch(g_SD, dest_TK, T, block_t=bt, block_d=bd)
    x = x_TD.clone().requires_grad_()
    (want,) = torch.autograd.grad(ref.permute(x, dest_TK, S), x, g_SD)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_autograd_through_dispatch(dtype):
    dest_TK, S = _route(29, 2, 5, 0.1, [0, 1, 4])
    x = torch.randn(29, 19).to(dtype).requires_grad_()
    out = rk.permute(x, dest_TK, S)
    assert out.grad_fn._forward_cls is triton_ops.rows._Permute  # the Triton path really ran
    g = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, x, g)
    (want,) = torch.autograd.grad(ref.permute(x, dest_TK, S), x, g)
    torch.testing.assert_close(got, want, **TOL[dtype])


def _naive_combine(y_SD, dest_TK, w_TK):
    out = torch.zeros(dest_TK.shape[0], y_SD.shape[1], dtype=torch.float64)
    for t, k in (dest_TK >= 0).nonzero().tolist():
        out[t] += w_TK[t, k].double() * y_SD[dest_TK[t, k]].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,E,D,drop,only,blocks", ROW_CASES)
def test_unpermute_combine_forward_backward(T, K, E, D, drop, only, blocks, dtype):
    dest_TK, S = _route(T, K, E, drop, only, seed=1)
    bt, bd = blocks or (None, None)
    y_SD = torch.randn(S, D).to(dtype)
    w_TK = torch.rand(T, K).to(dtype)
    out = triton_ops.rows._unpermute_combine_launch(y_SD, dest_TK, w_TK, block_t=bt, block_d=bd)
    torch.testing.assert_close(out, ref.unpermute_combine(y_SD, dest_TK, w_TK), **TOL[dtype])
    torch.testing.assert_close(out.double(), _naive_combine(y_SD, dest_TK, w_TK), **TOL[dtype])

    g_TD = torch.randn(T, D).to(dtype)
    y, w = y_SD.clone().requires_grad_(), w_TK.clone().requires_grad_()
    want_y, want_w = torch.autograd.grad(ref.unpermute_combine(y, dest_TK, w), (y, w), g_TD)
    # block_d below D makes the backward loop over several column tiles with a ragged last one
    got_y, got_w = triton_ops.rows._unpermute_combine_bwd_launch(
        g_TD, y_SD, dest_TK, w_TK, True, True, block_t=bt, block_d=bd
    )
    torch.testing.assert_close(got_y, want_y, **TOL[dtype])
    torch.testing.assert_close(got_w, want_w, **TOL[dtype])
    assert torch.all(got_w[dest_TK < 0] == 0)
    only_w = triton_ops.rows._unpermute_combine_bwd_launch(
        g_TD, y_SD, dest_TK, w_TK, False, True, block_t=bt, block_d=bd
    )
    assert only_w[0] is None and torch.equal(only_w[1], got_w)
    only_y = triton_ops.rows._unpermute_combine_bwd_launch(
        g_TD, y_SD, dest_TK, w_TK, True, False, block_t=bt, block_d=bd
    )
    assert only_y[1] is None and torch.equal(only_y[0], got_y)


@pytest.mark.parametrize("y_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_unpermute_combine_autograd_through_dispatch(y_dtype, w_dtype):
    # fp32 weights with bf16 rows: the kernel, like the reference, rounds the weights to bf16 for the
    # product and returns their gradient in fp32
    dest_TK, S = _route(31, 2, 6, 0.2, None, seed=2)
    y = torch.randn(S, 21).to(y_dtype).requires_grad_()
    w = torch.rand(31, 2, dtype=w_dtype).requires_grad_()
    out = rk.unpermute_combine(y, dest_TK, w)
    assert out.grad_fn._forward_cls is triton_ops.rows._UnpermuteCombine
    want_out = ref.unpermute_combine(y, dest_TK, w)
    torch.testing.assert_close(out, want_out, **TOL[y_dtype])
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (y, w), g)
    want = torch.autograd.grad(want_out, (y, w), g)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **TOL[y_dtype])


def test_permute_then_combine_round_trip():
    # with unit weights and k = 1, combine(permute(x)) is x exactly, forward and backward
    dest_TK, S = _route(27, 1, 4, 0.0, None, seed=5)
    x = torch.randn(27, 10, requires_grad=True)
    out = rk.unpermute_combine(rk.permute(x, dest_TK, S), dest_TK, torch.ones(27, 1))
    assert torch.equal(out, x)
    (gx,) = torch.autograd.grad(out, x, torch.arange(270.0).view(27, 10))
    assert torch.equal(gx, torch.arange(270.0).view(27, 10))


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_moe_layer_through_triton_path(capacity_factor):
    # the whole layer (metadata, permute, experts, combine; with capacity drops: -1 slots) gives the
    # same output and gradients on the Triton path as on the reference path
    from moe import MoEConfig, MoELayer

    cfg = MoEConfig(d_model=12, d_ff=10, num_experts=5, top_k=2, capacity_factor=capacity_factor)
    layer = MoELayer(cfg)
    x = torch.randn(2, 9, 12)
    results = {}
    for backend in ("reference", "triton"):
        with rk.use_backend(backend):
            xb = x.clone().requires_grad_()
            out = layer(xb)
            grads = torch.autograd.grad(out.square().sum(), [xb, *layer.parameters()])
        results[backend] = (out.detach(), grads)
    if capacity_factor is not None:
        assert layer.stats.dropped_fraction > 0  # the dropped path was exercised
    torch.testing.assert_close(results["triton"][0], results["reference"][0], **TOL[torch.float32])
    for a, b in zip(results["triton"][1], results["reference"][1]):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_launchers_reject_bad_inputs():
    dest_TK, S = _route(8, 2, 3, 0.0, None)
    with pytest.raises(ValueError, match="dest_TK"):
        triton_ops.permute(torch.randn(9, 4), dest_TK, S)
    with pytest.raises(ValueError, match="dtype"):
        triton_ops.permute(torch.randn(8, 4).double(), dest_TK, S)
    with pytest.raises(ValueError, match="weights_TK"):
        triton_ops.unpermute_combine(torch.randn(S, 4), dest_TK, torch.rand(8, 3))
    with pytest.raises(ValueError, match="int32 or int64"):
        triton_ops.routing_metadata(torch.zeros(4, 2), 3)
    p = torch.zeros(10)
    with pytest.raises(ValueError, match="float32"):
        triton_ops.fused_adamw(p.bfloat16(), p, p.clone(), p.clone(), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="elements"):
        triton_ops.fused_adamw(p, torch.zeros(11), p.clone(), p.clone(), step=1, lr=1e-3)


# --- fused AdamW --------------------------------------------------------------------------------

# fp32 AdamW: the kernel performs torch's operations in torch's order with round-to-nearest sqrt and
# division; contraction into fma may still move the last bit, so compare at a few fp32 ulps
ADAM_TOL = dict(rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize(
    "N,grad_dtype,kw",
    [
        (1000, torch.float32, dict(lr=1e-2, weight_decay=0.1)),
        (777, torch.bfloat16, dict(lr=3e-3, weight_decay=0.0, grad_scale=0.37)),
        (300, torch.float32, dict(lr=1e-2, beta1=0.3, beta2=0.95, eps=1e-6, weight_decay=0.05)),  # lerp from the end
    ],
)
def test_fused_adamw_matches_reference_and_torch(N, grad_dtype, kw):
    torch.manual_seed(0)
    p0 = torch.randn(N)
    bufs = {name: [p0.clone(), torch.zeros(N), torch.zeros(N)] for name in ("triton", "reference")}
    copy = torch.empty(N, dtype=torch.bfloat16)
    p_torch = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW(
        [p_torch],
        lr=kw["lr"],
        betas=(kw.get("beta1", 0.9), kw.get("beta2", 0.999)),
        eps=kw.get("eps", 1e-8),
        weight_decay=kw["weight_decay"],
        foreach=False,
    )
    for step in range(1, 6):
        grad = torch.randn(N).to(grad_dtype)
        p, m, v = bufs["triton"]
        # block 256 leaves a ragged last block for every N above
        triton_ops.adamw._fused_adamw_launch(
            p,
            grad,
            m,
            v,
            step=step,
            lr=kw["lr"],
            beta1=kw.get("beta1", 0.9),
            beta2=kw.get("beta2", 0.999),
            eps=kw.get("eps", 1e-8),
            weight_decay=kw["weight_decay"],
            grad_scale=kw.get("grad_scale", 1.0),
            param_copy=copy,
            block=256,
        )
        ref.fused_adamw(*bufs["reference"][:1], grad, *bufs["reference"][1:], step=step, **kw)
        p_torch.grad = grad.float() * kw.get("grad_scale", 1.0)
        opt.step()
        torch.testing.assert_close(p, bufs["reference"][0], **ADAM_TOL)
        torch.testing.assert_close(m, bufs["reference"][1], **ADAM_TOL)
        torch.testing.assert_close(v, bufs["reference"][2], **ADAM_TOL)
        torch.testing.assert_close(p, p_torch.detach(), **ADAM_TOL)
        # the copy is the rounded master, written in the same pass; Triton's interpreter truncates
        # fp32 -> bf16 where the GPU rounds to nearest (bench_kernels checks exact equality there), so
        # here it must lie within one bf16 ulp (2^-7 relative) of the master
        torch.testing.assert_close(copy.float(), p, rtol=2**-7, atol=0)


def _tiny_model(dtype=torch.float32):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 3, bias=False))
    model.unused = torch.nn.Parameter(torch.ones(5))  # never gets a gradient: must be skipped
    return model.to(dtype)


def _train(model, opt, steps=4):
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(6, 7, generator=g).to(next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_fused_adamw_optimizer_matches_torch(backend):
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ours, theirs = _tiny_model(), _tiny_model()
    # two groups with different hyper-parameters, as a trainer excludes biases from decay
    groups = lambda m: [  # noqa: E731
        {"params": [m[0].weight, m[2].weight, m.unused]},
        {"params": [m[0].bias], "weight_decay": 0.0, "lr": 3e-3},
    ]
    with rk.use_backend(backend):
        _train(ours, rk.FusedAdamW(groups(ours), **hp))
    _train(theirs, torch.optim.AdamW(groups(theirs), **hp, foreach=False))
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, **ADAM_TOL, msg=name)
    assert torch.equal(ours.unused, torch.ones(5))


def test_fused_adamw_optimizer_bf16_params_keep_fp32_master():
    hp = dict(lr=1e-2, weight_decay=0.1)
    ours = _tiny_model(torch.bfloat16)
    opt = rk.FusedAdamW(ours.parameters(), **hp)
    _train(ours, opt, steps=1)
    # one step from the same bf16 start in fp32 arithmetic, applied by torch to fp32 copies
    start = _tiny_model(torch.bfloat16)
    theirs = _tiny_model(torch.bfloat16).float()
    torch_opt = torch.optim.AdamW(theirs.parameters(), **hp, foreach=False)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        if a.grad is not None:
            b.grad = a.grad.float()
    torch_opt.step()
    for a, b, s in zip(ours.parameters(), theirs.parameters(), start.parameters()):
        if a.grad is None:
            continue
        master = opt.state[a]["master_param"]
        torch.testing.assert_close(master, b.detach(), **ADAM_TOL)
        torch.testing.assert_close(a.detach().float(), master, rtol=2**-7, atol=0)  # interpreter truncates, see above
        assert not torch.equal(a.detach(), s.detach())


@pytest.mark.distributed
def test_imports_stay_light():
    # moe, zero and routing_kernels must import on a box without hydra/wandb/transformers, and triton must stay
    # lazy until a Triton path runs
    code = (
        "import sys, moe, zero, routing_kernels; "
        "bad = [m for m in ('triton', 'hydra', 'omegaconf', 'wandb', 'transformers', 'safetensors') "
        "if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.distributed
@pytest.mark.skipif(IN_PROCESS, reason="the tests above ran in this process")
def test_in_fresh_process():
    # this module's tests, run where triton is first imported with the interpreter on
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
