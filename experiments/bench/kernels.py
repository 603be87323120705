"""Benchmark: the Triton routing kernels and fused AdamW against the memory-bandwidth limit.

    python -m experiments.bench.kernels [--tokens 65536] [--dim 4096] [--topk 2] [--experts 64]
                                        [--adam-params 1e9] [--no-sweep] [--json results.json]

Each op is reported as achieved bandwidth (the bytes it must move / its time) as a fraction of a
device-to-device copy measured in the same run, and as a speedup over the torch reference (and,
for AdamW, over torch's own fused AdamW, ``torch._fused_adamw_``, the kernel behind
``torch.optim.AdamW(fused=True)``). Before timing, every Triton result is checked against the
reference on the same inputs; the table shows the largest error.

On a machine without CUDA it times the torch references only, at small sizes, and says so.
It imports only torch, triton, ``routing_kernels`` and ``experiments.bench.timing`` (no hydra, no
wandb), so it runs unchanged on a GPU box that has nothing else installed.

Shapes follow the project's legend (docs/design.md).
Bytes counted (minimum traffic, every tensor read or written once):
  permute        read x [T, D], write x_SD [S, D], read dest [T, K]
  permute bwd    read grad [S, D], write grad_x [T, D], read dest
  combine        read y [S, D], write out [T, D], read dest and weights
  combine bwd    read grad [T, D] and y [S, D], write grad_y [S, D], read dest and weights, write grad_w
  AdamW          read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq (+ bf16 copy)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import routing_kernels as rk
from experiments.bench.odd_sizes import odd_size_checks
from experiments.bench.timing import time_cpu, time_cuda
from routing_kernels import reference as ref


class Bench:
    def __init__(self, device: torch.device, sweep: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        self.sweep = sweep
        self.rows: list[dict] = []
        self.sweep_rows: list[dict] = []

    def sweep_point(self, op, config, nbytes, fn):
        try:
            t = self.time(fn)
        except Exception as e:  # a config the compiler rejects (e.g. out of registers) is skipped
            print(f"sweep {op} {config}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            return
        self.sweep_rows.append(dict(op=op, config=config, bytes=nbytes, t=t))

    def time(self, fn) -> float:
        return time_cuda(fn) if self.cuda else time_cpu(fn)

    def copy_bandwidth(self, nbytes: int) -> float:
        """Bytes/s of a plain device-to-device copy (read + write counted), the denominator."""
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=self.device).random_(0, 255)
        dst = torch.empty_like(src)
        t = self.time(lambda: dst.copy_(src))
        src = dst = None  # freed (not del: the timed closure names them)
        return 2 * (nbytes // 2) / t

    def add(self, op, shape, nbytes, t_kernel, t_ref=None, t_torch_fused=None, err=None, note=""):
        self.rows.append(
            dict(
                op=op,
                shape=shape,
                bytes=nbytes,
                t_kernel=t_kernel,
                t_ref=t_ref,
                t_torch_fused=t_torch_fused,
                err=err,
                note=note,
            )
        )


def _fmt_ms(t):
    return "—" if t is None else f"{t * 1e3:.3f}"


def _table(rows, copy_bw) -> str:
    head = (
        "| op | shape | MB moved | time ms | GB/s | % of copy | reference ms | × vs reference "
        "| torch fused ms | × vs torch fused | max err |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        bw = r["bytes"] / r["t_kernel"] if r["bytes"] else None
        lines.append(
            "| "
            + " | ".join(
                [
                    r["op"],
                    r["shape"],
                    f"{r['bytes'] / 1e6:.1f}" if r["bytes"] else "—",
                    _fmt_ms(r["t_kernel"]),
                    "—" if bw is None else f"{bw / 1e9:.1f}",
                    "—" if bw is None else f"{100 * bw / copy_bw:.0f}%",
                    _fmt_ms(r["t_ref"]),
                    "—" if r["t_ref"] is None else f"{r['t_ref'] / r['t_kernel']:.2f}",
                    _fmt_ms(r["t_torch_fused"]),
                    "—" if r["t_torch_fused"] is None else f"{r['t_torch_fused'] / r['t_kernel']:.2f}",
                    "—" if r["err"] is None else f"{r['err']:.1e}",
                ]
            )
            + " |"
            + (f" {r['note']}" if r["note"] else "")
        )
    return "\n".join(lines)


def _sweep_table(rows, copy_bw) -> str:
    lines = ["| op | config | time ms | % of copy |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['config']} | {_fmt_ms(r['t'])} | {100 * r['bytes'] / r['t'] / copy_bw:.0f}% |")
    return "\n".join(lines)


def _max_err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


# --- routing ops --------------------------------------------------------------------------------


def bench_routing(b: Bench, T: int, D: int, K: int, E: int, dtype: torch.dtype, use_triton: bool):
    dev = b.device
    g = torch.Generator(device=dev).manual_seed(0)
    # distinct top-k experts per token from random scores, as a router produces them
    ids_TK = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    shape = f"T={T} K={K} E={E}"
    meta_bytes = ids_TK.numel() * ids_TK.element_size() + ids_TK.numel() * 8 + (2 * E + 1) * 8
    t_ref = b.time(lambda: ref.routing_metadata(ids_TK, E))
    counts_E, offsets_E1, dest_TK = ref.routing_metadata(ids_TK, E)
    S = int(offsets_E1[-1])
    if use_triton:
        from routing_kernels import triton_ops as tops

        got = tops.routing_metadata(ids_TK, E)
        exact = all(torch.equal(x, y) for x, y in zip(got, (counts_E, offsets_E1, dest_TK)))
        b.add(
            "routing_metadata",
            shape,
            meta_bytes,
            b.time(lambda: tops.routing_metadata(ids_TK, E)),
            t_ref,
            err=0.0 if exact else float("inf"),
            note="" if exact else "MISMATCH vs reference",
        )
    else:
        b.add("routing_metadata (reference)", shape, meta_bytes, t_ref)

    esize = torch.tensor([], dtype=dtype).element_size()
    shape = f"T={T} D={D} K={K} {str(dtype).replace('torch.', '')}"
    x_TD = torch.randn(T, D, device=dev, dtype=dtype, generator=g)
    w_TK = torch.rand(T, K, device=dev, generator=g).to(dtype)
    idx_bytes = dest_TK.numel() * 8
    w_bytes = w_TK.numel() * w_TK.element_size()
    perm_bytes = (T + S) * D * esize + idx_bytes
    comb_bytes = (S + T) * D * esize + idx_bytes + w_bytes
    comb_bwd_bytes = (T + 2 * S) * D * esize + idx_bytes + 2 * w_bytes

    want_SD = ref.permute(x_TD, dest_TK, S)
    y_SD = torch.randn(S, D, device=dev, dtype=dtype, generator=g)
    g_SD = torch.randn(S, D, device=dev, dtype=dtype, generator=g)
    g_TD = torch.randn(T, D, device=dev, dtype=dtype, generator=g)

    # references, backward through autograd.grad on a retained graph (the forward is not timed)
    x_req = x_TD.clone().requires_grad_()
    ref_perm_out = ref.permute(x_req, dest_TK, S)
    y_req, w_req = y_SD.clone().requires_grad_(), w_TK.clone().requires_grad_()
    ref_comb_out = ref.unpermute_combine(y_req, dest_TK, w_req)
    t_ref_perm = b.time(lambda: ref.permute(x_TD, dest_TK, S))
    t_ref_perm_bwd = b.time(lambda: torch.autograd.grad(ref_perm_out, x_req, g_SD, retain_graph=True))
    t_ref_comb = b.time(lambda: ref.unpermute_combine(y_SD, dest_TK, w_TK))
    t_ref_comb_bwd = b.time(lambda: torch.autograd.grad(ref_comb_out, (y_req, w_req), g_TD, retain_graph=True))

    if not use_triton:
        b.add("permute (reference)", shape, perm_bytes, t_ref_perm)
        b.add("permute bwd (reference)", shape, perm_bytes, t_ref_perm_bwd)
        b.add("unpermute_combine (reference)", shape, comb_bytes, t_ref_comb)
        b.add("unpermute_combine bwd (reference)", shape, comb_bwd_bytes, t_ref_comb_bwd)
        return

    from routing_kernels import triton_ops as tops

    got = tops.rows._permute_launch(x_TD, dest_TK, S)
    b.add(
        "permute",
        shape,
        perm_bytes,
        b.time(lambda: tops.rows._permute_launch(x_TD, dest_TK, S)),
        t_ref_perm,
        err=_max_err(got, want_SD),
    )
    (want,) = torch.autograd.grad(ref_perm_out, x_req, g_SD, retain_graph=True)
    got = tops.rows._permute_bwd_launch(g_SD, dest_TK, T)
    b.add(
        "permute bwd",
        shape,
        perm_bytes,
        b.time(lambda: tops.rows._permute_bwd_launch(g_SD, dest_TK, T)),
        t_ref_perm_bwd,
        err=_max_err(got, want),
    )
    got = tops.rows._unpermute_combine_launch(y_SD, dest_TK, w_TK)
    b.add(
        "unpermute_combine",
        shape,
        comb_bytes,
        b.time(lambda: tops.rows._unpermute_combine_launch(y_SD, dest_TK, w_TK)),
        t_ref_comb,
        err=_max_err(got, ref_comb_out.detach()),
    )
    want_y, want_w = torch.autograd.grad(ref_comb_out, (y_req, w_req), g_TD, retain_graph=True)
    got_y, got_w = tops.rows._unpermute_combine_bwd_launch(g_TD, y_SD, dest_TK, w_TK, True, True)
    # grad_w is a dot product over D: compare relative to its scale
    err_w = _max_err(got_w, want_w) / max(want_w.abs().max().item(), 1e-30)
    b.add(
        "unpermute_combine bwd",
        shape,
        comb_bwd_bytes,
        b.time(lambda: tops.rows._unpermute_combine_bwd_launch(g_TD, y_SD, dest_TK, w_TK, True, True)),
        t_ref_comb_bwd,
        err=max(_max_err(got_y, want_y), err_w),
    )
    # the same data through the autograd wrapper, to show the wrapper adds nothing measurable
    with rk.use_backend("triton"):
        b.add("permute via rk.permute", shape, perm_bytes, b.time(lambda: rk.permute(x_TD, dest_TK, S)), t_ref_perm)

    if b.sweep:
        # block sizes are picked by a fixed rule, not autotuned; this shows what the rule leaves on
        # the table on this chip. (BLOCK_T, BLOCK_D, num_warps); None = the launcher's own choice
        row_cfgs = [(None, None, 4), (1, 1024, 4), (2, 2048, 8), (8, 1024, 8), (16, 512, 4), (4, 2048, 16)]
        bwd_cfgs = [(None, None, 4), (1, 1024, 4), (1, 2048, 8), (4, 1024, 8), (8, 512, 8), (2, 2048, 16)]
        for op, nbytes, cfgs, launch in [
            (
                "permute",
                perm_bytes,
                row_cfgs,
                lambda c: tops.rows._permute_launch(x_TD, dest_TK, S, block_t=c[0], block_d=c[1], num_warps=c[2]),
            ),
            (
                "permute bwd",
                perm_bytes,
                row_cfgs,
                lambda c: tops.rows._permute_bwd_launch(g_SD, dest_TK, T, block_t=c[0], block_d=c[1], num_warps=c[2]),
            ),
            (
                "unpermute_combine",
                comb_bytes,
                row_cfgs,
                lambda c: tops.rows._unpermute_combine_launch(
                    y_SD, dest_TK, w_TK, block_t=c[0], block_d=c[1], num_warps=c[2]
                ),
            ),
            (
                "unpermute_combine bwd",
                comb_bwd_bytes,
                bwd_cfgs,
                lambda c: tops.rows._unpermute_combine_bwd_launch(
                    g_TD, y_SD, dest_TK, w_TK, True, True, block_t=c[0], block_d=c[1], num_warps=c[2]
                ),
            ),
        ]:
            for cfg in cfgs:
                b.sweep_point(
                    op,
                    f"BLOCK_T={cfg[0]} BLOCK_D={cfg[1]} warps={cfg[2]}",
                    nbytes,
                    lambda launch=launch, cfg=cfg: launch(cfg),
                )


# --- AdamW --------------------------------------------------------------------------------------


def bench_adamw(b: Bench, N: int, use_triton: bool):
    dev = b.device
    g = torch.Generator(device=dev).manual_seed(1)
    hp = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    p = torch.randn(N, device=dev, generator=g)
    grad = torch.randn(N, device=dev, generator=g) * 1e-2
    m = torch.zeros(N, device=dev)
    v = torch.zeros(N, device=dev)
    shape = f"N={N:.3g}"
    fp32_bytes = N * 4 * 7

    def ref_step():
        ref.fused_adamw(p, grad, m, v, step=10, **hp)

    t_ref = b.time(ref_step)

    t_torch = None
    if hasattr(torch, "_fused_adamw_"):
        step_t = torch.tensor(10.0, device=dev)

        def torch_step():
            torch._fused_adamw_(
                [p],
                [grad],
                [m],
                [v],
                [],
                [step_t],
                lr=hp["lr"],
                beta1=hp["beta1"],
                beta2=hp["beta2"],
                weight_decay=hp["weight_decay"],
                eps=hp["eps"],
                amsgrad=False,
                maximize=False,
            )

        try:
            t_torch = b.time(torch_step)
        except RuntimeError as e:  # no fused kernel for this device/dtype
            print(f"torch._fused_adamw_ unavailable here: {e}", file=sys.stderr)

    if not use_triton:
        b.add("AdamW fp32 grad (reference)", shape, fp32_bytes, t_ref, t_torch_fused=t_torch)
        return

    from routing_kernels import triton_ops as tops

    # correctness from identical state: one step each on copies
    pc, mc, vc = p.clone(), m.clone(), v.clone()
    copy_bf16 = torch.empty(N, device=dev, dtype=torch.bfloat16)
    tops.fused_adamw(pc, grad, mc, vc, step=10, param_copy=copy_bf16, **hp)
    pr, mr, vr = p.clone(), m.clone(), v.clone()
    ref.fused_adamw(pr, grad, mr, vr, step=10, **hp)
    err = max(_max_err(pc, pr) / pr.abs().max().item(), _max_err(vc, vr) / max(vr.abs().max().item(), 1e-30))
    copy_exact = torch.equal(copy_bf16, pc.bfloat16())
    del pc, mc, vc, pr, mr, vr

    b.add(
        "AdamW fp32 grad",
        shape,
        fp32_bytes,
        b.time(lambda: tops.fused_adamw(p, grad, m, v, step=10, **hp)),
        t_ref,
        t_torch,
        err=err,
        note="err: max relative to the largest |param|, |exp_avg_sq|",
    )
    if b.sweep:
        for block, warps in [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]:
            b.sweep_point(
                "AdamW fp32 grad",
                f"BLOCK={block} warps={warps}",
                fp32_bytes,
                lambda block=block, warps=warps: tops.adamw._fused_adamw_launch(
                    p, grad, m, v, step=10, grad_scale=1.0, param_copy=None, block=block, num_warps=warps, **hp
                ),
            )
    grad_bf16 = grad.bfloat16()
    b.add(
        "AdamW bf16 grad + bf16 copy",
        shape,
        N * (4 * 6 + 2 + 2),
        b.time(lambda: tops.fused_adamw(p, grad_bf16, m, v, step=10, param_copy=copy_bf16, **hp)),
        note="bf16 copy == round(master): " + ("yes" if copy_exact else "NO"),
    )


# --- correctness at odd sizes on this device --------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--adam-params", type=float, default=None)
    ap.add_argument("--no-sweep", action="store_true", help="skip the block-size sweep on the GPU")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    use_triton = False
    if cuda:
        try:
            import triton  # noqa: F401

            use_triton = True
        except ImportError:
            print("triton is not installed: timing the torch references only\n")
        name = torch.cuda.get_device_name()
        T, D, N = args.tokens or 65536, args.dim or 4096, int(args.adam_params or 1e9)
        # the AdamW phase holds ~52 bytes per parameter at its peak (state, clones for the check,
        # the reference's temporaries); shrink the default on a smaller card instead of failing
        free_bytes = torch.cuda.mem_get_info()[0]
        if args.adam_params is None and N * 52 > 0.8 * free_bytes:
            N = int(0.8 * free_bytes / 52)
            print(f"AdamW size capped to {N:.3g} parameters by free GPU memory\n")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        # a dry run of the GPU code path (checks and table included) on the CPU; times are meaningless
        name = "CPU, Triton interpreter"
        use_triton = True
        print("No CUDA device, TRITON_INTERPRET=1: dry run of the Triton path; the times mean nothing.\n")
        T, D, N = args.tokens or 64, args.dim or 48, int(args.adam_params or 5000)
    else:
        name = "CPU"
        # the interpreter is far too slow to time, and CPU figures say nothing about the GPU kernels
        print(
            "No CUDA device: timing the torch references only, at small sizes. "
            "The Triton figures need a GPU (run this same command there).\n"
        )
        T, D, N = args.tokens or 4096, args.dim or 512, int(args.adam_params or 4e6)
    dtype = getattr(torch, args.dtype)

    b = Bench(device, sweep=use_triton and not args.no_sweep)
    copy_bw = b.copy_bandwidth(1 << 30 if cuda else 1 << 27)
    print(
        f"device: {name}; torch {torch.__version__}"
        + (f"; triton {__import__('triton').__version__}" if use_triton else "")
    )
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)\n")
    if use_triton:
        failures = odd_size_checks(device)
        print(f"odd-size correctness checks on {device.type}: " + ("all passed" if not failures else "FAILED:"))
        for f in failures:
            print(f"  {f}")
        print()
    bench_routing(b, T, D, args.topk, args.experts, dtype, use_triton)
    if cuda:
        torch.cuda.empty_cache()
    bench_adamw(b, N, use_triton)
    print(_table(b.rows, copy_bw))
    print("\n× columns: time of the other implementation / time of this row (above 1: this row is faster).")
    if b.sweep_rows:
        print("\nBlock-size sweep (the first row of each op is the launcher's default):\n")
        print(_sweep_table(b.sweep_rows, copy_bw))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, copy_bytes_per_s=copy_bw, rows=b.rows, sweep=b.sweep_rows), f, indent=1)


if __name__ == "__main__":
    main()
