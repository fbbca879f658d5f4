"""Expert-parallel all-to-all for MoE layers (tdist::EpBuffer, docs/ep.md), on torch tensors.

    buf = tdist.ep.Buffer(None, max_tokens_per_rank=128, hidden=7168, num_experts=256, topk=8)
    recv_x, recv_scales, recv_count, handle, hook = buf.low_latency_dispatch(x, topk_idx, use_fp8=True)
    # local expert e: rows recv_x[e, :recv_count[e]] (recv_scales: one fp32 scale per 128 channels)
    out = buf.low_latency_combine(y, topk_idx, topk_weights, handle)   # y: [L, W * M, hidden] bf16

    ht = tdist.ep.Buffer(None, 4096, 7168, 256, 8, mode="high_throughput")
    expert_x, handle = ht.dispatch(x, topk_idx, topk_weights)          # expert-major rows, padded
    out = ht.combine(y, handle)                                        # y: expert outputs, expert_x's rows

Shapes (T tokens of this rank, H hidden, W ranks, M = max_tokens_per_rank, L = num_experts / W local
experts): x bf16 [T, H]; topk_idx int64 [T, topk] (-1 masks a slot; torch.topk's dtype);
topk_weights float32 [T, topk]. Low latency: recv_x [L, W * M, H] bf16 (float8_e4m3fn with use_fp8),
recv_scales float32 [L, W * M, H / 128] or None, recv_count int32 [L], handle.recv_route int32
[L, W * M] ((src_rank * M + token) * topk + slot); out bf16 [T, H] = sum over valid slots j of
topk_weights[t, j] * y(row of (t, j)). A slot is sent when its id is in [0, num_experts) and no earlier
slot of the token holds the same id.

Every call runs on torch's current stream, on the buffer's device, and is collective: every rank makes
the same sequence of calls. The low-latency pair does no host synchronisation and is registered as
torch.ops.tdist.ep_ll_dispatch / ep_ll_combine (fake implementations for torch.compile); a CUDA graph
of it replays with fresh routing. The returned tensors are views of the buffer's memory: a
low-latency dispatch's outputs stay valid until the dispatch two calls later, a high-throughput
dispatch's until the next one. return_recv_hook=True launches only the sends; calling the returned
hook launches the receive (on the current stream), and the outputs (or combine's out) are complete
after it in stream order.

High throughput: dispatch runs the layout step on the GPU and sizes its outputs for the worst case
(no host synchronisation unless sync_counts=True, which fills handle.num_recv and the expert counts).
handle.info (int32, on the device) holds [compact rows, expert-major rows, L counts, L + 1 offsets].
combine(y, handle) takes expert outputs in expert_x's rows (each token's local slots summed with
their weights on the expert's rank, then summed over ranks); combine(None, handle, y_compact=g)
sends compact rows as they are (dispatch's backward: a token's gradient is the sum of its copies').
No torch.autograd.Function: a backward would combine with a handle of an earlier layer's dispatch,
and a buffer keeps only its last one (see docs/ep.md).

Expert ids outside [-1, num_experts) and repeats within a token are skipped and recorded on the
device; check_errors() synchronises and raises tdist.Error naming topk_idx.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the annotations as types.
import itertools

from . import _C
from ._tensors import Error, check_tensor_kind, torch_module

_MODES = ("low_latency", "high_throughput")
_buffers = {}  # id -> Buffer, while open (torch.library ops name a buffer by its id)
_ids = itertools.count(1)


def _fail(op: str, name: str, expected: str, got) -> None:
    raise Error(f"tdist.ep.{op}: invalid argument '{name}': expected {expected}, got {got}")


def _stream(device: int) -> int:
    return torch_module().cuda.current_stream(device).cuda_stream


def heap_bytes(max_tokens_per_rank: int, hidden: int, num_experts: int, topk: int, world_size: int, *,
               mode: str = "low_latency", num_sms: int = 0, expert_alignment: int = 128) -> int:
    """Symmetric bytes per rank a Buffer of this configuration takes; raises tdist.Error naming a bad field."""
    if mode not in _MODES:
        _fail("Buffer", "mode", "'low_latency' or 'high_throughput'", repr(mode))
    return _C.ep_check_config(int(max_tokens_per_rank), int(hidden), int(num_experts), int(topk), int(num_sms), mode,
                              int(expert_alignment), int(world_size))


def count_tokens(topk_idx, num_experts: int, world_size: int) -> tuple:
    """The layout step's rule on the host: (tokens sent to each rank, rows sent to each expert)."""
    ids = [int(v) for row in topk_idx.tolist() for v in row] if hasattr(topk_idx, "tolist") else \
        [int(v) for row in topk_idx for v in row]
    rows = len(topk_idx)
    topk = len(ids) // rows if rows else 1
    return _C.ep_count_tokens(ids, rows, topk, int(num_experts), int(world_size))


class LowLatencyHandle:
    """What a low-latency dispatch returns for its combine (valid until the dispatch two calls later)."""

    __slots__ = ("buffer_id", "seq", "num_tokens", "fp8", "recv_count", "recv_route")

    def __init__(self, buffer_id, seq, num_tokens, fp8, recv_count, recv_route):
        self.buffer_id, self.seq, self.num_tokens, self.fp8 = buffer_id, seq, num_tokens, fp8
        self.recv_count, self.recv_route = recv_count, recv_route


class HighThroughputHandle:
    """What a high-throughput dispatch returns for its combine (valid until the next dispatch).

    recv_x [R, H] compact rows (one per received token, source after source), recv_src [R]
    (src_rank * M + token), recv_topk_idx [R, topk] (local expert, -1 elsewhere), recv_topk_weights
    [R, topk], recv_expert_row [R, topk] (the slot's expert-major row, -1 elsewhere), expert_x [X, H],
    expert_src [X] (compact row, -1 for padding), info [3 + 2L]; num_recv, num_expert_rows,
    expert_counts, expert_offsets on the host with sync_counts (else -1 and [])."""

    def __init__(self, buffer_id, call, num_tokens, fields: dict):
        self.buffer_id, self.call, self.num_tokens = buffer_id, call, num_tokens
        for k, v in fields.items():
            setattr(self, k, v)


class Buffer:
    """An EpBuffer on tdist's symmetric heap (collective: every rank creates it alike, after tdist.init).

    group: None (tdist's world) or a torch.distributed group of the same ranks. max_tokens_per_rank:
    tokens per rank and call, at most. hidden: a multiple of 8 (of 128 for FP8 dispatch). num_experts:
    a multiple of the world size. topk: 1 .. 32. mode: 'low_latency' (decode) or 'high_throughput'
    (prefill, training). num_sms: blocks of the send kernels (0: the mode's default).
    expert_alignment: rows of each expert in high-throughput expert_x padded to it.
    close() (collective) returns the memory; tdist.finalize closes every buffer."""

    def __init__(self, group=None, max_tokens_per_rank: int = 128, hidden: int = 7168, num_experts: int = 256,
                 topk: int = 8, *, mode: str = "low_latency", num_sms: int = 0, expert_alignment: int = 128):
        from ._runtime import runtime

        torch = torch_module()
        if torch is None:
            raise Error("tdist.ep.Buffer needs PyTorch, which is not installed")
        rt = runtime("ep.Buffer")
        if group is not None:
            import torch.distributed as dist
            size = dist.get_world_size(group)
            if size != rt.world_size:
                _fail("Buffer", "group", f"tdist's world of {rt.world_size} ranks (tdist.init's group)",
                      f"a group of {size}")
        heap_bytes(max_tokens_per_rank, hidden, num_experts, topk, rt.world_size, mode=mode, num_sms=num_sms,
                   expert_alignment=expert_alignment)
        self.max_tokens, self.hidden, self.num_experts, self.topk = (int(max_tokens_per_rank), int(hidden),
                                                                     int(num_experts), int(topk))
        self.mode, self.expert_alignment = mode, int(expert_alignment)
        self.world_size, self.rank, self.device = rt.world_size, rt.rank, rt.device
        self.num_local_experts = self.num_experts // self.world_size
        self._op = _C.EpBuffer(rt, self.max_tokens, self.hidden, self.num_experts, self.topk, int(num_sms), mode,
                               self.expert_alignment)
        self.id = next(_ids)
        _buffers[self.id] = self

    def close(self) -> None:
        """Collective: return the buffer's symmetric memory; its tensors must not be used afterwards."""
        _buffers.pop(self.id, None)
        self._op.close()

    # --- argument checks (the C++ checks then check what these leave: alignment, sizes) ---------------

    def _tensor(self, op, name, t, dtypes, dims):
        check_tensor_kind(lambda *a: _fail(op, *a), name, t, dtypes, dims)
        if t.device.type not in ("cuda", "meta") or (t.device.type == "cuda" and t.device.index != self.device):
            _fail(op, name, f"a tensor on the buffer's device cuda:{self.device}", t.device)
        if not t.is_contiguous():
            _fail(op, name, "a contiguous tensor", f"strides {tuple(t.stride())}")

    def _check_tokens(self, op, x, topk_idx, topk_weights=None):
        self._tensor(op, "x", x, ("bfloat16",), (None, self.hidden))
        tokens = int(x.shape[0])
        if tokens > self.max_tokens:
            _fail(op, "x", f"at most max_tokens_per_rank={self.max_tokens} rows", tokens)
        self._tensor(op, "topk_idx", topk_idx, ("int64",), (tokens, self.topk))
        if topk_weights is not None:
            self._tensor(op, "topk_weights", topk_weights, ("float32",), (tokens, self.topk))
        return tokens

    def _check_mode(self, op, mode):
        if self.mode != mode:
            _fail(op, "self", f"a Buffer made with mode='{mode}'", f"mode='{self.mode}'")

    def _ll_shapes(self, fp8: bool):
        rows = self.world_size * self.max_tokens
        scales = (self.num_local_experts, rows, self.hidden // 128) if fp8 else (0,)
        return (self.num_local_experts, rows, self.hidden), scales, (self.num_local_experts,), \
            (self.num_local_experts, rows)

    # --- low latency ----------------------------------------------------------------------------------

    def low_latency_dispatch(self, x, topk_idx, *, use_fp8: bool = False, round_scale: bool = False,
                             return_recv_hook: bool = False):
        """Send each token to its experts' ranks. Returns (recv_x, recv_scales or None, recv_count, handle,
        hook or None). round_scale: FP8 scales rounded up to powers of two (UE8M0)."""
        torch = torch_module()
        self._check_mode("low_latency_dispatch", "low_latency")
        self._check_tokens("low_latency_dispatch", x, topk_idx)
        if round_scale and not use_fp8:
            _fail("low_latency_dispatch", "round_scale", "use_fp8=True (UE8M0 scales are FP8 scales)", True)
        recv_x, recv_scales, recv_count, recv_route, meta = torch.ops.tdist.ep_ll_dispatch(
            self.id, x, topk_idx, bool(use_fp8), bool(round_scale), bool(return_recv_hook))
        seq, hook_id = (int(v) for v in meta.tolist())
        handle = LowLatencyHandle(self.id, seq, int(x.shape[0]), bool(use_fp8), recv_count, recv_route)
        return recv_x, recv_scales if use_fp8 else None, recv_count, handle, self._hook(hook_id)

    def low_latency_combine(self, y, topk_idx, topk_weights, handle, *, return_recv_hook: bool = False,
                            out=None):
        """Bring the experts' outputs back: out[t] = sum over valid j of topk_weights[t, j] * y(row of (t, j)).
        y: bf16 [L, W * M, H], rows as the dispatch's recv_x. With return_recv_hook returns (out, hook)."""
        torch = torch_module()
        self._check_mode("low_latency_combine", "low_latency")
        if not isinstance(handle, LowLatencyHandle) or handle.buffer_id != self.id:
            _fail("low_latency_combine", "handle", "the handle of a low_latency_dispatch of this buffer",
                  type(handle).__name__)
        rows = self.world_size * self.max_tokens
        self._tensor("low_latency_combine", "y", y, ("bfloat16",), (self.num_local_experts, rows, self.hidden))
        self._tensor("low_latency_combine", "topk_idx", topk_idx, ("int64",), (handle.num_tokens, self.topk))
        self._tensor("low_latency_combine", "topk_weights", topk_weights, ("float32",),
                     (handle.num_tokens, self.topk))
        if out is not None:
            self._tensor("low_latency_combine", "out", out, ("bfloat16",), (handle.num_tokens, self.hidden))
            meta = torch.ops.tdist.ep_ll_combine_out(self.id, y, topk_idx, topk_weights, handle.recv_count, out,
                                                     handle.seq, bool(return_recv_hook))
        else:
            out, meta = torch.ops.tdist.ep_ll_combine(self.id, y, topk_idx, topk_weights, handle.recv_count,
                                                      handle.seq, bool(return_recv_hook))
        hook = self._hook(int(meta.tolist()[0]))
        return (out, hook) if return_recv_hook else out

    def _hook(self, hook_id: int):
        if hook_id == 0:
            return None
        op = self._op

        def hook():
            """Launch the receive on the current stream (once)."""
            op.run_hook(hook_id, _stream(self.device))

        return hook

    # --- high throughput ------------------------------------------------------------------------------

    def dispatch(self, x, topk_idx, topk_weights, *, sync_counts: bool = False):
        """Layout step and dispatch. Returns (expert_x, handle): expert_x bf16 [X, H], local expert e's rows
        at [offset[e], offset[e] + count[e]) (handle.info on the device, or the host lists with
        sync_counts), each expert's rows padded to expert_alignment."""
        self._check_mode("dispatch", "high_throughput")
        tokens = self._check_tokens("dispatch", x, topk_idx, topk_weights)
        r = self._op.ht_dispatch(x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), tokens, self.hidden,
                                 self.topk, bool(sync_counts), _stream(self.device))
        (call, recv_x, recv_src, recv_idx, recv_w, recv_row, expert_x, expert_src, info, max_recv, max_expert,
         num_recv, num_expert_rows, counts, offsets) = r
        torch = torch_module()
        L, H, k = self.num_local_experts, self.hidden, self.topk
        views = dict(recv_x=self._view(recv_x, (max_recv, H), torch.bfloat16),
                     recv_src=self._view(recv_src, (max_recv,), torch.int32),
                     recv_topk_idx=self._view(recv_idx, (max_recv, k), torch.int32),
                     recv_topk_weights=self._view(recv_w, (max_recv, k), torch.float32),
                     recv_expert_row=self._view(recv_row, (max_recv, k), torch.int32),
                     expert_x=self._view(expert_x, (max_expert, H), torch.bfloat16),
                     expert_src=self._view(expert_src, (max_expert,), torch.int32),
                     info=self._view(info, (3 + 2 * L,), torch.int32),
                     max_recv_rows=max_recv, max_expert_rows=max_expert, num_recv=num_recv,
                     num_expert_rows=num_expert_rows, expert_counts=list(counts), expert_offsets=list(offsets))
        handle = HighThroughputHandle(self.id, call, tokens, views)
        handle.topk_idx = topk_idx  # the combine sends each token back along the same routing
        return handle.expert_x, handle

    def combine(self, y, handle, *, y_compact=None, out=None):
        """Bring the experts' outputs back: out bf16 [T, H], each token's local slots summed with their
        weights on the expert's rank, then over ranks. y: bf16 [X, H] in expert_x's rows; or y=None and
        y_compact bf16 [R, H] in recv_x's rows, sent as they are (dispatch's backward)."""
        torch = torch_module()
        self._check_mode("combine", "high_throughput")
        if not isinstance(handle, HighThroughputHandle) or handle.buffer_id != self.id:
            _fail("combine", "handle", "the handle of a dispatch of this buffer", type(handle).__name__)
        if (y is None) == (y_compact is None):
            _fail("combine", "y", "exactly one of y (expert-major rows) and y_compact (compact rows)",
                  "both" if y is not None else "neither")
        if y is not None:
            self._tensor("combine", "y", y, ("bfloat16",), (handle.max_expert_rows, self.hidden))
        else:
            self._tensor("combine", "y_compact", y_compact, ("bfloat16",), (handle.max_recv_rows, self.hidden))
        if out is None:
            out = torch.empty((handle.num_tokens, self.hidden), dtype=torch.bfloat16,
                              device=torch.device("cuda", self.device))
        else:
            self._tensor("combine", "out", out, ("bfloat16",), (handle.num_tokens, self.hidden))
        self._op.ht_combine(0 if y is None else y.data_ptr(), 0 if y_compact is None else y_compact.data_ptr(),
                            handle.topk_idx.data_ptr(), out.data_ptr(), handle.call, _stream(self.device))
        return out

    def check_errors(self) -> None:
        """Synchronises; raises tdist.Error naming topk_idx when a call met an id out of range or repeated."""
        self._op.check_errors(_stream(self.device))

    def _view(self, ptr: int, shape: tuple, dtype):
        torch = torch_module()
        from ._tensors import dlpack_dtype

        code, bits = dlpack_dtype(dtype)
        return torch.from_dlpack(_C.device_array(ptr, list(shape), [], code, bits, self.device, self._op))


def _buffer(buffer_id: int, op: str) -> Buffer:
    b = _buffers.get(buffer_id)
    if b is None:
        _fail(op, "buffer_id", "the id of a tdist.ep.Buffer not closed", buffer_id)
    return b


def _ll_dispatch(buffer_id, x, topk_idx, fp8, ue8m0, return_hook):
    torch = torch_module()
    b = _buffer(buffer_id, "low_latency_dispatch")
    b._check_mode("low_latency_dispatch", "low_latency")
    tokens = b._check_tokens("low_latency_dispatch", x, topk_idx)
    seq, rx, rs, rc, rr, hook = b._op.ll_dispatch(x.data_ptr(), topk_idx.data_ptr(), tokens, b.hidden, b.topk, fp8,
                                                  ue8m0, return_hook, _stream(b.device))
    sx, ss, sc, sr = b._ll_shapes(fp8)
    recv_x = b._view(rx, sx, torch.uint8).view(torch.float8_e4m3fn) if fp8 else b._view(rx, sx, torch.bfloat16)
    recv_scales = b._view(rs, ss, torch.float32) if fp8 else torch.empty(ss, dtype=torch.float32, device=x.device)
    meta = torch.tensor([seq, hook], dtype=torch.int64)  # host: the handle's number and the hook's
    return recv_x, recv_scales, b._view(rc, sc, torch.int32), b._view(rr, sr, torch.int32), meta


def _ll_combine(buffer_id, y, topk_idx, topk_weights, recv_count, out, seq, return_hook):
    torch = torch_module()
    b = _buffer(buffer_id, "low_latency_combine")
    hook = b._op.ll_combine(y.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), out.data_ptr(), seq,
                            recv_count.data_ptr(), return_hook, _stream(b.device))
    return torch.tensor([hook], dtype=torch.int64)


def _register(torch):
    from typing import Tuple

    from torch import Tensor

    def dispatch(buffer_id: int, x: Tensor, topk_idx: Tensor, fp8: bool = False, ue8m0: bool = False,
                 return_hook: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return _ll_dispatch(buffer_id, x, topk_idx, fp8, ue8m0, return_hook)

    def dispatch_fake(buffer_id, x, topk_idx, fp8=False, ue8m0=False, return_hook=False):
        b = _buffer(buffer_id, "low_latency_dispatch")
        b._check_tokens("low_latency_dispatch", x, topk_idx)
        sx, ss, sc, sr = b._ll_shapes(fp8)
        return (x.new_empty(sx, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16),
                x.new_empty(ss, dtype=torch.float32), x.new_empty(sc, dtype=torch.int32),
                x.new_empty(sr, dtype=torch.int32), torch.empty((2,), dtype=torch.int64, device="cpu"))

    def combine(buffer_id: int, y: Tensor, topk_idx: Tensor, topk_weights: Tensor, recv_count: Tensor, seq: int,
                return_hook: bool = False) -> Tuple[Tensor, Tensor]:
        out = torch.empty((topk_idx.shape[0], y.shape[-1]), dtype=torch.bfloat16, device=y.device)
        return out, _ll_combine(buffer_id, y, topk_idx, topk_weights, recv_count, out, seq, return_hook)

    def combine_fake(buffer_id, y, topk_idx, topk_weights, recv_count, seq, return_hook=False):
        return (y.new_empty((topk_idx.shape[0], y.shape[-1]), dtype=torch.bfloat16),
                torch.empty((1,), dtype=torch.int64, device="cpu"))

    def combine_out(buffer_id: int, y: Tensor, topk_idx: Tensor, topk_weights: Tensor, recv_count: Tensor,
                    out: Tensor, seq: int, return_hook: bool = False) -> Tensor:
        return _ll_combine(buffer_id, y, topk_idx, topk_weights, recv_count, out, seq, return_hook)

    def combine_out_fake(buffer_id, y, topk_idx, topk_weights, recv_count, out, seq, return_hook=False):
        return torch.empty((1,), dtype=torch.int64, device="cpu")

    ops = []
    for name, fn, fake, mutates in (("tdist::ep_ll_dispatch", dispatch, dispatch_fake, ()),
                                    ("tdist::ep_ll_combine", combine, combine_fake, ()),
                                    ("tdist::ep_ll_combine_out", combine_out, combine_out_fake, ("out",))):
        op = torch.library.custom_op(name, mutates_args=mutates)(fn)
        op.register_fake(fake)
        ops.append(op)
    return ops


_ops = _register(torch_module()) if torch_module() is not None else None
