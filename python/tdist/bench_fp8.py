"""Benchmark of tdist's FP8 grouped GEMM (tdist.moe.grouped_gemm_fp8: e4m3, 1 x 128 activation and
128 x 128 weight scales, bf16 out) beside its bf16 grouped GEMM and torch's FP8 grouped GEMM, on one GPU.

    python -m tdist.bench_fp8 [--models mixtral,qwen3,dsv2lite] [--tokens 1024,4096,16384] [--tp 1]
        [--iters 20] [--json FILE]

Shapes: each model's expert projections as one rank of tensor parallelism --tp holds them (first:
N = 2 x intermediate / tp, K = hidden; second: N = hidden, K = intermediate / tp), M tokens routed
uniformly (every expert gets M x topk / E rows, padded to 128 as the grouped GEMM takes them).

Columns (median us over --iters calls, CUDA events, after a warm-up; the weights of every shape here
are larger than the L2 cache):
  bf16_us         tdist.moe.grouped_gemm on bf16 a and w
  fp8_us          tdist.moe.grouped_gemm_fp8 on their quantised copies (column-major A scales)
  torch_fp8_us    torch._scaled_grouped_mm (row-wise scales: one per token and one per weight row,
                  coarser than the block scales) on the same e4m3 operands, where this torch has it
                  and it runs here; null with the reason otherwise
  speedup         bf16_us / fp8_us;  vs_torch: torch_fp8_us / fp8_us
Every row checks fp8's output against float64 of the dequantised operands (max |diff| / max |ref|).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from .bench_moe import MODELS


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m tdist.bench_fp8", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--tokens", default="1024,4096,16384", help="comma-separated token counts M")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks sharing each expert")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r} (known: {', '.join(MODELS)})")
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        p.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    if not tokens or min(tokens) < 1:
        p.error("--tokens: positive token counts")
    if args.tp < 1 or args.iters < 1:
        p.error("--tp and --iters: positive integers")
    return args, models, tokens


def _time_us(torch, fn, iters):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def _torch_fp8(torch, a_q, w_q, counts):
    """torch._scaled_grouped_mm on the unpadded rows with unit row-wise scales, or (None, reason)."""
    fn = getattr(torch, "_scaled_grouped_mm", None)
    if fn is None:
        return None, "this torch has no torch._scaled_grouped_mm"
    g, n, _ = w_q.shape
    offs = torch.cumsum(torch.tensor(counts, dtype=torch.int32, device=a_q.device), 0, dtype=torch.int32)
    scale_a = torch.ones(a_q.shape[0], dtype=torch.float32, device=a_q.device)
    scale_b = torch.ones((g, n), dtype=torch.float32, device=a_q.device)
    call = lambda: fn(a_q, w_q.transpose(1, 2), scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
    try:
        call()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (any refusal is reported, not fatal)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return call, None


def _row(torch, moe, model, m, proj, n, k, experts, topk, iters):
    gen = torch.Generator(device="cuda").manual_seed(m * 31 + n + k)
    per_expert = m * topk // experts
    counts = [per_expert] * experts
    align = moe.grouped_gemm_alignment()
    padded = [0]
    for c in counts:
        padded.append(padded[-1] + -(-c // align) * align)
    rows = padded[-1]
    offs = torch.tensor(padded, dtype=torch.int32, device="cuda")
    a = torch.randn((max(rows, 1), k), generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn((experts, n, k), generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    a_q, a_s = moe.quantize_fp8_rows(a, column_major=True)  # the layout the GEMM reads fastest
    w_q, w_s = moe.quantize_fp8_blocks(w)
    d = moe.grouped_gemm_fp8(a_q, a_s, w_q, w_s, offs)
    # Check a few groups in float64 (all of them would take longer than the timing).
    err, scale = 0.0, 0.0
    for g in sorted({0, experts // 2, experts - 1}):
        r0, r1 = padded[g], padded[g] + counts[g]
        if r1 == r0:
            continue
        ad = a_q[r0:r1].double() * a_s[r0:r1].double().repeat_interleave(128, 1)[:, :k]
        wd = w_q[g].double() * w_s[g].double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        ref = ad @ wd.T
        err = max(err, (d[r0:r1].double() - ref).abs().max().item())
        scale = max(scale, ref.abs().max().item())
    row = dict(model=model, tokens=m, proj=proj, n=n, k=k, experts=experts, rows=rows,
               fp8_check=err / max(scale, 1e-30))
    row["bf16_us"] = _time_us(torch, lambda: moe.grouped_gemm(a, w, offs), iters)
    row["fp8_us"] = _time_us(torch, lambda: moe.grouped_gemm_fp8(a_q, a_s, w_q, w_s, offs), iters)
    unpadded = torch.cat([a_q[padded[g]:padded[g] + counts[g]] for g in range(experts)])
    call, reason = _torch_fp8(torch, unpadded, w_q, counts)
    row["torch_fp8_us"] = _time_us(torch, call, iters) if call else None
    row["torch_fp8_error"] = reason
    row["tflops_fp8"] = 2.0 * m * topk * n * k / row["fp8_us"] / 1e6
    return row


def main(argv=None) -> int:
    args, models, tokens = _parse(argv)
    import torch

    import tdist

    moe = tdist.moe
    if not torch.cuda.is_available():
        print("tdist.bench_fp8 needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"# {torch.cuda.get_device_name()}, tp {args.tp}, torch {torch.__version__}", flush=True)
    head = f"{'model':<18}{'M':>7} {'proj':<6}{'N':>6}{'K':>6} {'bf16_us':>9} {'fp8_us':>9} {'torch_fp8':>10} " \
           f"{'speedup':>8} {'vs_torch':>8} {'TFLOP/s':>8} {'check':>8}"
    print(head, flush=True)
    rows = []
    for key in models:
        name, hidden, inter, experts, topk = MODELS[key]
        f = inter // args.tp
        for m in tokens:
            for proj, n, k in (("first", 2 * f, hidden), ("second", hidden, f)):
                r = _row(torch, moe, name, m, proj, n, k, experts, topk, args.iters)
                rows.append(r)
                t, fp8 = r["torch_fp8_us"], r["fp8_us"]
                torch_us = f"{t:.1f}" if t else "n/a"
                vs_torch = f"{t / fp8:.2f}" if t else "n/a"
                print(f"{name:<18}{m:>7} {proj:<6}{n:>6}{k:>6} {r['bf16_us']:>9.1f} {fp8:>9.1f} {torch_us:>10} "
                      f"{r['bf16_us'] / fp8:>8.2f} {vs_torch:>8} {r['tflops_fp8']:>8.0f} {r['fp8_check']:>8.1e}",
                      flush=True)
    reasons = {r["torch_fp8_error"] for r in rows if r["torch_fp8_error"]}
    for reason in sorted(reasons):
        print(f"# torch._scaled_grouped_mm did not run: {reason}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": "python -m tdist.bench_fp8 " + " ".join(argv or sys.argv[1:]),
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
