"""The CUDA paths against their CPU runs: Triton kernels at GPU sizes, the MoE layer, fused AdamW,
a Transformer's training steps and ZeroEngine on a GPU. Skipped where no GPU is visible (CI here);
run them on a GPU box with ``python -m pytest -q tests/kernels/test_cuda.py`` (no hydra or wandb needed).

Compiled kernels: Triton decides at decoration time whether a kernel runs in its interpreter, and
``tests/kernels/test_triton_ops.py`` imports the kernels under ``TRITON_INTERPRET=1`` (pytest imports every test
module before it runs any). In such a session (``make test``) this module's tests skip in-process
and ``test_in_fresh_process`` runs them in a new interpreter without ``TRITON_INTERPRET``;
``test_triton_kernels_are_compiled`` checks there that a launch produced a GPU binary.

Tolerances. Row moves (metadata, permute forward) are exact. fp32 on the GPU runs without TF32 (torch's
default for matmuls), so GPU and CPU differ only by summation order: ~1e-6 relative per op, and
2e-5 relative / 2e-5 absolute hold for values of size ~1 after a few ops. bf16 results are compared
with an fp64 run on the same inputs, within a few bf16 ulps (2^-8 relative each): 3e-2.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest
import torch

import routing_kernels as rk
from moe import MoEConfig, MoELayer
from moe.experts import GroupedExperts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
_CHILD = "SWITCHYARD_CUDA_TESTS_CHILD"  # set in the fresh process test_in_fresh_process starts


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off", "no")


def _kernels_interpreted_here() -> bool:
    """Would a Triton kernel launched in this process run in the interpreter?"""
    if _interpret_requested():
        return True
    ops = sys.modules.get("routing_kernels.triton_ops")
    if ops is not None and ops.INTERPRETED:
        return True
    # triton imported under the interpreter: its own library functions (tl.sum, ...) are interpreted
    standard = sys.modules.get("triton.language.standard")
    return standard is not None and type(getattr(standard, "sum", None)).__name__ == "InterpretedFunction"


@pytest.fixture(autouse=True)
def _compiled_kernels(request):
    if request.node.originalname != "test_in_fresh_process" and _kernels_interpreted_here():
        if os.environ.get(_CHILD):
            pytest.fail("the Triton kernels are interpreted even in the fresh process")
        pytest.skip(
            "Triton kernels run interpreted in this process (tests/kernels/test_triton_ops.py imported them under "
            "TRITON_INTERPRET=1); test_in_fresh_process runs this module with compiled kernels"
        )
    yield


@pytest.mark.distributed
def test_in_fresh_process():
    if not _kernels_interpreted_here():
        pytest.skip("the kernels are compiled in this process: this module's tests ran here")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[_CHILD] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    # every test ran there (this one skips, finding compiled kernels)
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and re.search(r"\b1 skipped", summary), summary


def _compiled_kernels_of(jit_fn) -> list:
    """The compiled kernels a Triton JITFunction holds after its launches (Triton 3: per device,
    ``device_caches[device][0]`` maps each specialisation to a CompiledKernel; older: ``cache``)."""
    found = []
    for entry in getattr(jit_fn, "device_caches", {}).values():
        found += list((entry[0] if isinstance(entry, tuple) else entry).values())
    for per_device in getattr(jit_fn, "cache", {}).values():
        found += list(per_device.values())
    return [k for k in found if getattr(k, "asm", None)]


def test_triton_kernels_are_compiled():
    from routing_kernels import triton_ops

    assert not _interpret_requested() and not triton_ops.INTERPRETED
    assert type(triton_ops.rows._permute_kernel).__name__ == "JITFunction"
    ids = torch.argsort(torch.rand(64, 8, device="cuda"), dim=1)[:, :2]
    x = torch.randn(64, 32, device="cuda")
    with rk.use_backend("triton"):
        counts, _, dest = rk.routing_metadata(ids, 8)
        rk.permute(x, dest, int(counts.sum()))
    torch.cuda.synchronize()
    kernels = _compiled_kernels_of(triton_ops.rows._permute_kernel)
    assert kernels, "the launch left no compiled kernel"
    assert all("cubin" in k.asm or "hsaco" in k.asm for k in kernels), [sorted(k.asm) for k in kernels]


FP32 = dict(rtol=2e-5, atol=2e-5)
BF16 = dict(rtol=3e-2, atol=3e-2)


@pytest.fixture(autouse=True)
def _no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def _ids(T, K, E, skew: bool, gen):
    if skew:  # half the experts empty, one expert takes most rows
        ids = torch.randint(0, E // 2, (T, K), generator=gen)
        ids[: T // 2, 0] = 0
        # top-k never repeats an expert within a token: shift duplicates onto distinct experts
        for k in range(1, K):
            ids[:, k] = (ids[:, 0] + k) % E
        return ids
    return torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K]


@pytest.mark.parametrize("T,K,E,D", [(4096, 2, 8, 1024), (3001, 6, 64, 520), (17, 1, 4, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skew", [False, True])
def test_routing_kernels_on_gpu_match_reference(T, K, E, D, dtype, skew):
    gen = torch.Generator().manual_seed(T + K + E)
    ids = _ids(T, K, E, skew, gen).cuda()
    x = torch.randn(T, D, generator=gen).to("cuda", dtype)
    w = torch.rand(T, K, generator=gen).cuda()
    g_out = torch.randn(T, D, generator=gen).to("cuda", dtype)
    out = {}
    for backend in ("reference", "triton"):
        with rk.use_backend(backend):
            counts, offsets, dest = rk.routing_metadata(ids, E)
            S = int(counts.sum())
            xr = x.clone().requires_grad_(True)
            x_SD = rk.permute(xr, dest, S)
            y_SD = (x_SD.float() * 1.5).to(dtype)  # a stand-in expert, so combine sees distinct rows
            wr = w.clone().requires_grad_(True)
            o = rk.unpermute_combine(y_SD, dest, wr.to(dtype) if dtype != torch.float32 else wr)
            gx, gw = torch.autograd.grad(o, [xr, wr], g_out)
            out[backend] = (counts, offsets, dest, x_SD.detach(), o.detach(), gx, gw)
    ref, tri = out["reference"], out["triton"]
    for name, a, b in zip(("counts", "offsets", "dest"), tri[:3], ref[:3]):
        assert torch.equal(a, b), name
    assert torch.equal(tri[3], ref[3]), "permute must move rows exactly"
    tol = FP32 if dtype == torch.float32 else BF16
    for name, a, b in zip(("combine", "grad x", "grad weights"), tri[4:], ref[4:]):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)


def _run(layer, x, grad):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_experts=8, top_k=2),
        dict(num_experts=16, top_k=3, activation="gelu", capacity_factor=1.0),
        dict(
            num_experts=8,
            top_k=2,
            num_shared_experts=1,
            score_func="sigmoid",
            capacity_factor=0.5,
            drop_policy="position",
        ),
    ],
)
def test_moe_layer_on_gpu_matches_cpu(kw):
    # the GPU runs routing_metadata/permute/unpermute_combine (Triton) around the expert loop (fp32);
    # the CPU runs its one-pass block loop: two different paths to the same numbers
    torch.manual_seed(0)
    cfg = MoEConfig(d_model=256, d_ff=384, **kw)
    cpu = MoELayer(cfg)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(4, 300, 256)
    grad = torch.randn(4, 300, 256)
    out_c, gx_c, grads_c = _run(cpu, x, grad)
    out_g, gx_g, grads_g = _run(gpu, x.cuda(), grad.cuda())
    torch.testing.assert_close(out_g.cpu(), out_c, **FP32)
    torch.testing.assert_close(gx_g.cpu(), gx_c, **FP32)
    for n in grads_c:
        torch.testing.assert_close(grads_g[n].cpu(), grads_c[n], **FP32, msg=n)
    for field in ("aux_loss", "z_loss", "dropped_fraction"):
        a, b = getattr(gpu.stats, field), getattr(cpu.stats, field)
        a, b = float(a) if a is not None else None, float(b) if b is not None else None
        assert (a is None and b is None) or abs(a - b) <= 1e-5 * max(1.0, abs(b)), field


@pytest.mark.parametrize("backend", ["auto", "loop"])  # auto: torch._grouped_mm on sm_90
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_experts_bf16_on_gpu_against_fp64(activation, backend):
    torch.manual_seed(0)
    E, D, F = 6, 128, 320
    counts = [500, 0, 1, 777, 64, 1300]  # an empty expert, a one-row expert, ragged segment ends
    experts = GroupedExperts(E, D, F, activation)
    ref = copy.deepcopy(experts).double()
    gpu = copy.deepcopy(experts).cuda().bfloat16()
    x = torch.randn(sum(counts), D)
    g = torch.randn(sum(counts), D)
    xg = x.cuda().bfloat16().requires_grad_(True)
    with rk.use_expert_backend(backend):
        if backend == "auto":
            expected = "grouped_mm" if torch.cuda.get_device_capability()[0] == 9 else "loop"
            assert rk.expert_backend(xg, gpu.w1, gpu.w3, gpu.w2) == expected
        yg = gpu(xg, counts)
        grads_g = torch.autograd.grad(yg, [xg, *gpu.parameters()], g.cuda().bfloat16())
    # the reference sees the same bf16-rounded inputs and weights, in fp64
    for p, q in zip(ref.parameters(), gpu.parameters()):
        p.data.copy_(q.detach().double().cpu())
    xr = xg.detach().double().cpu().requires_grad_(True)
    yr = ref(xr, counts)
    grads_r = torch.autograd.grad(yr, [xr, *ref.parameters()], g.bfloat16().double())
    scale = yr.abs().max()
    torch.testing.assert_close(yg.double().cpu() / scale, yr / scale, **BF16)
    for a, b in zip(grads_g, grads_r):
        s = b.abs().max().clamp_min(1e-12)
        torch.testing.assert_close(a.double().cpu() / s, b / s, **BF16)


def test_moe_layer_bf16_grouped_mm_matches_loop_on_gpu():
    # the whole bf16 layer with the experts as torch._grouped_mm and as the per-expert loop: same
    # routing (same inputs, same router), and the experts agree to bf16 rounding of their sums
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(d_model=256, d_ff=384, num_experts=16, top_k=4)).cuda().bfloat16()
    x = torch.randn(1000, 256, device="cuda").bfloat16()
    grad = torch.randn(1000, 256, device="cuda").bfloat16()
    with rk.use_expert_backend("grouped_mm"):
        assert rk.expert_backend(x, layer.experts.w1, layer.experts.w3, layer.experts.w2) == "grouped_mm"
        out_a, gx_a, grads_a = _run(layer, x, grad)
    with rk.use_expert_backend("loop"):
        out_b, gx_b, grads_b = _run(layer, x, grad)
    torch.testing.assert_close(out_a.float(), out_b.float(), **BF16)
    torch.testing.assert_close(gx_a.float(), gx_b.float(), **BF16)
    for n in grads_a:
        s = grads_b[n].float().abs().max()
        torch.testing.assert_close(grads_a[n].float() / s, grads_b[n].float() / s, **BF16, msg=n)


def test_fused_adamw_on_gpu_matches_torch():
    torch.manual_seed(0)
    shapes = [(1000, 37), (5,), (64, 64, 3)]
    ours = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes]
    theirs = [p.detach().clone().requires_grad_(True) for p in ours]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_a, opt_b = rk.FusedAdamW(ours, **kw), torch.optim.AdamW(theirs, **kw)
    for _ in range(5):
        for a, b in zip(ours, theirs):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for a, b in zip(ours, theirs):
        # the kernel computes the same formula in fp32, in another operation order: a few ulps per step
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_quantizer_on_gpu_matches_reference():
    # ZeRO++'s block quantizer: IEEE division and half-to-even rounding in the kernel, so the
    # compiled kernel matches the CPU reference bit for bit, bf16 outputs included (the GPU rounds
    # to nearest as torch does)
    from routing_kernels import reference as ref

    torch.manual_seed(0)
    for shape, block in [((4096, 1000), 256), ((3, 257), 256), ((7,), 5)]:
        x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])
        for dtype in (torch.float32, torch.bfloat16):
            for bits in (4, 8):
                q, s = rk.quantize_blockwise(x.to(dtype).cuda(), bits, block)
                q_ref, s_ref = ref.quantize_blockwise(x.to(dtype), bits, block)
                assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
                for out in (torch.float32, torch.bfloat16):
                    got = rk.dequantize_blockwise(q, s, block, out).cpu()
                    assert torch.equal(got, ref.dequantize_blockwise(q_ref, s_ref, block, out))


def _tiny_transformer(seed=0):
    from moe.model import Transformer, TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        vocab_size=97,
        d_model=64,
        n_layers=2,
        n_heads=4,
        d_ff=128,
        max_seq_len=32,
        moe=MoEConfig(d_model=64, d_ff=96, num_experts=4, top_k=2),
    )
    return Transformer(cfg)


def _train(model, steps, device, make_opt):
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 97, (4, 33), generator=gen)] * steps  # one batch: the loss must fall
    opt = make_opt(model)
    losses = []
    for batch in batches:
        batch = batch.to(device)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 97), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_transformer_training_on_gpu_matches_cpu():
    adam = lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)  # noqa: E731
    cpu = _tiny_transformer()
    gpu = copy.deepcopy(cpu).cuda()
    lc = _train(cpu, 4, "cpu", adam)
    lg = _train(gpu, 4, "cuda", adam)
    # the same routing decisions each step, so the same losses to rounding; a flipped top-k choice
    # would show as a difference far above this
    torch.testing.assert_close(torch.tensor(lg), torch.tensor(lc), rtol=1e-4, atol=1e-5)
    assert lg[-1] < lg[0]


# the engine's optimizer over its shard tensors, and the same optimizer on the unsharded model
_GPU_OPTIMIZERS = {
    "default": (None, lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)),  # FusedAdamW: Triton
    "torch_fused_adamw": (
        lambda g: torch.optim.AdamW(g, lr=3e-3, weight_decay=0.0, fused=True),
        lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0, fused=True),
    ),
    "sgd_momentum": (
        lambda g: torch.optim.SGD(g, lr=3e-2, momentum=0.9),
        lambda params: torch.optim.SGD(params, lr=3e-2, momentum=0.9),
    ),
}


@pytest.mark.parametrize("opt", list(_GPU_OPTIMIZERS))
@pytest.mark.parametrize(
    "stage,offload,mp", [(0, False, "fp32"), (3, False, "fp32"), (2, True, "fp32"), (3, False, "bf16")]
)
def test_zero_engine_on_gpu_matches_the_same_optimizer(stage, offload, mp, opt):
    # one process: no collective runs, but every buffer, gather/free, offload copy and the update
    # run on CUDA tensors; the multi-rank paths are the gloo tests' (tests/zero/test_engine.py)
    from zero import ZeroEngine

    factory, reference = _GPU_OPTIMIZERS[opt]
    ref = _tiny_transformer().cuda()
    model = copy.deepcopy(ref)
    kw = dict(lr=3e-3, weight_decay=0.0) if factory is None else dict(optimizer=factory)
    engine = ZeroEngine(model, stage=stage, offload=offload, mixed_precision=mp, **kw)

    losses_ref = _train(ref, 4, "cuda", lambda m: reference(m.parameters()))
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 97, (4, 33), generator=gen).cuda()
    losses = []
    for _ in range(4):
        logits = engine(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 97), batch[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    tol = dict(rtol=1e-4, atol=1e-5) if mp == "fp32" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_ref), **tol)
    if mp == "fp32":
        full = engine.full_parameters()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(full[n].cpu(), p.detach().cpu(), rtol=1e-4, atol=1e-5, msg=n)


# --- sync-free and compiled paths (docs/design.md, "torch.compile and host syncs") ---------------

_SYNC_FREE = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the sync-free expert path is torch._grouped_mm in bf16, the default (and measured) on sm_90",
)


def _bf16_layer(**kw):
    torch.manual_seed(0)
    return MoELayer(MoEConfig(d_model=256, d_ff=512, num_experts=8, top_k=2, **kw)).cuda().bfloat16()


@_SYNC_FREE
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_moe_layer_forward_backward_without_host_sync(capacity_factor):
    # counts and offsets stay on the device (routing_metadata's Triton kernels, _grouped_mm's device
    # offsets), row counts come from shapes (Routing.max_kept), so no CUDA call waits for the host
    layer = _bf16_layer(capacity_factor=capacity_factor)
    x = torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    assert rk.expert_backend(x.view(-1, 256), layer.experts.w1, layer.experts.w3, layer.experts.w2) == "grouped_mm"
    layer(x).backward(grad)  # warm-up: Triton compiles, cuBLAS and the allocator initialise
    torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x)
        out.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())


def _graph_model():
    from moe.model import Transformer, TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=128,
        d_model=128,
        n_layers=2,
        n_heads=4,
        d_ff=256,
        max_seq_len=64,
        moe=MoEConfig(d_model=128, d_ff=256, num_experts=8, top_k=2, capacity_factor=1.25),
    )
    return Transformer(cfg).cuda().bfloat16()


def _graph_step(model, opt, batch):
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 128), batch[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return loss


@_SYNC_FREE
def test_training_step_captured_in_a_cuda_graph():
    # capacity bounds the rows (Routing.max_kept), so every shape of a step is fixed by the batch
    # shape: forward, backward and a capturable AdamW step replay as one CUDA graph. The replayed
    # losses follow the same steps run eagerly on a twin (same kernels; bf16, so within bf16 rounding)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (8, 65), generator=gen).cuda() for _ in range(6)]
    models = [_graph_model(), _graph_model()]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True) for m in models]
    eager_model, graph_model = models
    eager_opt, graph_opt = opts

    warm = 3  # torch's recipe: warm up on a side stream before capturing (the twin runs the same steps)
    static = batches[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for b in batches[:warm]:
            static.copy_(b)
            graph_opt.zero_grad(set_to_none=True)
            _graph_step(graph_model, graph_opt, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    graph_opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = _graph_step(graph_model, graph_opt, static)
    replayed = []
    for b in batches[warm:]:
        static.copy_(b)
        graph.replay()
        replayed.append(static_loss.item())

    eager = []
    for i, b in enumerate(batches):
        eager_opt.zero_grad(set_to_none=True)
        loss = _graph_step(eager_model, eager_opt, b).item()
        if i >= warm:
            eager.append(loss)
    torch.testing.assert_close(torch.tensor(replayed), torch.tensor(eager), rtol=1e-2, atol=1e-2)
    assert all(layer.stats.dropped_fraction.item() >= 0 for layer in graph_model.moe_layers())


@_SYNC_FREE
def test_compiled_moe_layer_on_gpu_matches_eager():
    # Inductor on the GPU path (Triton routing kernels, _grouped_mm with device offsets): no graph
    # break in the layer, and the same numbers to bf16 rounding (fused kernels sum in another order)
    layer = _bf16_layer()
    twin = copy.deepcopy(layer)
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    explained = torch._dynamo.explain(copy.deepcopy(layer))(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    twin.forward = torch.compile(twin.forward)
    out_e, gx_e, grads_e = _run(layer, x, grad)
    out_c, gx_c, grads_c = _run(twin, x, grad)
    torch.testing.assert_close(out_c.float(), out_e.float(), **BF16)
    torch.testing.assert_close(gx_c.float(), gx_e.float(), **BF16)
    for n in grads_e:
        s = grads_e[n].float().abs().max()
        torch.testing.assert_close(grads_c[n].float() / s, grads_e[n].float() / s, **BF16, msg=n)
