"""GPU tests of tdist.flash_decode on one GPU:

    python tests/python/gpu_test_flash_decode.py          # plain script, "N passed, M failed" last
    python -m pytest -q tests/python/gpu_test_flash_decode.py
    torchrun --nproc-per-node 2 tests/python/gpu_test_flash_decode.py   # also the sequence-parallel op

Against torch's scaled_dot_product_attention in float64 on the whole cache (gathered through the
block table): bf16 / fp16, head dim 64 / 128 / 256, GQA 1 / 4 / 6 / 8, page sizes 1, 16, 64, 256 and
the contiguous cache, mixed lengths (0, 1, not a multiple of the page); the lse against float64
logsumexp; the sequence-parallel step of docs/flash_decode.md (two halves of each sequence decoded
apart, merged by their lse); torch.compile(fullgraph=True); a CUDA graph replayed with new lengths
(three chosen sets, then 1000 drawn ones, each replay checked);
under torchrun, tdist.flash_decode(distributed=True) with tokens dealt to ranks, eagerly and in a graph;
argument errors naming the argument; a bad block table reported by check_errors. Outputs come back
from the op as new tensors, so the allocator's blocks are filled with NaN before each call.
"""

import importlib
import math
import os
import sys
import traceback

import tdist  # before torch: tdist's libraries are then the ones the process loads

import torch
import torch.nn.functional as F

fd = tdist.flash_decode
fd_module = importlib.import_module("tdist.flash_decode")  # check_errors (tdist.flash_decode is the function)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def poison_allocator():
    """Fills the caching allocator's free blocks with NaN: an output the op leaves unwritten shows."""
    junk = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    junk.fill_(0xFF)
    del junk


def make_cache(batch, q_heads, kv_heads, d, page, lens, dtype, seed, capacity=None, fill_all=False):
    """(q, k_cache, v_cache, seq_lens, block_table, k_whole, v_whole): the whole sequences as
    [batch][max_len][kv_heads][d] for the reference; pages shuffled; rows past each length NaN
    (fill_all: every row up to the capacity holds its token, for lengths that change later)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    max_len = max(max(lens), 1) if capacity is None else capacity
    q = torch.randn((batch, q_heads, d), generator=g, device="cuda").to(dtype)
    k_whole = torch.randn((batch, max_len, kv_heads, d), generator=g, device="cuda").to(dtype)
    v_whole = torch.randn((batch, max_len, kv_heads, d), generator=g, device="cuda").to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if page == 0:  # contiguous: the whole tensor, NaN past each length
        k, v = k_whole.clone(), v_whole.clone()
        for b, n in enumerate(lens):
            if not fill_all:
                k[b, n:] = float("nan")
                v[b, n:] = float("nan")
        return q, k, v, seq_lens, None, k_whole, v_whole
    max_pages = (max_len + page - 1) // page
    num_pages = batch * max_pages + 2
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    table = perm[: batch * max_pages].reshape(batch, max_pages).to(torch.int32).cuda()
    k = torch.full((num_pages, page, kv_heads, d), float("nan"), dtype=dtype, device="cuda")
    v = torch.full_like(k, float("nan"))
    for b, n in enumerate(lens):
        n = max_len if fill_all else n
        for t0 in range(0, n, page):
            t1 = min(n, t0 + page)
            p = int(table[b, t0 // page])
            k[p, : t1 - t0] = k_whole[b, t0:t1]
            v[p, : t1 - t0] = v_whole[b, t0:t1]
    return q, k, v, seq_lens, table, k_whole, v_whole


def reference(q, k_whole, v_whole, lens, scale, softcap=0.0):
    """float64 SDPA per sequence on its first lens[b] tokens; (out, lse)."""
    batch, q_heads, d = q.shape
    kv_heads = k_whole.shape[2]
    out = torch.zeros((batch, q_heads, d), dtype=torch.float64, device=q.device)
    lse = torch.full((batch, q_heads), -math.inf, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        qb = q[b].double().unsqueeze(1)                                      # [H, 1, d]
        kb = k_whole[b, :n].double().transpose(0, 1).repeat_interleave(q_heads // kv_heads, 0)  # [H, n, d]
        vb = v_whole[b, :n].double().transpose(0, 1).repeat_interleave(q_heads // kv_heads, 0)
        s = (qb @ kb.transpose(1, 2)).squeeze(1) * scale                      # [H, n]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
            out[b] = (torch.softmax(s, -1).unsqueeze(1) @ vb).squeeze(1)
        else:
            out[b] = F.scaled_dot_product_attention(qb, kb, vb, scale=scale).squeeze(1)
        lse[b] = torch.logsumexp(s, -1)
    return out, lse


def check(out, lse, ref_out, ref_lse, dtype, what):
    # Relative beyond 1: randn values reach past 4, where a bf16 ulp is 1/32.
    err = ((out.double() - ref_out).abs() / ref_out.abs().clamp(min=1)).nan_to_num(math.inf).max().item()
    assert err <= TOL[dtype], f"{what}: out max |err| / max(1, |ref|) {err}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite), f"{what}: lse -inf where the sequence is not empty, or not"
    lerr = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert lerr <= 1e-3, f"{what}: lse max |err| {lerr}"


def test_against_sdpa():
    seed = 1
    for dtype in (torch.bfloat16, torch.float16):
        for d, q_heads, kv_heads, page in ((64, 8, 8, 16), (128, 32, 8, 1), (256, 16, 2, 64), (128, 12, 2, 256),
                                           (128, 8, 1, 0), (64, 16, 4, 16)):
            lens = [0, 1, page + 1 if page else 65, 3 * max(page, 16) - 1, 700, 1234]
            seed += 1
            q, k, v, sl, table, kw, vw = make_cache(len(lens), q_heads, kv_heads, d, page, lens, dtype, seed)
            poison_allocator()
            out, lse = fd(q, k, v, sl, table)
            fd_module.check_errors()
            ref_out, ref_lse = reference(q, kw, vw, lens, 1 / math.sqrt(d))
            check(out, lse, ref_out, ref_lse, dtype, f"{dtype} d {d} heads {q_heads}/{kv_heads} page {page}")


def test_combined_kv_pages():
    """FlashInfer's combined cache [pages, 2, page, kv_heads, d] passed as its K and V views (pages two
    pages apart), paged and contiguous, single and against SDPA; and a cache with padding between pages."""
    seed = 40
    for dtype, d, q_heads, kv_heads, page in ((torch.bfloat16, 128, 32, 8, 16), (torch.float16, 64, 16, 2, 1),
                                              (torch.bfloat16, 128, 8, 4, 0), (torch.float16, 256, 16, 2, 64)):
        lens = [0, 1, 333, 1200]
        seed += 1
        q, k, v, sl, table, kw, vw = make_cache(len(lens), q_heads, kv_heads, d, page, lens, dtype, seed)
        kv = torch.stack([k, v], dim=1)
        padded = torch.full((k.shape[0], k.shape[1] + 3, kv_heads, d), float("nan"), dtype=dtype, device="cuda")
        padded[:, : k.shape[1]] = k  # pages 3 rows further apart than dense
        vpad = torch.full_like(padded, float("nan"))
        vpad[:, : k.shape[1]] = v
        ref_out, ref_lse = reference(q, kw, vw, lens, 1 / math.sqrt(d))
        for name, kc, vc in (("combined", kv[:, 0], kv[:, 1]), ("padded", padded[:, : k.shape[1]],
                                                               vpad[:, : k.shape[1]])):
            assert not kc.is_contiguous()
            poison_allocator()
            out, lse = fd(q, kc, vc, sl, table)
            fd_module.check_errors()
            check(out, lse, ref_out, ref_lse, dtype, f"{name} {dtype} d {d} heads {q_heads}/{kv_heads} page {page}")
            out2, lse2 = fd(q, k, v, sl, table)  # the dense cache gives the same bits
            assert torch.equal(out, out2) and torch.equal(lse, lse2), f"{name}: differs from the dense cache"


def test_softcap_and_scale():
    q, k, v, sl, table, kw, vw = make_cache(3, 16, 4, 128, 16, [5, 300, 999], torch.bfloat16, 77)
    out, lse = fd(q, k, v, sl, table, softmax_scale=0.5, softcap=20.0)
    ref_out, ref_lse = reference(q, kw, vw, [5, 300, 999], 0.5, softcap=20.0)
    check(out, lse, ref_out, ref_lse, torch.bfloat16, "softcap")


def test_sequence_parallel_step():
    """docs/flash_decode.md's worked step: each half of every sequence decoded on its own (as two ranks
    would), merged by lse, equals SDPA on the whole cache."""
    lens = [4096, 1000, 3]
    q, _, _, _, _, kw, vw = make_cache(3, 32, 8, 128, 16, lens, torch.bfloat16, 5)
    parts = []
    for r in range(2):
        own = [n // 2 if r == 0 else n - n // 2 for n in lens]
        first = [0 if r == 0 else n // 2 for n in lens]
        k_r = torch.stack([torch.nn.functional.pad(kw[b, f:f + m], (0, 0, 0, 0, 0, max(own) - m))
                           for b, (f, m) in enumerate(zip(first, own))])
        v_r = torch.stack([torch.nn.functional.pad(vw[b, f:f + m], (0, 0, 0, 0, 0, max(own) - m))
                           for b, (f, m) in enumerate(zip(first, own))])
        parts.append(fd(q, k_r.contiguous(), v_r.contiguous(), torch.tensor(own, dtype=torch.int32, device="cuda")))
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o.float() * torch.exp(l - lse).unsqueeze(-1) for o, l in parts)
    ref_out, ref_lse = reference(q, kw, vw, lens, 1 / math.sqrt(128))
    check(out.to(torch.bfloat16), lse, ref_out, ref_lse, torch.bfloat16, "sequence-parallel step")


def test_torch_compile_fullgraph():
    q, k, v, sl, table, kw, vw = make_cache(2, 8, 2, 64, 16, [33, 500], torch.float16, 9)

    @torch.compile(fullgraph=True)
    def step(q, k, v, sl, table):
        out, lse = tdist.flash_decode(q, k, v, sl, table)
        return out * 2, lse

    out2, lse = step(q, k, v, sl, table)
    ref_out, ref_lse = reference(q, kw, vw, [33, 500], 1 / math.sqrt(64))
    check(out2 / 2, lse, ref_out, ref_lse, torch.float16, "torch.compile")


def test_cuda_graph_new_lengths():
    capacity = 800
    lens = [800, 17, 0, 400]
    q, k, v, sl, table, kw, vw = make_cache(4, 16, 4, 128, 16, lens, torch.bfloat16, 11, capacity=capacity,
                                                  fill_all=True)
    fd(q, k, v, sl, table)  # sizes the workspace before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fd(q, k, v, sl, table)
    for new in ([1, 2, 3, 4], [799, 0, 256, 16], [800, 800, 800, 800]):
        sl.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference(q, kw, vw, new, 1 / math.sqrt(128))
        check(out, lse, ref_out, ref_lse, torch.bfloat16, f"graph replay with lengths {new}")


def test_thousand_graph_replays_with_changing_lengths():
    """One captured call replayed 1000 times, each with new lengths drawn in [0, capacity] (0 and the
    capacity among them) and out poisoned first, every replay against the float64 reference."""
    capacity, batch = 300, 3
    q, k, v, sl, table, kw, vw = make_cache(batch, 8, 2, 64, 16, [capacity] * batch, torch.bfloat16, 23,
                                            capacity=capacity, fill_all=True)
    fd(q, k, v, sl, table)  # sizes the workspace before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fd(q, k, v, sl, table)
    gen = torch.Generator().manual_seed(29)
    for replay in range(1000):
        new = torch.randint(0, capacity + 1, (batch,), generator=gen).tolist()
        if replay % 100 == 0:
            new[replay // 100 % batch] = 0 if replay % 200 == 0 else capacity
        sl.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        ref_out, ref_lse = reference(q, kw, vw, new, 1 / math.sqrt(64))
        check(out, lse, ref_out, ref_lse, torch.bfloat16, f"replay {replay} with lengths {new}")


def expect_error(fn, *fragments):
    try:
        fn()
    except tdist.Error as e:
        for f in fragments:
            assert f in str(e), f"{f!r} not in the error: {e}"
        return
    raise AssertionError(f"expected tdist.Error with {fragments}")


def test_argument_errors():
    q, k, v, sl, table, _, _ = make_cache(2, 8, 2, 64, 16, [10, 20], torch.bfloat16, 3)
    expect_error(lambda: fd(q.float(), k, v, sl, table), "'q'")
    expect_error(lambda: fd(q[:, :7].contiguous(), k, v, sl, table), "'q'", "multiple")
    expect_error(lambda: fd(q, k.half(), v, sl, table), "'k_cache'")
    expect_error(lambda: fd(q, k, v[:-1], sl, table), "'v_cache'")
    expect_error(lambda: fd(q, k, v, sl.long(), table), "'seq_lens'")
    expect_error(lambda: fd(q, k, v, sl, table.long()), "'block_table'")
    expect_error(lambda: fd(q, k, v, sl, table, max_seq_len=10 ** 6), "'max_seq_len'")
    expect_error(lambda: fd(q, k, v, sl, None), "'k_cache'")  # pages are not one row per sequence
    expect_error(lambda: fd(q, k.cpu(), v, sl, table), "'k_cache'")  # not on q's device
    # a call of a known signature skips the shape checks, never the layout checks
    fd(q, k, v, sl, table)
    q_strided = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=q.dtype, device="cuda").transpose(1, 2)
    expect_error(lambda: fd(q_strided, k, v, sl, table), "'q'", "contiguous")
    v_strided = torch.empty(v.shape[0], v.shape[2], v.shape[1], v.shape[3], dtype=v.dtype,
                            device="cuda").transpose(1, 2)
    expect_error(lambda: fd(q, k, v_strided, sl, table), "'v_cache'", "dense")
    kv = torch.stack([k, v], dim=1)  # FlashInfer's combined cache: pages of 2 x 16 rows apart
    expect_error(lambda: fd(q, kv[:, 0], v, sl, table), "'v_cache'", "page stride")  # K strided, V dense
    expect_error(lambda: fd(q, k[:1].expand_as(k), v, sl, table), "'k_cache'", "apart")  # every page the same


def test_bad_block_table_is_reported():
    q, k, v, sl, table, _, _ = make_cache(2, 8, 2, 64, 16, [40, 20], torch.bfloat16, 4)
    bad = table.clone()
    bad[0, 1] = k.shape[0] + 7
    fd(q, k, v, sl, bad)
    expect_error(fd_module.check_errors, "'block_table'")
    fd_module.check_errors()  # cleared
    sl_bad = torch.tensor([40, 10 ** 6], dtype=torch.int32, device="cuda")
    fd(q, k, v, sl_bad, table)
    expect_error(fd_module.check_errors, "'seq_lens'")


def test_distributed_against_sdpa():
    """Under torchrun: each rank holds a part of every sequence (sequence 1 wholly on rank 0, the others
    hold none of it; the rest dealt in runs of 7 tokens); every rank's out is the whole attention."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    lens = [0, 300, 1, 17, 2049]
    q, _, _, _, _, kw, vw = make_cache(5, 32, 8, 128, 0, lens, torch.bfloat16, 21)  # the same on every rank
    own = [[t for t in range(n) if (rank == 0 if b == 1 else (t // 7 + b) % world == rank)] for b, n in enumerate(lens)]
    cap = max(1, max(len(o) for o in own))
    k = torch.zeros((5, cap, 8, 128), dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    for b, o in enumerate(own):
        if o:
            idx = torch.tensor(o, device="cuda")
            k[b, : len(o)] = kw[b, idx]
            v[b, : len(o)] = vw[b, idx]
    local = torch.tensor([len(o) for o in own], dtype=torch.int32, device="cuda")
    ref_out, ref_lse = reference(q, kw, vw, lens, 1 / math.sqrt(128))
    for step in range(3):  # both buffer parities, one reused
        poison_allocator()
        out, lse = fd(q, k, v, local, distributed=True)
        fd_module.check_errors()
        check(out, lse, ref_out, ref_lse, torch.bfloat16, f"distributed step {step}")
    # A CUDA graph of the distributed call, replayed: the epoch advances on the device.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fd(q, k, v, local, distributed=True)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse, ref_out, ref_lse, torch.bfloat16, "distributed graph replay")


TESTS = [test_against_sdpa, test_combined_kv_pages, test_softcap_and_scale, test_sequence_parallel_step,
         test_torch_compile_fullgraph, test_cuda_graph_new_lengths, test_thousand_graph_replays_with_changing_lengths,
         test_argument_errors, test_bad_block_table_is_reported]


def main():
    tests = list(TESTS)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: the sequence-parallel op too
        import torch.distributed as dist

        local = tdist._runtime._launcher_device()
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        tdist.init(process_group=dist.group.WORLD)
        tests.append(test_distributed_against_sdpa)
    passed = failed = 0
    for t in tests:
        try:
            t()
            passed += 1
            print(f"PASS {t.__name__}", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {t.__name__}\n{traceback.format_exc()}", flush=True)
    if tdist.is_initialized():
        tdist.finalize()
        torch.distributed.destroy_process_group()
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
