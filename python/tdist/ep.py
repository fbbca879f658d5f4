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
Autograd (docs/ep.md, "Training"): dispatch gives x its gradient, combine gives y (or y_compact) and
the dispatch's topk_weights theirs; the backward dispatches and combines with the same buffer along
the forward's routing, copied out of the buffer (which keeps only its last dispatch). Under autograd
expert_x and handle.info are copies. The low-latency calls have no backward and refuse tensors that
require grad.

Expert ids outside [-1, num_experts) and repeats within a token are skipped and recorded on the
device; check_errors() synchronises and raises tdist.Error naming topk_idx.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the annotations as types.
import itertools
import weakref

from . import _C
from ._tensors import Error, check_tensor_kind, raw_stream, torch_module

_MODES = ("low_latency", "high_throughput")
_buffers = {}  # id -> Buffer, while open (torch.library ops name a buffer by its id)
_ids = itertools.count(1)


def _fail(op: str, name: str, expected: str, got) -> None:
    raise Error(f"tdist.ep.{op}: invalid argument '{name}': expected {expected}, got {got}")


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
        self._ht_call, self._ht_views = 0, []  # the latest high-throughput dispatch: its number, its outputs
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
        _refuse_grad("low_latency_dispatch", x=x)
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
        _refuse_grad("low_latency_combine", y=y, topk_weights=topk_weights)
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
            op.run_hook(hook_id, raw_stream(self.device))

        return hook

    # --- high throughput ------------------------------------------------------------------------------

    def dispatch(self, x, topk_idx, topk_weights, *, sync_counts: bool = False):
        """Layout step and dispatch. Returns (expert_x, handle): expert_x bf16 [X, H], local expert e's rows
        at [offset[e], offset[e] + count[e]) (handle.info on the device, or the host lists with
        sync_counts), each expert's rows padded to expert_alignment. expert_x is the buffer's memory,
        except under autograd (grad mode on and x or topk_weights requiring grad): then a copy, which the
        backward's own dispatch cannot overwrite, with x's gradient (docs/ep.md, "Training")."""
        self._check_mode("dispatch", "high_throughput")
        self._check_tokens("dispatch", x, topk_idx, topk_weights)
        if _wants_grad(x):
            box = []
            expert_x = _grad_fns.dispatch.apply(x, self, (topk_idx, topk_weights, bool(sync_counts)), box)
            return expert_x, box[0]
        handle = self._ht_dispatch(x, topk_idx, topk_weights, bool(sync_counts))
        if _wants_grad(topk_weights):  # the combine's backward will dispatch into the buffer's expert_x
            return _own_rows(handle), handle
        return handle.expert_x, handle

    def combine(self, y, handle, *, y_compact=None, out=None):
        """Bring the experts' outputs back: out bf16 [T, H], each token's local slots summed with their
        weights on the expert's rank, then over ranks. y: bf16 [X, H] in expert_x's rows; or y=None and
        y_compact bf16 [R, H] in recv_x's rows, sent as they are (dispatch's backward). Differentiable in
        y, y_compact and the dispatch's topk_weights (docs/ep.md, "Training"); out= only without that."""
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
        if out is not None:
            self._tensor("combine", "out", out, ("bfloat16",), (handle.num_tokens, self.hidden))
        if not (_wants_grad(y_compact) if y is None else _wants_grad(y, handle.topk_weights)):
            return self._ht_combine(y, y_compact, handle, out)
        if out is not None:
            _fail("combine", "out", "None when the combine is differentiated (y, y_compact or the dispatch's "
                  "topk_weights requiring grad): its result is a new tensor", "a tensor")
        if handle.call != self._ht_call:  # the layout is copied out of the buffer below: it must be this one's
            _fail("combine", "handle", "the handle of this buffer's latest dispatch (a dispatch's outputs are "
                  "overwritten by the next one)", f"the handle of dispatch {handle.call}, latest {self._ht_call}")
        routing = _Routing.of(self, handle)
        if y is None:
            return _grad_fns.combine_compact.apply(y_compact, self, handle, routing)
        return _grad_fns.combine.apply(y, handle.topk_weights, self, handle, routing)

    # --- the high-throughput kernels (every path above and the backward call these) -------------------

    def _ht_dispatch(self, x, topk_idx, topk_weights, sync_counts: bool) -> "HighThroughputHandle":
        _bump_versions(self._ht_views)  # the previous dispatch's outputs are overwritten from here on
        r = self._op.ht_dispatch(x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), int(x.shape[0]),
                                 self.hidden, self.topk, bool(sync_counts), raw_stream(self.device))
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
                     info=self._view(info, (3 + 2 * L,), torch.int32))
        self._ht_views = [weakref.ref(v) for v in views.values()]
        self._ht_call = call
        views.update(max_recv_rows=max_recv, max_expert_rows=max_expert, num_recv=num_recv,
                     num_expert_rows=num_expert_rows, expert_counts=list(counts), expert_offsets=list(offsets))
        handle = HighThroughputHandle(self.id, call, int(x.shape[0]), views)
        handle.topk_idx = topk_idx  # the combine sends each token back along the same routing
        handle.topk_weights = topk_weights  # what the combine's weights are (and get their gradient through)
        return handle

    def _ht_combine(self, y, y_compact, handle, out):
        torch = torch_module()
        if out is None:
            out = torch.empty((handle.num_tokens, self.hidden), dtype=torch.bfloat16,
                              device=torch.device("cuda", self.device))
        self._op.ht_combine(0 if y is None else y.data_ptr(), 0 if y_compact is None else y_compact.data_ptr(),
                            handle.topk_idx.data_ptr(), out.data_ptr(), handle.call, raw_stream(self.device))
        return out

    def check_errors(self) -> None:
        """Synchronises; raises tdist.Error naming topk_idx when a call met an id out of range or repeated."""
        self._op.check_errors(raw_stream(self.device))

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
                                                  ue8m0, return_hook, raw_stream(b.device))
    sx, ss, sc, sr = b._ll_shapes(fp8)
    recv_x = b._view(rx, sx, torch.uint8).view(torch.float8_e4m3fn) if fp8 else b._view(rx, sx, torch.bfloat16)
    recv_scales = b._view(rs, ss, torch.float32) if fp8 else torch.empty(ss, dtype=torch.float32, device=x.device)
    meta = torch.tensor([seq, hook], dtype=torch.int64)  # host: the handle's number and the hook's
    return recv_x, recv_scales, b._view(rc, sc, torch.int32), b._view(rr, sr, torch.int32), meta


def _ll_combine(buffer_id, y, topk_idx, topk_weights, recv_count, out, seq, return_hook):
    torch = torch_module()
    b = _buffer(buffer_id, "low_latency_combine")
    hook = b._op.ll_combine(y.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), out.data_ptr(), seq,
                            recv_count.data_ptr(), return_hook, raw_stream(b.device))
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


# --- autograd of the high-throughput pair (docs/ep.md, "Training") -----------------------------------
#
# Forward (W ranks, M = max_tokens_per_rank; a slot (t, j) is sent when the kernels' rule says so, and
# lands on the rank of its expert at expert-major row pos(t, j)):
#   dispatch   expert_x[pos(t, j)] = x[t]
#   combine    out[t] = sum over sent j of w[t, j] * y[pos(t, j)]     (w: the dispatch's topk_weights)
#   compact    out[t] = sum over the ranks r the token went to of y_compact_r[row_r(t)]
# Adjoints:
#   dy[pos(t, j)] = w[t, j] * dout[t]        dout dispatched along the forward's routing (a dispatch)
#   dw[t, j] = <dout[t], y[pos(t, j)]>       on the expert's rank, fp32, sent back to t's rank
#   dx[t] = sum over sent j of dexpert_x[pos(t, j)]   summed per compact row, then a combine
#   dy_compact[row_r(t)] = dout[t]
# The buffer keeps only its latest dispatch, and its compact and expert-major rows are claimed in any
# order within a source: the backward dispatches along the saved routing again and matches rows by
# their source token (s * M + t, unique per rank), never by position.


def _wants_grad(*tensors) -> bool:
    torch = torch_module()
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _refuse_grad(op: str, **tensors) -> None:
    """The low-latency calls have no backward: a tensor requiring grad would lose its gradient silently."""
    if not _wants_grad(*tensors.values()):
        return
    name = next(n for n, t in tensors.items() if t is not None and t.requires_grad)
    raise Error(f"tdist.ep.{op}: '{name}' requires grad, but low_latency_* has no backward; use dispatch / "
                "combine (mode='high_throughput') to train, or call it under torch.no_grad()")


def _bump_versions(refs) -> None:
    """Marks tensors as modified in place (autograd's version counter), so that a backward that saved one
    of a dispatch's outputs and runs after the buffer overwrote them raises instead of using the new rows."""
    torch = torch_module()
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is None or torch.compiler.is_compiling():
        return
    for ref in refs:
        t = ref()
        if t is not None and not t.is_inference():
            bump(t)


def _own_rows(handle):
    """expert_x copied out of the buffer (its rows past the counts, unused, left as they come), and
    handle.info too, which a differentiated computation of the rows may keep for its backward (as
    torch.compile's recomputation does). The handle then holds the copies."""
    rows = handle.expert_x
    if handle.num_expert_rows < 0:
        out = rows.clone()
    else:
        out = torch_module().empty_like(rows)
        out[:handle.num_expert_rows].copy_(rows[:handle.num_expert_rows])
    handle.expert_x, handle.info = out, handle.info.clone()
    return out


def _dense(g):
    """g as the kernels take it: bf16, contiguous, 16-byte aligned (a copy only where it is not)."""
    g = g.to(torch_module().bfloat16).contiguous()
    return g.clone() if g.storage_offset() % 8 != 0 else g


def _valid_prefix(v, count):
    """v (int) as int64, -1 from index `count` (a 0-d device tensor: no host synchronisation) on."""
    torch = torch_module()
    v = v.long()
    return torch.where(torch.arange(v.shape[0], device=v.device) < count, v, -1)


def _gather(t, rows, fill=0):
    """t[rows] along dim 0, `fill` where rows < 0 (rows: int64, any shape)."""
    torch = torch_module()
    shape = tuple(rows.shape) + tuple(t.shape[1:])
    if t.shape[0] == 0 or rows.numel() == 0:
        return torch.full(shape, fill, dtype=t.dtype, device=t.device)
    flat = rows.reshape(-1)
    got = t.index_select(0, flat.clamp(min=0))
    keep = (flat >= 0).view((-1,) + (1,) * (t.dim() - 1))
    return torch.where(keep, got, torch.full((), fill, dtype=t.dtype, device=t.device)).view(shape)


def _index_of(keys, size: int):
    """[size] int64: the position i of each key k = keys[i] >= 0 (keys distinct), -1 for keys absent.
    Keys < 0 go to distinct slots past `size` (so no two writes meet: the scatter is deterministic)."""
    torch = torch_module()
    n = keys.shape[0]
    pos = torch.arange(n, device=keys.device)
    out = torch.full((size + n,), -1, dtype=torch.long, device=keys.device)
    out.scatter_(0, torch.where(keys >= 0, keys, size + pos), pos)
    return out[:size]


def _scatter_slots(values, rows, size: int):
    """[size]: values[r, j] at rows[r, j] (rows distinct where >= 0), 0 elsewhere."""
    torch = torch_module()
    n = rows.numel()
    out = torch.zeros((size + n,), dtype=values.dtype, device=values.device)
    spare = size + torch.arange(n, device=rows.device)
    out.scatter_(0, torch.where(rows.reshape(-1) >= 0, rows.reshape(-1), spare), values.reshape(-1))
    return out[:size]


_DOT_CHUNK_BYTES = 256 << 20  # fp32 products made at once by _row_dots


def _row_dots(a, b):
    """fp32 [n]: <a[i], b[i]> of two [n, H] tensors, accumulated in fp32, in chunks of bounded memory."""
    torch = torch_module()
    n, hidden = a.shape
    out = torch.empty((n,), dtype=torch.float32, device=a.device)
    step = max(1, _DOT_CHUNK_BYTES // max(1, 8 * hidden))
    for i in range(0, n, step):
        out[i:i + step] = (a[i:i + step].float() * b[i:i + step].float()).sum(1)
    return out


class _Routing:
    """A forward dispatch's layout as the backward needs it, copied out of the buffer (the next dispatch
    overwrites the handle's views). Rows past the received counts are -1, so garbage there never
    indexes anything. With sync_counts only the received rows are kept.

    recv_src [R] s * M + t of each compact row; recv_expert_row [R, topk] its local slots' expert-major
    rows (-1 elsewhere); recv_weights [R, topk]; expert_src [X] the compact row of each expert-major row
    (-1: padding); row_of_src [W M] the compact row of each source token (-1: not received)."""

    def __init__(self, buf: "Buffer", handle: HighThroughputHandle):
        self.call, self.num_tokens, self.sync = handle.call, handle.num_tokens, handle.num_recv >= 0
        self.max_recv_rows, self.max_expert_rows = handle.max_recv_rows, handle.max_expert_rows
        self.topk_idx, self.topk_weights = handle.topk_idx, handle.topk_weights.detach()
        rows = handle.num_recv if self.sync else handle.max_recv_rows
        expert_rows = handle.num_expert_rows if self.sync else handle.max_expert_rows
        self.recv_src = _valid_prefix(handle.recv_src[:rows], handle.info[0])
        received = (self.recv_src >= 0).view(-1, 1)
        self.recv_expert_row = torch_module().where(received, handle.recv_expert_row[:rows].long(), -1)
        self.recv_weights = handle.recv_topk_weights[:rows].clone()
        self.expert_src = _valid_prefix(handle.expert_src[:expert_rows], handle.info[1])
        self.row_of_src = _index_of(self.recv_src, buf.world_size * buf.max_tokens)
        self.grad_handle = None  # the latest dispatch the backward made along this routing

    @staticmethod
    def of(buf: "Buffer", handle: HighThroughputHandle) -> "_Routing":
        if getattr(handle, "routing", None) is None:
            handle.routing = _Routing(buf, handle)
        return handle.routing


def _grad_dispatch(buf: Buffer, routing: _Routing, g) -> HighThroughputHandle:
    """The backward's all-to-all towards the experts: g [T, H] dispatched by the buffer along the forward's
    routing (a new layout step: its rows come in their own order). grad_src: its compact rows' sources."""
    h = buf._ht_dispatch(_dense(g), routing.topk_idx, routing.topk_weights, routing.sync)
    rows = h.num_recv if routing.sync else h.max_recv_rows
    h.grad_src = _valid_prefix(h.recv_src[:rows], h.info[0])
    routing.grad_handle = h
    return h


def _combine_grads(buf: Buffer, routing: _Routing, dout, saved, need_y: bool, need_w: bool, compact: bool):
    """(dy or dy_compact, dw) of a combine, either None where not needed."""
    torch = torch_module()
    h = _grad_dispatch(buf, routing, dout)
    # The output gradient of each forward compact row's token, rows in the forward's order.
    mine = _gather(_index_of(h.grad_src, buf.world_size * buf.max_tokens), routing.recv_src, fill=-1)
    d_compact = _gather(h.recv_x, mine)
    if compact:
        dy = torch.zeros((routing.max_recv_rows, buf.hidden), dtype=torch.bfloat16, device=dout.device)
        dy[:d_compact.shape[0]] = d_compact
        return dy, None
    (y,) = saved()  # after the dispatch above: a y living in the buffer's rows fails autograd's check
    d_rows = _gather(d_compact, routing.expert_src)  # [X, H]: the same per expert-major row (0: padding)
    dy = dw = None
    if need_y:
        w_row = _scatter_slots(routing.recv_weights, routing.recv_expert_row, routing.expert_src.shape[0])
        dy = torch.zeros_like(y)
        dy[:d_rows.shape[0]] = (d_rows.float() * w_row.view(-1, 1)).to(y.dtype)
    if need_w:
        # Rows past the counts and padding rows of y may hold anything (NaN): masked after the product.
        dots = torch.where(routing.expert_src >= 0, _row_dots(d_rows, y[:d_rows.shape[0]]), 0.0)
        dw = _weights_to_sources(buf, routing, _gather(dots, routing.recv_expert_row))
    return dy, dw


def _weights_to_sources(buf: Buffer, routing: _Routing, dw_recv):
    """dw [T, topk] of this rank's tokens from every rank's [R, topk] terms (the slots of its experts):
    each rank writes its terms at [s * M + t, j] of a zero [W M, topk] fp32 matrix and tdist's
    ReduceScatter sums them, rank s keeping its M rows. A slot has one term on one rank: the sum adds
    zeros only, so the fp32 dot products arrive exactly."""
    torch = torch_module()
    k, slots = buf.topk, buf.world_size * buf.max_tokens * buf.topk
    have = (routing.recv_src >= 0).view(-1, 1) & (routing.recv_expert_row >= 0)
    at = torch.where(have, routing.recv_src.view(-1, 1) * k + torch.arange(k, device=have.device), -1)
    terms = _scatter_slots(dw_recv, at, slots).view(buf.world_size * buf.max_tokens, k)
    if buf.world_size > 1:
        from .ops import reduce_scatter
        terms = reduce_scatter(terms)
    return terms[:routing.num_tokens].contiguous()


def _dispatch_grad(buf: Buffer, routing: _Routing, d_expert_x):
    """dx [T, H] bf16: each compact row's slots' gradients summed in fp32 (slot order), then the buffer's
    combine sends them back as they are (y_compact) and sums them over ranks. It combines through the
    combine backward's dispatch when that is still the buffer's latest, else dispatches once more."""
    torch = torch_module()
    h = routing.grad_handle
    if h is None or h.call != buf._ht_call:
        zeros = torch.zeros((routing.num_tokens, buf.hidden), dtype=torch.bfloat16, device=d_expert_x.device)
        h = _grad_dispatch(buf, routing, zeros)
    theirs = _gather(routing.row_of_src, h.grad_src, fill=-1)  # forward compact row of each of h's rows
    slots = _gather(routing.recv_expert_row, theirs, fill=-1)  # [R, topk] their expert-major rows
    acc = None
    for j in range(buf.topk):
        part = _gather(d_expert_x, slots[:, j]).float()
        acc = part if acc is None else acc + part
    y_compact = torch.zeros((h.max_recv_rows, buf.hidden), dtype=torch.bfloat16, device=d_expert_x.device)
    if acc is not None:
        y_compact[:acc.shape[0]] = acc
    return buf._ht_combine(None, y_compact, h, None)


def _autograd_functions(torch):
    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, buf, args, box):
            topk_idx, topk_weights, sync = args
            handle = buf._ht_dispatch(x, topk_idx, topk_weights, sync)
            ctx.buf, ctx.routing = buf, _Routing.of(buf, handle)
            box.append(handle)
            return _own_rows(handle)

        @staticmethod
        def backward(ctx, d_expert_x):
            return _dispatch_grad(ctx.buf, ctx.routing, d_expert_x), None, None, None

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, topk_weights, buf, handle, routing):
            ctx.buf, ctx.routing = buf, routing
            ctx.save_for_backward(y)
            return buf._ht_combine(y, None, handle, None)

        @staticmethod
        def backward(ctx, dout):
            dy, dw = _combine_grads(ctx.buf, ctx.routing, dout, lambda: ctx.saved_tensors, ctx.needs_input_grad[0],
                                    ctx.needs_input_grad[1], False)
            return dy, dw, None, None, None

    class CombineCompact(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y_compact, buf, handle, routing):
            ctx.buf, ctx.routing = buf, routing
            return buf._ht_combine(None, y_compact, handle, None)

        @staticmethod
        def backward(ctx, dout):
            dy, _ = _combine_grads(ctx.buf, ctx.routing, dout, None, True, False, True)
            return dy, None, None, None

    class Functions:
        dispatch, combine, combine_compact = Dispatch, Combine, CombineCompact

    return Functions


_grad_fns = _autograd_functions(torch_module()) if torch_module() is not None else None


def _run_eagerly_under_compile(torch):
    # torch.compile must not trace into the high-throughput calls: they hand raw pointers and the stream
    # to the C++ buffer and return views of its memory. Dynamo would trace torch.cuda.current_stream into
    # a proxy without a handle; marked, the calls break the graph and run as they do eagerly.
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is not None:
        for name in ("dispatch", "combine"):
            setattr(Buffer, name, disable(getattr(Buffer, name)))


if torch_module() is not None:
    _run_eagerly_under_compile(torch_module())
