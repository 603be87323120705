"""Correctness of the Triton routing kernels and fused AdamW at odd sizes (ragged tiles, empty
experts, dropped assignments) against their torch references, on the device the kernel benchmark
runs on: ``experiments.bench.kernels`` runs these before it times anything."""

from __future__ import annotations

import torch

import routing_kernels as rk
from routing_kernels import reference as ref


def odd_size_checks(device) -> list[str]:
    """The masks and edge cases of tests/kernels/test_triton_ops.py, on this device (the tests themselves run
    under the CPU interpreter). Returns a line per failure."""
    from routing_kernels import triton_ops as tops

    failures = []
    g = torch.Generator(device=device).manual_seed(0)

    def check(name, got, want, exact=False, rtol=1e-5, atol=1e-6):
        try:
            if exact:
                assert torch.equal(got, want), "not bit-identical"
            else:
                torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        except AssertionError as e:
            failures.append(f"{name}: {str(e).splitlines()[0] if str(e) else 'mismatch'}")

    # (T, K, E, D, drop): odd T and D, k = 1, k = E, empty experts, dropped slots, one token
    for T, K, E, D, drop in [
        (37, 3, 5, 13, 0.2),
        (50, 1, 7, 24, 0.0),
        (19, 4, 4, 4097, 0.1),
        (1, 2, 13, 5, 0.0),
        (1000, 2, 300, 130, 0.05),
        (9, 2, 3, 8, 1.0),
    ]:
        scores = torch.rand(T, E, device=device, generator=g)
        scores[:, : E // 3] = -1  # the first third of the experts stays empty
        ids_TK = scores.topk(K, dim=1).indices
        ids_TK[torch.rand(T, K, device=device, generator=g) < drop] = -1
        case = f"T={T} K={K} E={E} D={D}"
        meta = ref.routing_metadata(ids_TK, E)
        for name, a, b_ in zip(("counts", "offsets", "dest"), tops.routing_metadata(ids_TK, E), meta):
            check(f"routing_metadata {name} {case}", a, b_, exact=True)
        dest_TK, S = meta[2], int(meta[1][-1])
        for dtype in (torch.float32, torch.bfloat16):
            # bf16: the kernels accumulate K rows in fp32 and round once, the reference may round each
            # partial sum (index_add_); the interpreter also truncates fp32 -> bf16: two bf16 ulps
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            c = f"{case} {str(dtype)[6:]}"
            x = torch.randn(T, D, device=device, generator=g).to(dtype).requires_grad_()
            y = torch.randn(S, D, device=device, generator=g).to(dtype).requires_grad_()
            w = torch.rand(T, K, device=device, generator=g).requires_grad_()
            with rk.use_backend("triton"):
                out_p = rk.permute(x, dest_TK, S)
                out_c = rk.unpermute_combine(y, dest_TK, w)
            want_p = ref.permute(x, dest_TK, S)
            want_c = ref.unpermute_combine(y, dest_TK, w)
            check(f"permute {c}", out_p, want_p, exact=True)
            check(f"unpermute_combine {c}", out_c, want_c, **tol)
            g_S = torch.randn_like(want_p)
            g_T = torch.randn_like(want_c)
            check(
                f"permute bwd {c}", torch.autograd.grad(out_p, x, g_S)[0], torch.autograd.grad(want_p, x, g_S)[0], **tol
            )
            got = torch.autograd.grad(out_c, (y, w), g_T)
            want = torch.autograd.grad(want_c, (y, w), g_T)
            check(f"unpermute_combine bwd y {c}", got[0], want[0], **tol)
            # grad_w sums D products: compare relative to its scale
            scale = max(want[1].abs().max().item(), 1.0)
            check(f"unpermute_combine bwd w {c}", got[1] / scale, want[1] / scale, **tol)
    for N, grad_dtype, beta1 in [(1, torch.float32, 0.9), (1023, torch.bfloat16, 0.9), (5000, torch.float32, 0.3)]:
        p = torch.randn(N, device=device, generator=g)
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        pr, mr, vr = p.clone(), m.clone(), v.clone()
        copy = torch.empty(N, device=device, dtype=torch.bfloat16)
        for step in range(1, 4):
            grad = torch.randn(N, device=device, generator=g).to(grad_dtype)
            kw = dict(step=step, lr=1e-2, beta1=beta1, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_scale=0.5)
            tops.fused_adamw(p, grad, m, v, param_copy=copy, **kw)
            ref.fused_adamw(pr, grad, mr, vr, **kw)
        c = f"N={N} grad {str(grad_dtype)[6:]} beta1={beta1}"
        # same operations in the same order; fma contraction may move the last bits
        check(f"fused_adamw param {c}", p, pr, rtol=2e-6, atol=1e-7)
        check(f"fused_adamw exp_avg_sq {c}", v, vr, rtol=2e-6, atol=1e-10)
        check(f"fused_adamw bf16 copy {c}", copy, p.bfloat16(), exact=device.type == "cuda", rtol=2**-7, atol=0)
    return failures


# --- main ---------------------------------------------------------------------------------------
