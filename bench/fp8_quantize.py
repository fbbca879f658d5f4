"""FP8 row quantisation on one GPU: tdist.moe.swiglu_quantize_fp8 and quantize_fp8_rows (one kernel,
kernels/gemm/fp8_quantize.cuh) beside the torch form of the same arithmetic (SiLU(gate) * up in bf16,
then tdist.moe._quantize_rows_torch).

    python bench/fp8_quantize.py

Shapes: [gate | up] of M rows and 2 F columns, bf16 (the MoE first projection's output: Qwen3-30B-A3B
at 4096 tokens and one rank, 49152 rows of F 384; Mixtral-like 16384 x 7168; 4096 x 2048). Time per
call: CUDA events around 50 back-to-back calls after 5; GB/s counts the bytes read and written once.
"""

import tdist  # noqa: F401  (before torch: tdist's libnccl)
import torch
from tdist import moe


def per_call_us(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / n


def main():
    for m, f in ((49152, 384), (16384, 7168), (4096, 2048)):
        h13 = torch.randn((m, 2 * f), device="cuda").to(torch.bfloat16)
        x = h13[:, :f].contiguous()
        fused = per_call_us(lambda: moe.swiglu_quantize_fp8(h13))
        torch_form = per_call_us(
            lambda: moe._quantize_rows_torch(torch, torch.nn.functional.silu(h13[:, :f]) * h13[:, f:]))
        rows = per_call_us(lambda: moe.quantize_fp8_rows(x))
        rows_torch = per_call_us(lambda: moe._quantize_rows_torch(torch, x))
        moved = m * 2 * f * 2 + m * f  # bytes read (bf16 gate and up) and written (e4m3)
        print(f"M {m} F {f}: swiglu_quantize_fp8 {fused:.1f} us ({moved / fused / 1e3:.0f} GB/s), torch form "
              f"{torch_form:.1f} us; quantize_fp8_rows {rows:.1f} us, torch form {rows_torch:.1f} us", flush=True)


if __name__ == "__main__":
    main()
