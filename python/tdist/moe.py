"""Mixture-of-experts layers under tensor parallelism (tdist/ops/moe.hpp, docs/moe.md), on torch tensors.

Every rank holds every expert's shard of the intermediate features; the communication runs behind
the grouped GEMM.

    h13 = tdist.moe_ag_group_gemm(x_rows, topk_ids, w13)                # AllGather + grouped GEMM
    h = silu(h13[:, :f]) * h13[:, f:]                                   # the activation, row by row
    y_rows = tdist.moe_group_gemm_rs(h, w2, topk_ids, topk_weights)     # grouped GEMM + top-k reduce + RS
    y_all = tdist.moe_group_gemm_ar(h, w2, topk_ids, topk_weights)      # ... + AllReduce (decode)

    # FP8: e4m3 tokens, h and weights with their block scales, bf16 out
    h13 = tdist.moe_ag_group_gemm_fp8(*quantize_fp8_rows(x_rows), topk_ids, *quantize_fp8_blocks(w13))
    h_q, h_s = swiglu_quantize_fp8(h13, column_major=True)             # SiLU(gate) * up in e4m3, one pass
    y_rows = tdist.moe_group_gemm_rs_fp8(h_q, h_s, *quantize_fp8_blocks(w2), topk_ids, topk_weights)

Shapes (M tokens over all ranks, rows(r) = M // W + (r < M % W) of them on rank r, after rank r's
predecessors'; E experts; T = bf16 or fp16):

    x_rows        T [rows(rank), K]        this rank's tokens
    topk_ids      int32 [M, topk]          every token's experts, the same on every rank (int64 converted)
    topk_weights  float32 [M, topk]        the router's weights
    w13 / w2      T [E, N, K]              this rank's shard of every expert (rows: output features)
    -> moe_ag_group_gemm   T [capacity(M, topk, E), N] in expert order: expert e's pairs in rows
                           [offsets[e], offsets[e] + counts[e]), zero padding rows up to offsets[e + 1]
                           (routing_reference gives the layout); rows past offsets[E] are not written
    -> moe_group_gemm_rs   T [rows(rank), N]: sum over ranks and k of topk_weights[t, k] * (h row of (t, k)) x w2_e^T
    -> moe_group_gemm_ar   T [M, N]: the same for every token, on every rank

The routing (sort by expert, padding to 128-row tiles) runs on the GPU, with no host synchronisation;
moe_group_gemm_rs routes topk_ids again (a pure function of the ids, so the rows match the first
projection's). An expert id outside [0, E) is checked on the GPU without stopping the stream: its
pair is routed to expert 0 (that call's outputs are wrong), the routing kernel prints it, and
tdist.moe.check_errors() (which synchronises) raises tdist.Error naming topk_ids[t][k] and the id.
Collective: every rank calls with the same M, shapes and method. method: 'auto', 'chunked' or
'baseline', and for moe_ag_group_gemm also 'fused' (one grouped GEMM launch whose tiles wait for
their own tokens; docs/moe.md). rs_method(method) is the second projection's method of a layer run
with one method. Each op keeps one context per (dtype, experts, topk, K or N) on tdist's
heap, created on the first call and re-created larger when a call has more tokens (collective; never
during a CUDA graph capture: run the largest call once first). Registered as
torch.ops.tdist.moe_ag_group_gemm and torch.ops.tdist.moe_group_gemm_rs (and their _fp8 forms) with fake
implementations.

The grouped GEMM alone (one GPU, not collective; tdist/ops/grouped_gemm.hpp), on any tensors:

    d = tdist.moe.grouped_gemm(a, w, offsets)    # T [M_total, N]: rows [offsets[g], offsets[g + 1]) = a[them] x w[g]^T

    a        T [M_total, K]       every group's rows, group after group
    w        T [G, N, K]          one weight per group (the layout of w13 / w2 above); K and N
                                  multiples of 8
    offsets  int32 or int64 [G + 1] on a's device: offsets[0] = 0, non-decreasing, each a multiple of
             grouped_gemm_alignment() (128), offsets[G] <= M_total; read by the GPU only (no host
             synchronisation), so offsets breaking these rules give undefined rows (never an access
             outside a, w and d). Padding rows are computed like the others; rows past offsets[G] of d
             are not written. routing_reference's offsets have this form.
Registered as torch.ops.tdist.grouped_gemm with a fake implementation.

Its FP8 instance (e4m3 operands with DeepSeek-V3's block scales, bf16 output; docs/gemm.md "FP8"):

    a_q, a_s = tdist.moe.quantize_fp8_rows(a)       # e4m3 [M_total, K], f32 [M_total, ceil(K / 128)]
    w_q, w_s = tdist.moe.quantize_fp8_blocks(w)     # e4m3 [G, N, K], f32 [G, ceil(N / 128), ceil(K / 128)]
    d = tdist.moe.grouped_gemm_fp8(a_q, a_s, w_q, w_s, offsets)   # bf16 [M_total, N]

    value of a_q[r, c] = a_q[r, c] * a_s[r, c // 128]; of w_q[g, j, c] = w_q[g, j, c] * w_s[g, j // 128, c // 128]
    a_s may have any strides (a column-major [ceil(K / 128), M_total] buffer passed transposed works as
    well); K a multiple of 16, N of 8; offsets as above. Inference only (no autograd). Registered as
    torch.ops.tdist.grouped_gemm_fp8 with a fake implementation.

All three ops have autograd (python/tdist/_autograd.py, docs/moe.md "Training"): gradients of x_rows,
h, w, topk_weights (summed over ranks) and a; none of topk_ids or offsets. The backward rebuilds the
routing with routing(topk_ids, E, world, rank), torch ops on the GPU equal to routing_reference.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the annotations as types.
from . import _C
from ._tensors import Error, check_tensor_kind, raw_stream, torch_dtype_name, torch_module
from ._tensors import tensor_shape as _shape

_DTYPES = {"bfloat16": "bf16", "float16": "f16"}
AG_METHODS = ("auto", "fused", "chunked", "baseline")  # moe_ag_group_gemm
AG_FP8_METHODS = AG_METHODS  # moe_ag_group_gemm_fp8
RS_METHODS = ("auto", "chunked", "baseline")  # moe_group_gemm_rs (no fused method)
RS_FP8_METHODS = RS_METHODS  # moe_group_gemm_rs_fp8
_contexts = {}  # (kind, dtype, experts, topk, k) -> C++ context of the live runtime


def _fail(op: str, name: str, expected: str, got) -> None:
    raise Error(f"tdist.{op}: invalid argument '{name}': expected {expected}, got {got}")


def capacity(m: int, topk: int, experts: int) -> int:
    """Rows of the expert-ordered matrices for any routing of m tokens."""
    return _C.moe_capacity(int(m), int(topk), int(experts))


def rows_of(m: int, world_size: int, rank: int) -> tuple:
    """(first token, tokens) of rank's part of m tokens."""
    base, extra = divmod(int(m), int(world_size))
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def routing_reference(topk_ids, experts: int, world_size: int = 1, rank: int = 0) -> dict:
    """The routing of rank on the host (the GPU computes the same): offsets [E + 1], counts [E],
    token_of_row [offsets[E]] (-1: padding), row_of_pair [M][topk]. topk_ids: [M, topk] ints (a tensor
    or nested lists); raises tdist.Error naming topk_ids for an id outside [0, experts)."""
    rows = topk_ids.tolist() if hasattr(topk_ids, "tolist") else list(topk_ids)
    m = len(rows)
    topk = len(rows[0]) if m else 1
    if any(len(r) != topk for r in rows):
        _fail("moe.routing_reference", "topk_ids", "[M, topk] rows of one length", [len(r) for r in rows])
    flat = [int(v) for r in rows for v in r]
    offsets, counts, token_of_row, row_of_pair = _C.moe_routing_reference(flat, m, topk, int(experts),
                                                                          int(world_size), int(rank))
    return dict(offsets=offsets, counts=counts, token_of_row=token_of_row,
                row_of_pair=[row_of_pair[t * topk:(t + 1) * topk] for t in range(m)])


def routing(topk_ids, experts: int, world_size: int = 1, rank: int = 0) -> dict:
    """routing_reference's layout on topk_ids' device, with no host synchronisation (CUDA-graph safe
    once a call of as many tokens ran before the capture; the MoE ops' backward uses it), as int32
    tensors: offsets [E + 1], counts [E], token_of_row [capacity(M, topk, E)] (-1: padding and the
    rows past offsets[E]), row_of_pair [M, topk]; and the same order without padding (pair c of
    M x topk, expert by expert, docs/moe.md): compact_offsets [E + 1] (cumulative counts),
    row_of_compact, token_of_compact and pair_of_compact (t x topk + k) [M x topk], and
    compact_of_pair [M, topk], the inverse of pair_of_compact. topk_ids: an int32 or int64 tensor
    [M, topk] with ids in [0, experts); an id outside is routed to expert 0 (a check would need a
    synchronisation): on a GPU the routing kernel records it for check_errors, as the ops' does.
    On a GPU this is the ops' routing kernels (one call); elsewhere torch ops."""
    torch = _torch("moe.routing")
    op = "moe.routing"
    check_tensor_kind(lambda *a: _fail(op, *a), "topk_ids", topk_ids, ("int32", "int64"), (None, None))
    m, topk = _shape(topk_ids)
    _C.moe_check_routing(m, topk, int(experts), int(world_size), int(rank))
    if topk_ids.device.type == "cuda":
        return _routing_on_gpu(torch, topk_ids, m, topk, int(experts), int(world_size), int(rank))
    return _routing_by_torch_ops(torch, topk_ids, m, topk, int(experts), int(world_size), int(rank))


_routers = {}  # (device, topk, experts, world_size, rank) -> _C.MoeRouter, grown as contexts are


def _grown_max_m(torch, op: str, what: str, m: int, old_max_m: int) -> int:
    """The token bound of a context or router made anew for a call of m tokens (at least twice the
    old one's, so that growing calls remake it rarely); raises tdist.Error naming op during a CUDA
    graph capture, where device memory cannot be allocated for it."""
    if torch.cuda.is_current_stream_capturing():
        raise Error(f"{op}: a call of {m} tokens needs a new {what}, which cannot be made during CUDA graph capture: "
                    "run the largest call once before capturing")
    return max(m, 2 * old_max_m, 1)


def _routing_on_gpu(torch, topk_ids, m, topk, experts, world_size, rank) -> dict:
    dev = topk_ids.device
    key = (dev.index, topk, experts, world_size, rank)
    router = _routers.get(key)
    if router is None or router.max_m < m:
        max_m = _grown_max_m(torch, "tdist.moe.routing", "router (device memory)", m,
                             router.max_m if router is not None else 0)
        router = _routers[key] = _C.MoeRouter(max_m, topk, experts, world_size, rank, dev.index)
    pairs, rows = m * topk, capacity(m, topk, experts)
    names = ("offsets", "counts", "token_of_row", "row_of_pair", "compact_offsets", "row_of_compact",
             "token_of_compact", "pair_of_compact", "compact_of_pair")
    sizes = (experts + 1, experts, rows, pairs, experts + 1, pairs, pairs, pairs, pairs)
    out = dict(zip(names, torch.empty(sum(sizes), dtype=torch.int32, device=dev).split(sizes)))
    router.route_into(_ids32(topk_ids).data_ptr(), m, *(out[n].data_ptr() for n in names),
                      raw_stream(dev.index))
    out["row_of_pair"] = out["row_of_pair"].view(m, topk)
    out["compact_of_pair"] = out["compact_of_pair"].view(m, topk)
    return out


def _routing_by_torch_ops(torch, topk_ids, m, topk, experts, world_size, rank) -> dict:
    dev = topk_ids.device
    tile = grouped_gemm_alignment()
    rows = capacity(m, topk, experts)
    # The rotated pair order (docs/moe.md): this rank's tokens first, then rank + 1's, ...; pair q is
    # token rotated[q // topk], slot q % topk. A stable sort by expert keeps that order per expert.
    rotated = (torch.arange(m, device=dev) + rows_of(m, world_size, rank)[0]) % max(m, 1)
    flat = topk_ids.long()[rotated].reshape(-1)
    flat = torch.where((flat >= 0) & (flat < experts), flat, 0)  # an index out of range would assert
    by_expert = torch.sort(flat, stable=True)
    expert_of, pair = by_expert.values, by_expert.indices
    # scatter_add, not bincount: bincount sizes its output from the largest id (a synchronisation).
    counts = torch.zeros(experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(experts + 1, dtype=torch.long, device=dev)
    offsets[1:] = torch.cumsum((counts + tile - 1) // tile * tile, 0)
    first_of = torch.cumsum(counts, 0) - counts  # the expert's first position in the sorted pairs
    row = offsets[expert_of] + torch.arange(flat.numel(), device=dev) - first_of[expert_of]
    token = rotated[pair // topk]
    pair_of_compact = token * topk + pair % topk
    row_of_pair = torch.empty(m * topk, dtype=torch.long, device=dev).scatter_(0, pair_of_compact, row)
    token_of_row = torch.full((rows,), -1, dtype=torch.long, device=dev).scatter_(0, row, token)
    compact_offsets = torch.zeros(experts + 1, dtype=torch.long, device=dev)
    compact_offsets[1:] = torch.cumsum(counts, 0)
    compact_of_pair = torch.empty_like(pair_of_compact).scatter_(0, pair_of_compact,
                                                                 torch.arange(m * topk, device=dev))
    out = dict(offsets=offsets, counts=counts, token_of_row=token_of_row, row_of_pair=row_of_pair.view(m, topk),
               compact_offsets=compact_offsets, row_of_compact=row, token_of_compact=token,
               pair_of_compact=pair_of_compact, compact_of_pair=compact_of_pair.view(m, topk))
    return {k: v.to(torch.int32) for k, v in out.items()}


def grouped_gemm_alignment() -> int:
    """Rows of every group of grouped_gemm are padded to a multiple of this (the offsets' rule)."""
    return _C.grouped_gemm_alignment()


def _check_tensor(op, name, t, dtypes, dims, device, contiguous=True):
    check_tensor_kind(lambda *a: _fail(op, *a), name, t, dtypes, dims)
    t_device = t.device
    if device is not None and t_device != device:
        _fail(op, name, f"a tensor on {device}", t_device)
    if t_device.type not in ("cuda", "meta"):
        _fail(op, name, "a CUDA tensor", t_device)
    if contiguous and not t.is_contiguous():
        _fail(op, name, "a contiguous tensor", f"strides {tuple(t.stride())}")


def rs_method(method: str) -> str:
    """The second projection's method in a layer whose first projection runs `method`: the same, or
    'chunked' for 'fused' (the first projection's only)."""
    return "chunked" if method == "fused" else method


def _check_method(op, method, methods):
    if method not in methods:
        _fail(op, "method", " or ".join(repr(m) for m in methods), repr(method))


def _check_weights_and_ids(op, method, w, topk_ids, world_size, rank) -> dict:
    """The checks both projections start with: method, the weights w [E, N, K], the ids [M, topk]."""
    _check_method(op, method, AG_METHODS if op == "moe_ag_group_gemm" else RS_METHODS)
    _check_tensor(op, "w", w, tuple(_DTYPES), (None, None, None), None)
    experts, n, k = _shape(w)
    _check_tensor(op, "topk_ids", topk_ids, ("int32", "int64"), (None, None), w.device)
    m, topk = _shape(topk_ids)
    _C.moe_check_routing(m, topk, experts, world_size, rank)
    return dict(m=m, n=n, k=k, experts=experts, topk=topk, dtype=_DTYPES[torch_dtype_name(w.dtype)])


def check_ag_args(x_rows, topk_ids, w, method="auto", world_size=1, rank=0) -> dict:
    """Shapes, dtypes and devices of a moe_ag_group_gemm call; raises tdist.Error naming the argument."""
    op = "moe_ag_group_gemm"
    s = _check_weights_and_ids(op, method, w, topk_ids, world_size, rank)
    m, k = s["m"], s["k"]
    _check_tensor(op, "x_rows", x_rows, (torch_dtype_name(w.dtype),), (rows_of(m, world_size, rank)[1], k), w.device)
    return s


def check_rs_args(h, w, topk_ids, topk_weights, method="auto", world_size=1, rank=0) -> dict:
    """Shapes, dtypes and devices of a moe_group_gemm_rs / _ar call; raises tdist.Error naming the argument."""
    op = "moe_group_gemm_rs"
    s = _check_weights_and_ids(op, method, w, topk_ids, world_size, rank)
    m, topk, k, experts = s["m"], s["topk"], s["k"], s["experts"]
    _check_tensor(op, "topk_weights", topk_weights, ("float32",), (m, topk), w.device)
    _check_tensor(op, "h", h, (torch_dtype_name(w.dtype),), (capacity(m, topk, experts), k), w.device)
    return s


def check_grouped_gemm_args(a, w, offsets) -> dict:
    """Shapes, dtypes and devices of a grouped_gemm call; raises tdist.Error naming the argument."""
    op = "moe.grouped_gemm"
    _check_tensor(op, "w", w, tuple(_DTYPES), (None, None, None), None)
    groups, n, k = _shape(w)
    if groups < 1:
        _fail(op, "w", "at least one group [G >= 1, N, K]", list(_shape(w)))
    if k % 8 != 0 or k == 0:
        _fail(op, "w", "K (its last dimension) a positive multiple of 8", k)
    if n % 8 != 0:  # d is dense: its rows must stay 16-byte aligned
        _fail(op, "w", "N (its second dimension) a multiple of 8", n)
    _check_tensor(op, "a", a, (torch_dtype_name(w.dtype),), (None, k), w.device)
    _check_tensor(op, "offsets", offsets, ("int32", "int64"), (groups + 1,), w.device)
    return dict(m=_shape(a)[0], n=n, k=k, groups=groups, dtype=_DTYPES[torch_dtype_name(w.dtype)],
                offsets_dtype=torch_dtype_name(offsets.dtype))


def _grouped_gemm(a, w, offsets):
    torch = torch_module()
    s = check_grouped_gemm_args(a, w, offsets)
    d = torch.empty((s["m"], s["n"]), dtype=w.dtype, device=w.device)
    if s["m"] == 0 or s["n"] == 0:
        return d
    # The m-tile order of a clustered walk, from torch's allocator (stream-ordered, graph-safe).
    order_scratch = torch.empty((_C.grouped_gemm_scratch_entries(s["m"]),), dtype=torch.int32, device=w.device)
    _C.grouped_gemm(a.data_ptr(), w.data_ptr(), d.data_ptr(), offsets.data_ptr(), s["offsets_dtype"], s["m"], s["n"],
                    s["k"], s["groups"], s["dtype"], order_scratch.data_ptr(), w.device.index,
                    raw_stream(w.device.index))
    return d


_FP8 = "float8_e4m3fn"
_FP8_MAX = 448.0  # the largest finite e4m3 value
_SCALE_BLOCK = 128


def check_grouped_gemm_fp8_args(a, a_scales, w, w_scales, offsets) -> dict:
    """Shapes, dtypes and devices of a grouped_gemm_fp8 call; raises tdist.Error naming the argument."""
    op = "moe.grouped_gemm_fp8"
    _check_tensor(op, "w", w, (_FP8,), (None, None, None), None)
    groups, n, k = _shape(w)
    if groups < 1:
        _fail(op, "w", "at least one group [G >= 1, N, K]", list(_shape(w)))
    if k % 16 != 0 or k == 0:
        _fail(op, "w", "K (its last dimension) a positive multiple of 16", k)
    if n % 8 != 0:  # d is dense bf16: its rows must stay 16-byte aligned
        _fail(op, "w", "N (its second dimension) a multiple of 8", n)
    kb, nb = -(-k // _SCALE_BLOCK), -(-n // _SCALE_BLOCK)
    _check_tensor(op, "a", a, (_FP8,), (None, k), w.device)
    m = _shape(a)[0]
    _check_tensor(op, "w_scales", w_scales, ("float32",), (groups, nb, kb), w.device)
    # a_scales: any strides (row- or column-major; torch's are never negative).
    _check_tensor(op, "a_scales", a_scales, ("float32",), (m, kb), w.device, contiguous=False)
    _check_tensor(op, "offsets", offsets, ("int32", "int64"), (groups + 1,), w.device)
    return dict(m=m, n=n, k=k, groups=groups, offsets_dtype=torch_dtype_name(offsets.dtype))


def _check_fp8_weights_and_ids(op, method, methods, w, w_scales, topk_ids, world_size, rank) -> dict:
    """The checks both FP8 projections start with: method, the e4m3 weights w [E, N, K] and their scales,
    the ids [M, topk]."""
    _check_method(op, method, methods)
    _check_tensor(op, "w", w, (_FP8,), (None, None, None), None)
    experts, n, k = _shape(w)
    if k % 16 != 0 or k == 0:
        _fail(op, "w", "K (its last dimension) a positive multiple of 16", k)
    if n % 8 != 0:
        _fail(op, "w", "N (its second dimension) a multiple of 8", n)
    kb, nb = -(-k // _SCALE_BLOCK), -(-n // _SCALE_BLOCK)
    _check_tensor(op, "w_scales", w_scales, ("float32",), (experts, nb, kb), w.device)
    _check_tensor(op, "topk_ids", topk_ids, ("int32", "int64"), (None, None), w.device)
    m, topk = _shape(topk_ids)
    _C.moe_check_routing(m, topk, experts, world_size, rank)
    return dict(m=m, n=n, k=k, kb=kb, experts=experts, topk=topk, dtype="e4m3")


def check_ag_fp8_args(x_rows, x_scales, topk_ids, w, w_scales, method="auto", world_size=1, rank=0) -> dict:
    """Shapes, dtypes and devices of a moe_ag_group_gemm_fp8 call; raises tdist.Error naming the argument."""
    op = "moe_ag_group_gemm_fp8"
    s = _check_fp8_weights_and_ids(op, method, AG_FP8_METHODS, w, w_scales, topk_ids, world_size, rank)
    k, kb = s["k"], s["kb"]
    rows = rows_of(s["m"], world_size, rank)[1]
    _check_tensor(op, "x_rows", x_rows, (_FP8,), (rows, k), w.device)
    _check_tensor(op, "x_scales", x_scales, ("float32",), (rows, kb), w.device, contiguous=False)
    return s


def check_rs_fp8_args(h, h_scales, w, w_scales, topk_ids, topk_weights, method="auto", world_size=1, rank=0) -> dict:
    """Shapes, dtypes and devices of a moe_group_gemm_rs_fp8 / _ar_fp8 call; raises tdist.Error naming the
    argument."""
    op = "moe_group_gemm_rs_fp8"
    s = _check_fp8_weights_and_ids(op, method, RS_FP8_METHODS, w, w_scales, topk_ids, world_size, rank)
    _check_tensor(op, "topk_weights", topk_weights, ("float32",), (s["m"], s["topk"]), w.device)
    cap = capacity(s["m"], s["topk"], s["experts"])
    _check_tensor(op, "h", h, (_FP8,), (cap, s["k"]), w.device)
    _check_tensor(op, "h_scales", h_scales, ("float32",), (cap, s["kb"]), w.device, contiguous=False)
    return s


def _scale_strides(scales):
    """(scales, row stride, kb stride) for the C++ side, where strides (0, 0) mean row-major: a broadcast
    scale is made contiguous first."""
    row_stride, kb_stride = scales.stride()
    if row_stride == 0 and kb_stride == 0:
        scales = scales.contiguous()
        row_stride, kb_stride = scales.stride()
    return scales, row_stride, kb_stride


def _grouped_gemm_fp8(a, a_scales, w, w_scales, offsets):
    torch = torch_module()
    s = check_grouped_gemm_fp8_args(a, a_scales, w, w_scales, offsets)
    d = torch.empty((s["m"], s["n"]), dtype=torch.bfloat16, device=w.device)
    if s["m"] == 0 or s["n"] == 0:
        return d
    a_scales, row_stride, kb_stride = _scale_strides(a_scales)
    _C.grouped_gemm_fp8(a.data_ptr(), a_scales.data_ptr(), row_stride, kb_stride, w.data_ptr(), w_scales.data_ptr(),
                        d.data_ptr(), offsets.data_ptr(), s["offsets_dtype"], s["m"], s["n"], s["k"], s["groups"],
                        w.device.index, raw_stream(w.device.index))
    return d


def _to_e4m3(torch, blocks, block_dims):
    """e4m3 of fp32 `blocks` (scale blocks along `block_dims`) and the blocks' scales, amax / 448 (the
    largest magnitude of a block maps to 448; an all-zero block gets a tiny positive scale)."""
    # times the reciprocal, as the kernel (kernels/gemm/fp8_quantize.cuh) and torch's division by a scalar
    scales = blocks.abs().amax(dim=block_dims, keepdim=True).clamp(min=1e-12) * (1.0 / _FP8_MAX)
    q = (blocks / scales).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales.squeeze(block_dims)


def _quantize_rows_torch(torch, x):
    """quantize_fp8_rows in torch ops (any device and float type)."""
    m, k = x.shape
    kb = -(-k // _SCALE_BLOCK)
    blocks = torch.nn.functional.pad(x.float(), (0, kb * _SCALE_BLOCK - k)).view(m, kb, _SCALE_BLOCK)
    q, scales = _to_e4m3(torch, blocks, (2,))
    return q.view(m, kb * _SCALE_BLOCK)[:, :k].contiguous(), scales


def _empty_scales(torch, like, m: int, kb: int, column_major: bool):
    """f32 [m, kb] on like's device: row-major, or column-major with rows padded to a multiple of 4
    (strides (1, m rounded up to 4): the layout whose tiles the FP8 grouped GEMM copies in one piece)."""
    if not column_major:
        return like.new_empty((m, kb), dtype=torch.float32)
    return like.new_empty_strided((m, kb), (1, -(-max(m, 1) // 4) * 4), dtype=torch.float32)


_QUANTIZE_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def _quantize(x, swiglu: bool, column_major: bool):
    """(q, scales) of x's rows, or with swiglu of SiLU(x[:, :k]) * x[:, k:] (fp32), k = x's columns / 2,
    the scales in _empty_scales's layout:
    tdist's kernel (tdist/ops/grouped_gemm.hpp, quantize_fp8_rows) where it takes x (a CUDA tensor of
    bf16, fp16 or fp32 with unit column stride, 16-byte aligned rows, k a multiple of 16), else torch
    ops with the same arithmetic."""
    torch = torch_module()
    m, k = x.shape[0], x.shape[1] // 2 if swiglu else x.shape[1]
    name = torch_dtype_name(x.dtype)
    if (x.is_cuda and name in _QUANTIZE_DTYPES and k > 0 and k % 16 == 0 and x.stride(1) == 1
            and (m <= 1 or x.stride(0) % 8 == 0) and x.data_ptr() % 16 == 0):
        q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
        scales = _empty_scales(torch, x, m, -(-k // _SCALE_BLOCK), column_major)
        ldx = x.stride(0) if m > 1 else (2 * k if swiglu else k)
        _C.quantize_fp8(x.data_ptr(), _QUANTIZE_DTYPES[name], ldx, q.data_ptr(), scales.data_ptr(), *scales.stride(),
                        m, k, swiglu, x.device.index, raw_stream(x.device.index))
        return q, scales
    if swiglu:
        gate, up = x[:, :k].float(), x[:, k:2 * k].float()
        x = gate / (1.0 + torch.exp(-gate)) * up
    q, scales = _quantize_rows_torch(torch, x)
    if column_major:
        scales = _empty_scales(torch, scales, *scales.shape, True).copy_(scales)
    return q, scales


def _quantize_op(name: str, x, swiglu: bool, column_major: bool):
    """The public quantisers' call: x checked, then tdist's kernel or torch ops eagerly, else through
    torch.ops.tdist.<name> (compile, meta and autograd-watched tensors)."""
    op = f"moe.{name}"
    torch = _torch(op)
    _check_quantize_input(op, x, swiglu)
    if _eager(x):
        return _quantize(x, swiglu, column_major)
    return getattr(torch.ops.tdist, name)(x, column_major)


def _check_quantize_input(op: str, x, swiglu: bool):
    if x.dim() != 2:
        _fail(op, "h13" if swiglu else "x", "a 2-D tensor [M, 2 F] (gate, up)" if swiglu else "a 2-D tensor [M, K]",
              list(x.shape))
    if swiglu and x.shape[1] % 2:
        _fail(op, "h13", "an even number of columns (gate, then up)", list(x.shape))
    if not x.dtype.is_floating_point:
        _fail(op, "h13" if swiglu else "x", "a floating-point tensor", torch_dtype_name(x.dtype))


def quantize_fp8_rows(x, *, column_major: bool = False):
    """e4m3 [M, K] and f32 scales [M, ceil(K / 128)] of x [M, K] (any float type): one scale per row and
    128 columns, amax / 448, so that x ~ q * scale (grouped_gemm_fp8's A). One pass of tdist's kernel
    on a CUDA tensor of bf16, fp16 or fp32 with K a multiple of 16 (rows of unit column stride);
    torch ops with the same arithmetic otherwise (the same bits). column_major: the scales [M, ceil(K / 128)]
    with strides (1, M rounded up to 4), which grouped_gemm_fp8 and moe_group_gemm_rs_fp8 read faster
    (a tile's scales in one copy). torch.ops.tdist.quantize_fp8_rows."""
    return _quantize_op("quantize_fp8_rows", x, False, column_major)


def swiglu_quantize_fp8(h13, *, column_major: bool = False):
    """quantize_fp8_rows of SiLU(gate) * up, computed in fp32, for h13 = [gate | up] [M, 2 F] (the first
    projection's output): e4m3 [M, F] and f32 [M, ceil(F / 128)], in one pass that reads h13 once
    (tdist's kernel where quantize_fp8_rows's runs), the scales column-major with column_major (as
    quantize_fp8_rows's). The input of moe_group_gemm_rs_fp8. torch.ops.tdist.swiglu_quantize_fp8."""
    return _quantize_op("swiglu_quantize_fp8", h13, True, column_major)


def quantize_fp8_blocks(w):
    """e4m3 [G, N, K] and f32 scales [G, ceil(N / 128), ceil(K / 128)] of w [G, N, K] (or [N, K], taken
    as G = 1): one scale per 128 x 128 block, amax / 448 (grouped_gemm_fp8's weights)."""
    torch = _torch("moe.quantize_fp8_blocks")
    if w.dim() == 2:
        w = w[None]
    if w.dim() != 3:
        _fail("moe.quantize_fp8_blocks", "w", "a 3-D tensor [G, N, K]", list(w.shape))
    g, n, k = w.shape
    nb, kb = -(-n // _SCALE_BLOCK), -(-k // _SCALE_BLOCK)
    padded = torch.nn.functional.pad(w.float(), (0, kb * _SCALE_BLOCK - k, 0, nb * _SCALE_BLOCK - n))
    q, scales = _to_e4m3(torch, padded.view(g, nb, _SCALE_BLOCK, kb, _SCALE_BLOCK), (2, 4))
    return q.view(g, nb * _SCALE_BLOCK, kb * _SCALE_BLOCK)[:, :n, :k].contiguous(), scales


def _context(kind: str, s: dict, rt):
    """The live runtime's context for this call, made or grown (collectively) when the call needs it."""
    torch = torch_module()
    for key in [key for key, (r, _) in _contexts.items() if r is not rt]:  # a finalised runtime's: closed with it
        _contexts.pop(key)
    key = (kind, s["dtype"], s["experts"], s["topk"], s["k"] if kind == "ag" else 0)
    entry = _contexts.get(key)
    ctx = entry[1] if entry is not None else None
    fits = ctx is not None and s["m"] <= ctx.max_m and (kind == "ag" or s["n"] <= ctx.max_n)
    if fits:
        return ctx
    max_m = _grown_max_m(torch, "tdist.moe", "context", s["m"], ctx.max_m if ctx is not None else 0)
    if ctx is not None:
        ctx.close()
    if kind == "ag":
        ctx = _C.MoeAgGroupGemm(rt, max_m, s["k"], s["experts"], s["topk"], s["dtype"])
    else:
        max_n = max(s["n"], ctx.max_n if ctx is not None else 0)
        ctx = _C.MoeGroupGemmRs(rt, max_m, max_n, s["experts"], s["topk"], s["dtype"])
    _contexts[key] = (rt, ctx)
    return ctx


def _ids32(topk_ids):
    torch = torch_module()
    return (topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)).contiguous()


def _ag(x_rows, topk_ids, w, method):
    from ._runtime import runtime

    torch = torch_module()
    rt = runtime("moe_ag_group_gemm")
    s = check_ag_args(x_rows, topk_ids, w, method, rt.world_size, rt.rank)
    d = torch.empty((capacity(s["m"], s["topk"], s["experts"]), s["n"]), dtype=w.dtype, device=w.device)
    if s["m"] == 0 or s["n"] == 0:
        return d
    ids = _ids32(topk_ids)
    ctx = _context("ag", s, rt)
    ctx.run(x_rows.data_ptr(), ids.data_ptr(), w.data_ptr(), d.data_ptr(), s["m"], s["n"],
            raw_stream(w.device.index), method)
    return d


def _ag_fp8(x_rows, x_scales, topk_ids, w, w_scales, method):
    from ._runtime import runtime

    torch = torch_module()
    rt = runtime("moe_ag_group_gemm_fp8")
    s = check_ag_fp8_args(x_rows, x_scales, topk_ids, w, w_scales, method, rt.world_size, rt.rank)
    d = torch.empty((capacity(s["m"], s["topk"], s["experts"]), s["n"]), dtype=torch.bfloat16, device=w.device)
    if s["m"] == 0 or s["n"] == 0:
        return d
    ids = _ids32(topk_ids)
    x_scales = x_scales.contiguous()  # row-major: a token's scales travel with its row, as bytes
    ctx = _context("ag", s, rt)
    ctx.run(x_rows.data_ptr(), ids.data_ptr(), w.data_ptr(), d.data_ptr(), s["m"], s["n"],
            raw_stream(w.device.index), method, True, x_scales.data_ptr(), w_scales.data_ptr())
    return d


def _rs(h, w, topk_ids, topk_weights, method, all_reduce):
    from ._runtime import runtime

    torch = torch_module()
    rt = runtime("moe_group_gemm_rs")
    s = check_rs_args(h, w, topk_ids, topk_weights, method, rt.world_size, rt.rank)
    rows = s["m"] if all_reduce else rows_of(s["m"], rt.world_size, rt.rank)[1]
    d = torch.empty((rows, s["n"]), dtype=w.dtype, device=w.device)
    if s["m"] == 0 or s["n"] == 0:
        return d
    ids = _ids32(topk_ids)
    ctx = _context("rs", s, rt)
    ctx.run(h.data_ptr(), w.data_ptr(), ids.data_ptr(), topk_weights.data_ptr(), d.data_ptr(), s["m"], s["n"], s["k"],
            raw_stream(w.device.index), method, all_reduce)
    return d


def _rs_fp8(h, h_scales, w, w_scales, topk_ids, topk_weights, method, all_reduce):
    from ._runtime import runtime

    torch = torch_module()
    rt = runtime("moe_group_gemm_rs_fp8")
    s = check_rs_fp8_args(h, h_scales, w, w_scales, topk_ids, topk_weights, method, rt.world_size, rt.rank)
    rows = s["m"] if all_reduce else rows_of(s["m"], rt.world_size, rt.rank)[1]
    d = torch.empty((rows, s["n"]), dtype=torch.bfloat16, device=w.device)
    if s["m"] == 0 or s["n"] == 0:
        return d
    ids = _ids32(topk_ids)
    ctx = _context("rs", s, rt)
    h_scales, row_stride, kb_stride = _scale_strides(h_scales)
    ctx.run(h.data_ptr(), w.data_ptr(), ids.data_ptr(), topk_weights.data_ptr(), d.data_ptr(), s["m"], s["n"], s["k"],
            raw_stream(w.device.index), method, all_reduce, True, h_scales.data_ptr(), w_scales.data_ptr(),
            row_stride, kb_stride)
    return d


def _register(torch):
    from typing import Tuple

    from torch import Tensor

    def ag(x_rows: Tensor, topk_ids: Tensor, w: Tensor, method: str = "auto") -> Tensor:
        return _ag(x_rows, topk_ids, w, method)

    def ag_fake(x_rows, topk_ids, w, method="auto"):
        from ._runtime import runtime

        rt = runtime("moe_ag_group_gemm")
        s = check_ag_args(x_rows, topk_ids, w, method, rt.world_size, rt.rank)
        return w.new_empty((capacity(s["m"], s["topk"], s["experts"]), s["n"]))

    def ag_fp8(x_rows: Tensor, x_scales: Tensor, topk_ids: Tensor, w: Tensor, w_scales: Tensor,
               method: str = "auto") -> Tensor:
        return _ag_fp8(x_rows, x_scales, topk_ids, w, w_scales, method)

    def ag_fp8_fake(x_rows, x_scales, topk_ids, w, w_scales, method="auto"):
        from ._runtime import runtime

        rt = runtime("moe_ag_group_gemm_fp8")
        s = check_ag_fp8_args(x_rows, x_scales, topk_ids, w, w_scales, method, rt.world_size, rt.rank)
        return w.new_empty((capacity(s["m"], s["topk"], s["experts"]), s["n"]), dtype=torch.bfloat16)

    def rs(h: Tensor, w: Tensor, topk_ids: Tensor, topk_weights: Tensor, method: str = "auto",
           all_reduce: bool = False) -> Tensor:
        return _rs(h, w, topk_ids, topk_weights, method, all_reduce)

    def rs_fake(h, w, topk_ids, topk_weights, method="auto", all_reduce=False):
        from ._runtime import runtime

        rt = runtime("moe_group_gemm_rs")
        s = check_rs_args(h, w, topk_ids, topk_weights, method, rt.world_size, rt.rank)
        rows = s["m"] if all_reduce else rows_of(s["m"], rt.world_size, rt.rank)[1]
        return w.new_empty((rows, s["n"]))

    def rs_fp8(h: Tensor, h_scales: Tensor, w: Tensor, w_scales: Tensor, topk_ids: Tensor, topk_weights: Tensor,
               method: str = "auto", all_reduce: bool = False) -> Tensor:
        return _rs_fp8(h, h_scales, w, w_scales, topk_ids, topk_weights, method, all_reduce)

    def rs_fp8_fake(h, h_scales, w, w_scales, topk_ids, topk_weights, method="auto", all_reduce=False):
        from ._runtime import runtime

        rt = runtime("moe_group_gemm_rs_fp8")
        s = check_rs_fp8_args(h, h_scales, w, w_scales, topk_ids, topk_weights, method, rt.world_size, rt.rank)
        rows = s["m"] if all_reduce else rows_of(s["m"], rt.world_size, rt.rank)[1]
        return w.new_empty((rows, s["n"]), dtype=torch.bfloat16)

    def gg(a: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
        return _grouped_gemm(a, w, offsets)

    def gg_fake(a, w, offsets):
        s = check_grouped_gemm_args(a, w, offsets)
        return w.new_empty((s["m"], s["n"]))

    def gg_fp8(a: Tensor, a_scales: Tensor, w: Tensor, w_scales: Tensor, offsets: Tensor) -> Tensor:
        return _grouped_gemm_fp8(a, a_scales, w, w_scales, offsets)

    def gg_fp8_fake(a, a_scales, w, w_scales, offsets):
        s = check_grouped_gemm_fp8_args(a, a_scales, w, w_scales, offsets)
        return w.new_empty((s["m"], s["n"]), dtype=torch.bfloat16)

    def quantize(x: Tensor, column_major: bool = False) -> Tuple[Tensor, Tensor]:
        return _quantize(x, False, column_major)

    def swiglu_quantize(h13: Tensor, column_major: bool = False) -> Tuple[Tensor, Tensor]:
        return _quantize(h13, True, column_major)

    def quantized(x, k, column_major):  # the quantisers' outputs for x's rows, k columns
        m = x.shape[0]
        return (x.new_empty((m, k), dtype=torch.float8_e4m3fn),
                _empty_scales(torch, x, m, -(-k // _SCALE_BLOCK), column_major))

    def quantize_fake(x, column_major=False):
        return quantized(x, x.shape[1], column_major)

    def swiglu_quantize_fake(h13, column_major=False):
        return quantized(h13, h13.shape[1] // 2, column_major)

    ops = []
    for name, fn, fake in (("tdist::quantize_fp8_rows", quantize, quantize_fake),
                           ("tdist::swiglu_quantize_fp8", swiglu_quantize, swiglu_quantize_fake),
                           ("tdist::moe_ag_group_gemm", ag, ag_fake),
                           ("tdist::moe_ag_group_gemm_fp8", ag_fp8, ag_fp8_fake),
                           ("tdist::moe_group_gemm_rs", rs, rs_fake),
                           ("tdist::moe_group_gemm_rs_fp8", rs_fp8, rs_fp8_fake),
                           ("tdist::grouped_gemm", gg, gg_fake), ("tdist::grouped_gemm_fp8", gg_fp8, gg_fp8_fake)):
        op = torch.library.custom_op(name, mutates_args=())(fn)
        op.register_fake(fake)
        ops.append(op)
    return ops


_ops = _register(torch_module()) if torch_module() is not None else None


def _torch(op: str):
    torch = torch_module()
    if torch is None:
        raise Error(f"tdist.{op} needs PyTorch, which is not installed")
    return torch


def _eager(*tensors) -> bool:
    """Whether a call may skip torch.library's dispatch and run the implementation directly: the eager
    path of python/tdist/_torch_ops.py (no compile, mode, profiler, functorch or autograd watching;
    plain tensors or Parameters), on CUDA tensors (meta ones go to the ops' fake implementations)."""
    from ._torch_ops import eager

    return eager(*tensors) and all(t.is_cuda for t in tensors)


def moe_ag_group_gemm(x_rows, topk_ids, w, *, method: str = "auto"):
    """AllGather of every rank's tokens + grouped GEMM: T [capacity(M, topk, E), N] in expert order
    (see the module's docstring). Collective."""
    torch = _torch("moe_ag_group_gemm")
    if _eager(x_rows, topk_ids, w):
        return _ag(x_rows, topk_ids, w, method)
    return torch.ops.tdist.moe_ag_group_gemm(x_rows, topk_ids, w, method)


def moe_ag_group_gemm_fp8(x_rows, x_scales, topk_ids, w, w_scales, *, method: str = "auto"):
    """moe_ag_group_gemm on e4m3 tokens and weights with their block scales (quantize_fp8_rows of this
    rank's tokens, quantize_fp8_blocks of its weight shard): bf16 [capacity(M, topk, E), N] in expert
    order. Each token's e4m3 row travels with its scales (any strides; column-major ones are copied to
    row-major first); methods 'auto', 'fused', 'chunked', 'baseline'.
    Inference only (no autograd). Collective."""
    torch = _torch("moe_ag_group_gemm_fp8")
    if _eager(x_rows, x_scales, topk_ids, w, w_scales):
        return _ag_fp8(x_rows, x_scales, topk_ids, w, w_scales, method)
    return torch.ops.tdist.moe_ag_group_gemm_fp8(x_rows, x_scales, topk_ids, w, w_scales, method)


def moe_group_gemm_rs(h, w, topk_ids, topk_weights, *, method: str = "auto"):
    """Grouped GEMM + top-k weighted reduce + ReduceScatter: T [rows(rank), N], this rank's tokens.
    h: T [capacity(M, topk, E), K] in expert order (moe_ag_group_gemm's rows). Collective."""
    torch = _torch("moe_group_gemm_rs")
    if _eager(h, w, topk_ids, topk_weights):
        return _rs(h, w, topk_ids, topk_weights, method, False)
    return torch.ops.tdist.moe_group_gemm_rs(h, w, topk_ids, topk_weights, method, False)


def moe_group_gemm_rs_fp8(h, h_scales, w, w_scales, topk_ids, topk_weights, *, method: str = "auto"):
    """moe_group_gemm_rs on e4m3 h and weights with their block scales (quantize_fp8_rows of h in expert
    order, quantize_fp8_blocks of this rank's w2 shard; h_scales row- or column-major, the latter read
    faster, as swiglu_quantize_fp8(column_major=True) makes them): bf16 [rows(rank), N]. The products, their
    top-k sum and the ReduceScatter are bf16; methods 'auto', 'chunked', 'baseline'. Inference only.
    Collective."""
    torch = _torch("moe_group_gemm_rs_fp8")
    if _eager(h, h_scales, w, w_scales, topk_ids, topk_weights):
        return _rs_fp8(h, h_scales, w, w_scales, topk_ids, topk_weights, method, False)
    return torch.ops.tdist.moe_group_gemm_rs_fp8(h, h_scales, w, w_scales, topk_ids, topk_weights, method, False)


def moe_group_gemm_ar_fp8(h, h_scales, w, w_scales, topk_ids, topk_weights):
    """moe_group_gemm_ar on e4m3 operands (as moe_group_gemm_rs_fp8): bf16 [M, N] on every rank. Collective."""
    torch = _torch("moe_group_gemm_ar_fp8")
    if _eager(h, h_scales, w, w_scales, topk_ids, topk_weights):
        return _rs_fp8(h, h_scales, w, w_scales, topk_ids, topk_weights, "auto", True)
    return torch.ops.tdist.moe_group_gemm_rs_fp8(h, h_scales, w, w_scales, topk_ids, topk_weights, "auto", True)


def moe_group_gemm_ar(h, w, topk_ids, topk_weights):
    """Grouped GEMM + top-k weighted reduce + AllReduce: T [M, N], every token on every rank (decode).
    Collective."""
    torch = _torch("moe_group_gemm_ar")
    if _eager(h, w, topk_ids, topk_weights):
        return _rs(h, w, topk_ids, topk_weights, "auto", True)
    return torch.ops.tdist.moe_group_gemm_rs(h, w, topk_ids, topk_weights, "auto", True)


def grouped_gemm(a, w, offsets):
    """T [M_total, N]: rows [offsets[g], offsets[g + 1]) of a times w[g]^T for every group g; rows past
    offsets[G] are not written (see the module's docstring). One GPU, not collective."""
    torch = _torch("moe.grouped_gemm")
    if _eager(a, w, offsets):
        return _grouped_gemm(a, w, offsets)
    return torch.ops.tdist.grouped_gemm(a, w, offsets)


def grouped_gemm_fp8(a, a_scales, w, w_scales, offsets):
    """bf16 [M_total, N]: the FP8 grouped GEMM of e4m3 a and w with their block scales (see the module's
    docstring; quantize_fp8_rows / quantize_fp8_blocks make them). One GPU, not collective."""
    torch = _torch("moe.grouped_gemm_fp8")
    if _eager(a, a_scales, w, w_scales, offsets):
        return _grouped_gemm_fp8(a, a_scales, w, w_scales, offsets)
    return torch.ops.tdist.grouped_gemm_fp8(a, a_scales, w, w_scales, offsets)


def check_errors() -> None:
    """Synchronises and raises tdist.Error naming topk_ids if a call of an MoE op since the last check
    met an expert id outside [0, E) (the first one: its token, slot and value). Not collective."""
    from ._runtime import runtime

    rt = runtime("moe.check_errors")
    for r, ctx in list(_contexts.values()):
        if r is rt and not ctx.closed:
            ctx.check_errors()
    for router in list(_routers.values()):  # tdist.moe.routing's (the ops' backward)
        router.check_errors()


def method(m: int, world_size: int) -> str:
    """The method 'auto' runs for m tokens on world_size ranks."""
    return _C.moe_method(int(m), int(world_size))
