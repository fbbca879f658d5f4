"""Decode attention over a paged (vLLM / FlashInfer layout) or contiguous KV cache, on one GPU.

    out, lse = tdist.flash_decode(q, k_cache, v_cache, seq_lens, block_table)

    q            [batch, q_heads, head_dim]                 bf16 or fp16, CUDA, contiguous
    k_cache      [num_pages, page_size, kv_heads, head_dim] paged (block_table given), page_size 1..256
                 [batch, capacity, kv_heads, head_dim]      contiguous (block_table None)
    v_cache      like k_cache
                 Each page's rows dense; the pages may lie further apart than a page, the same in
                 k_cache and v_cache: FlashInfer's combined cache kv [num_pages, 2, page_size,
                 kv_heads, head_dim] is passed as kv[:, 0] and kv[:, 1]
    seq_lens     [batch] int32 on the device                tokens of each sequence (0 allowed)
    block_table  [batch, max_pages] int32 or None           page of token t: block_table[b, t // page_size]
    -> out [batch, q_heads, head_dim] (q's dtype), lse [batch, q_heads] float32 (natural log, -inf if empty)

softmax_scale defaults to 1/sqrt(head_dim); softcap > 0 caps the logits (softcap * tanh(s / softcap)).
max_seq_len (0: the capacity) bounds seq_lens and fixes how many pieces each sequence is split into;
the lengths themselves are read on the GPU, so a CUDA graph replays with new ones. q_heads must be a
multiple of kv_heads (query head h reads KV head h // (q_heads // kv_heads)).

distributed=True (after tdist.init, collective): sequence-parallel decode. Each rank passes its own
part of every sequence (its cache, block table and lengths; a rank may hold none of a sequence) and
the same q; out and lse are the attention over the whole sequences on every rank, the ranks'
partials merged inside the call (low-latency exchange on tdist's symmetric heap, allocated when a
batch first needs it: run the largest batch once before capturing a CUDA graph).

Registered as torch.ops.tdist.flash_decode and torch.ops.tdist.flash_decode_distributed (with fake
implementations for torch.compile) when torch is installed. check_errors() synchronises and raises tdist.Error naming block_table or seq_lens when
a call met an entry outside the cache or a length beyond the capacity (checked on the GPU).
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the annotations as types.
import math
from typing import Optional

from . import _C
from ._tensors import Error, raw_stream, torch_dtype_name, torch_module

_DTYPES = {"bfloat16": "bf16", "float16": "f16"}


def _fail(name: str, expected: str, got) -> None:
    raise Error(f"tdist.flash_decode: invalid argument '{name}': expected {expected}, got {got}")


def _shape(t) -> tuple:
    return tuple(int(s) for s in t.shape)


def _page_stride(k_cache, v_cache) -> int:
    """Elements from one page of the caches to the next (0: dense pages); raises naming the cache
    whose layout the kernel cannot read: rows within a page dense, pages at least a page apart, the
    same stride in both."""
    strides = []
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        pages, page_size, kv_heads, head_dim = _shape(t)
        dense = (page_size * kv_heads * head_dim, kv_heads * head_dim, head_dim, 1)
        for i in (1, 2, 3):  # torch ignores the stride of a dimension of size 1, as its is_contiguous does
            if t.shape[i] > 1 and t.stride(i) != dense[i]:
                _fail(arg, "each page's rows dense (strides [*, kv_heads x head_dim, head_dim, 1])",
                      f"strides {tuple(t.stride())}")
        stride = t.stride(0) if pages > 1 else dense[0]
        if stride < dense[0]:
            _fail(arg, f"pages at least a page ({dense[0]} elements) apart", f"strides {tuple(t.stride())}")
        strides.append(stride)
    if strides[0] != strides[1]:
        _fail("v_cache", f"k_cache's page stride ({strides[0]} elements)", strides[1])
    return 0 if strides[0] == dense[0] else strides[0]  # dense: the shapes are equal


def check_args(q, k_cache, v_cache, seq_lens, block_table=None) -> dict:
    """Shapes, dtypes and devices of a call; raises tdist.Error naming the argument. Returns the sizes."""
    if q.dim() != 3:
        _fail("q", "[batch, q_heads, head_dim]", _shape(q))
    batch, q_heads, head_dim = _shape(q)
    name = torch_dtype_name(q.dtype)
    if name not in _DTYPES:
        _fail("q", "bfloat16 or float16", name)
    if head_dim not in (64, 128, 256):
        _fail("q", "head_dim 64, 128 or 256", head_dim)
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            _fail(arg, "[pages or batch, page_size or capacity, kv_heads, head_dim]", _shape(t))
        if t.dtype != q.dtype:
            _fail(arg, f"q's dtype {name}", torch_dtype_name(t.dtype))
    if _shape(v_cache) != _shape(k_cache):
        _fail("v_cache", f"k_cache's shape {_shape(k_cache)}", _shape(v_cache))
    num_pages, page_size, kv_heads, kdim = _shape(k_cache)
    if kdim != head_dim:
        _fail("k_cache", f"head_dim {head_dim} (q's)", kdim)
    if kv_heads < 1 or q_heads % kv_heads != 0:
        _fail("q", f"q_heads a multiple of the cache's kv_heads ({kv_heads})", q_heads)
    if seq_lens.dim() != 1 or int(seq_lens.shape[0]) != batch or torch_dtype_name(seq_lens.dtype) != "int32":
        _fail("seq_lens", f"int32 [{batch}]", f"{torch_dtype_name(seq_lens.dtype)} {_shape(seq_lens)}")
    max_pages = 0
    if block_table is not None:
        if block_table.dim() != 2 or int(block_table.shape[0]) != batch or \
                torch_dtype_name(block_table.dtype) != "int32":
            _fail("block_table", f"int32 [{batch}, max_pages]",
                  f"{torch_dtype_name(block_table.dtype)} {_shape(block_table)}")
        max_pages = int(block_table.shape[1])
    elif num_pages != batch:
        _fail("k_cache", f"[batch={batch}, capacity, kv_heads, head_dim] without a block_table", _shape(k_cache))
    tensors = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens)]
    if block_table is not None:
        tensors.append(("block_table", block_table))
    for arg, t in tensors:
        if t.device != q.device or t.device.type not in ("cuda", "meta"):
            _fail(arg, f"a CUDA tensor on q's device ({q.device})", t.device)
    _check_contiguous(q, seq_lens, block_table)
    return dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, num_pages=num_pages,
                page_size=page_size, page_stride=_page_stride(k_cache, v_cache), max_pages=max_pages,
                dtype=_DTYPES[name])


def _check_contiguous(q, seq_lens, block_table) -> None:
    for arg, t in (("q", q), ("seq_lens", seq_lens), ("block_table", block_table)):
        if t is not None and not t.is_contiguous():
            _fail(arg, "a contiguous tensor", f"strides {tuple(t.stride())}")


_checked: dict = {}  # check_args' sizes by the tensors' (shape, dtype, device); bounded


def _sizes(q, k_cache, v_cache, seq_lens, block_table) -> dict:
    """check_args of a call, its shape checks remembered per (shape, dtype, device) of the tensors:
    only the strides, which those do not fix, are checked again on every call."""
    tensors = (q, k_cache, v_cache, seq_lens, block_table)
    key = tuple(None if t is None else (t.shape, t.dtype, t.device) for t in tensors)
    sizes = _checked.get(key)
    if sizes is None:
        sizes = check_args(*tensors)
        if len(_checked) >= 1024:
            _checked.clear()
        _checked[key] = sizes
        return sizes
    _check_contiguous(q, seq_lens, block_table)
    page_stride = _page_stride(k_cache, v_cache)
    return sizes if page_stride == sizes["page_stride"] else dict(sizes, page_stride=page_stride)


class _Exchange:
    """The sequence-parallel op of one (device, q_heads, head_dim) on the runtime's symmetric heap:
    its buffer (collective allocation) and the C++ op over it."""

    def __init__(self, rt, device: int, max_batch: int, q_heads: int, head_dim: int):
        self.rt, self.max_batch = rt, max_batch
        nbytes = _C.distributed_flash_decode_bytes(max_batch, q_heads, head_dim, rt.world_size)
        self.ptr = rt.allocate(nbytes, "tdist.flash_decode's exchange")  # collective, zeroed
        bases = [rt.peer_ptr(self.ptr, r) for r in range(rt.world_size)]
        self.op = _C.DistributedFlashDecode(rt.rank, rt.world_size, bases, nbytes, max_batch, q_heads, head_dim,
                                            device)

    def close(self) -> None:  # collective
        self.op.close()
        if not self.rt.closed:
            self.rt.free(self.ptr)


_exchanges = {}  # (device, q_heads, head_dim) -> _Exchange of the live runtime


def _exchange(device: int, batch: int, q_heads: int, head_dim: int) -> _Exchange:
    """The live runtime's exchange for this size, made or grown (collectively: every rank makes the
    same calls) when the batch outgrows it; never during a CUDA graph capture."""
    from ._runtime import runtime

    rt = runtime("flash_decode(distributed=True)")
    if device != rt.device:
        _fail("q", f"a tensor on tdist's device (cuda:{rt.device}) for distributed=True", f"cuda:{device}")
    for key in [k for k, x in _exchanges.items() if x.rt is not rt]:  # a finalised runtime's: its heap is gone
        _exchanges.pop(key).op.close()
    key = (device, q_heads, head_dim)
    x = _exchanges.get(key)
    if x is not None and batch <= x.max_batch:
        return x
    torch = torch_module()
    if torch.cuda.is_current_stream_capturing():
        raise Error(f"tdist.flash_decode(distributed=True): a batch of {batch} needs a new exchange buffer, which "
                    "cannot be allocated during CUDA graph capture: run the largest batch once before capturing")
    if x is not None:
        _exchanges.pop(key).close()
    x = _Exchange(rt, device, max(batch, 2 * x.max_batch if x is not None else batch), q_heads, head_dim)
    _exchanges[key] = x
    return x


def _run(q, k_cache, v_cache, seq_lens, block_table, softmax_scale, softcap, max_seq_len, distributed=False):
    torch = torch_module()
    s = _sizes(q, k_cache, v_cache, seq_lens, block_table)
    out = torch.empty_like(q)
    lse = torch.empty((s["batch"], s["q_heads"]), dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(s["head_dim"]) if softmax_scale is None or softmax_scale <= 0 else softmax_scale
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), 0 if block_table is None else block_table.data_ptr(),
            seq_lens.data_ptr(), out.data_ptr(), lse.data_ptr(), s["dtype"], s["batch"], s["q_heads"], s["kv_heads"],
            s["head_dim"], s["num_pages"], s["page_size"], s["page_stride"], s["max_pages"], float(scale),
            float(softcap), int(max_seq_len))
    stream = raw_stream(device)
    if distributed:
        _exchange(device, s["batch"], s["q_heads"], s["head_dim"]).op.run(*args, stream)
    else:
        _C.flash_decode(*args, device, stream)
    return out, lse


def _register(torch):
    from typing import Tuple

    from torch import Tensor

    # softmax_scale 0: 1/sqrt(head_dim).
    def impl(q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, block_table: Optional[Tensor] = None,
             softmax_scale: float = 0.0, softcap: float = 0.0, max_seq_len: int = 0) -> Tuple[Tensor, Tensor]:
        return _run(q, k_cache, v_cache, seq_lens, block_table, softmax_scale, softcap, max_seq_len)

    def impl_distributed(q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor,
                         block_table: Optional[Tensor] = None, softmax_scale: float = 0.0, softcap: float = 0.0,
                         max_seq_len: int = 0) -> Tuple[Tensor, Tensor]:
        return _run(q, k_cache, v_cache, seq_lens, block_table, softmax_scale, softcap, max_seq_len, True)

    def fake(q, k_cache, v_cache, seq_lens, block_table=None, softmax_scale=0.0, softcap=0.0, max_seq_len=0):
        check_args(q, k_cache, v_cache, seq_lens, block_table)
        return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)

    ops = []
    for name, fn in (("tdist::flash_decode", impl), ("tdist::flash_decode_distributed", impl_distributed)):
        op = torch.library.custom_op(name, mutates_args=())(fn)
        op.register_fake(fake)
        ops.append(op)
    return ops


_ops = _register(torch_module()) if torch_module() is not None else None


def flash_decode(q, k_cache, v_cache, seq_lens, block_table=None, *, softmax_scale: Optional[float] = None,
                 softcap: float = 0.0, max_seq_len: int = 0, distributed: bool = False):
    """Decode attention; returns (out, lse). See the module's docstring for shapes and layouts.

    distributed=True (after tdist.init; collective): the cache, block table and lengths are this
    rank's part of every sequence (possibly none of one), q is the same on every rank, and out / lse
    are the attention over the whole sequences, merged across the ranks inside the call."""
    torch = torch_module()
    if torch is None:
        raise Error("tdist.flash_decode needs PyTorch, which is not installed")
    scale = 0.0 if softmax_scale is None else float(softmax_scale)
    from ._torch_ops import eager  # the eager path: python/tdist/_torch_ops.py

    if eager(*(t for t in (q, k_cache, v_cache, seq_lens, block_table) if t is not None)):
        return _run(q, k_cache, v_cache, seq_lens, block_table, scale, float(softcap), int(max_seq_len), distributed)
    op = torch.ops.tdist.flash_decode_distributed if distributed else torch.ops.tdist.flash_decode
    return op(q, k_cache, v_cache, seq_lens, block_table, scale, float(softcap), int(max_seq_len))


def check_errors(device=None) -> None:
    """Synchronises and raises tdist.Error naming block_table or seq_lens if a call met bad entries."""
    torch = torch_module()
    if device is None:
        device = torch.cuda.current_device() if torch is not None else 0
    elif not isinstance(device, int):
        device = device.index if device.index is not None else torch.cuda.current_device()
    _C.flash_decode_check_errors(device)
    for (dev, _, _), x in list(_exchanges.items()):
        if dev == device:
            x.op.check_errors()


def plan(batch: int, q_heads: int, kv_heads: int, max_seq_len: int, num_sms: int, head_dim: int = 128,
         ctas_per_sm: int = 2) -> tuple:
    """The split model (docs/flash_decode.md): (query heads per CTA, head chunks, splits per sequence).
    ctas_per_sm: split CTAs one SM holds (on Hopper 3, 2 and 1 at head dim 64, 128 and 256)."""
    return _C.flash_decode_plan(batch, q_heads, kv_heads, head_dim, max_seq_len, num_sms, ctas_per_sm)
