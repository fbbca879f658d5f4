"""Tensor-parallel linear layers on tdist's overlapped GEMMs, and parallelize() (docs/nn.md).

Layouts (this rank r of W ranks; M rows = tokens, all ranks together; rows split as
RowChunks{M, W}: rank r owns rows [begin(r), begin(r) + rows(r))):

  ColumnParallelLinear  weight (out / W, in): rows [r * out / W, (r + 1) * out / W) of the full
                        weight; bias (out / W,) the same slice.
      sequence_parallel=True   x (rows(r), in) -> y (M, out / W)           AllGather-GEMM
      sequence_parallel=False  x (M, in), replicated -> y (M, out / W)    local GEMM; backward
                                                                           GEMM-AllReduce
  RowParallelLinear     weight (out, in / W): columns [r * in / W, (r + 1) * in / W); bias (out,)
                        whole, added once after the reduction.
      sequence_parallel=True   x (M, in / W) -> y (rows(r), out)           GEMM-ReduceScatter
      sequence_parallel=False  x (M, in / W) -> y (M, out), replicated    GEMM-AllReduce

Inputs may have leading dimensions beyond the rows: x (T, B, ..., features) is taken as T * B * ...
rows in that order, so the sequence dimension comes first (Megatron-LM's [s, b, h] layout) and a
rank's rows are whole leading slices.
"""

from __future__ import annotations

import math
from typing import Optional

from .._tensors import require_torch
from .._runtime import runtime
from .. import _overlap
from ._plan import Layer, resolve_plan

torch = require_torch("tdist.nn")
from .. import _torch_ops  # noqa: E402,F401  (registers torch.ops.tdist.* and their autograd)
from .. import _autograd as _ag  # noqa: E402

_FUSED_DTYPES = (torch.bfloat16, torch.float16)


class _Settings:
    # Whether ColumnParallelLinear (sequence-parallel) keeps the gathered input for the backward
    # (M x K elements per layer until backward) instead of gathering it again there.
    save_gathered = False


def set_save_gathered(flag: bool) -> None:
    """Default of ColumnParallelLinear's ``save_gathered`` (False at start): True keeps each layer's
    gathered input (M x in_features elements per layer, alive until its backward) for the weight
    gradient; False keeps only this rank's rows and gathers them again in the backward (one more
    AllGather per layer, M x in_features / W elements kept)."""
    if not isinstance(flag, bool):
        raise ValueError(f"tdist.nn.set_save_gathered: expected a bool, got {type(flag).__name__}")
    _Settings.save_gathered = flag


def get_save_gathered() -> bool:
    """The current default of ColumnParallelLinear's ``save_gathered``."""
    return _Settings.save_gathered


def _rank_world(what: str):
    rt = runtime(what)
    return rt.rank, rt.world_size


def _device(device):
    return torch.device("cuda", runtime("nn").device) if device is None else torch.device(device)


def _check_features(cls: str, in_features, out_features) -> None:
    for name, v in (("in_features", in_features), ("out_features", out_features)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"tdist.nn.{cls}: {name} must be a positive int, got {v!r}")


def _flatten(cls: str, x, features: int, what: str):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"tdist.nn.{cls}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2 or x.shape[-1] != features:
        raise ValueError(f"tdist.nn.{cls}: input has shape {tuple(x.shape)}; expected (rows, ..., {features}) "
                         f"with {what}")
    return x if x.dim() == 2 else x.flatten(0, -2)


def _unflatten(y, x):
    """y (rows, features) back to x's leading dimensions after the first: (rows / inner, *inner, features)."""
    if x.dim() == 2:
        return y
    inner = tuple(x.shape[1:-1])
    count = 1
    for d in inner:
        count = count * d
    return y.reshape((y.shape[0] // count,) + inner + (y.shape[-1],))


class _ParallelLinear(torch.nn.Module):
    """What both tensor-parallel linear layers share: torch.nn.Linear's initialisation over the full
    layer's fan-in, and whether a call can take tdist's overlapped ops (else the torch fallback)."""

    def reset_parameters(self) -> None:
        """Uniform in +-1/sqrt(in_features) (the full layer's fan-in), as torch.nn.Linear."""
        bound = 1.0 / math.sqrt(self.in_features)
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def _fused(self, x) -> bool:
        return self._shapes_fit and x.dtype in _FUSED_DTYPES and x.dtype == self.weight.dtype and x.is_cuda


class ColumnParallelLinear(_ParallelLinear):
    """y = x @ W.T + b with W's output features split over the ranks (module docstring: layouts).

    Args:
        in_features, out_features: the full layer's (out_features divisible by the world size).
        bias: a bias slice of out_features / world_size.
        sequence_parallel: True: the input holds this rank's rows (tokens) and the rows are
            gathered inside the GEMM (AllGather-GEMM); False: the input is replicated (every rank
            holds every row) and the backward sums the input gradient over ranks (GEMM-AllReduce).
        save_gathered: sequence-parallel only: keep the gathered input for the weight gradient
            (M x in_features elements per layer until backward) instead of gathering it again in
            backward; None: the global default (``tdist.nn.set_save_gathered``, initially False).
        method: the overlapped GEMMs' method ("auto", "fused", "chunked", "sequential", "baseline").
        device, dtype: of the parameters; default this rank's GPU and torch's default dtype.

    The overlapped GEMMs run where dtype is bfloat16 / float16 and in_features and out_features /
    world_size are multiples of 8; otherwise the same math runs as torch matmuls beside tdist's
    collectives. Needs tdist.init() first (the world size and rank are tdist's).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, sequence_parallel: bool = True,
                 save_gathered: Optional[bool] = None, method: str = "auto", device=None, dtype=None):
        super().__init__()
        cls = "ColumnParallelLinear"
        _check_features(cls, in_features, out_features)
        self.rank, self.world_size = _rank_world("nn." + cls)
        if out_features % self.world_size != 0:
            raise ValueError(f"tdist.nn.{cls}: out_features={out_features} must be divisible by the world size "
                             f"{self.world_size}")
        if save_gathered is not None and not isinstance(save_gathered, bool):
            raise ValueError(f"tdist.nn.{cls}: save_gathered must be None or a bool, got {save_gathered!r}")
        _overlap.check_method("nn." + cls, method)
        self.in_features, self.out_features = in_features, out_features
        self.local_out_features = out_features // self.world_size
        self.sequence_parallel = bool(sequence_parallel)
        self.save_gathered = save_gathered
        self.method = method
        kw = {"device": _device(device), "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty((self.local_out_features, in_features), **kw))
        self.bias = torch.nn.Parameter(torch.empty((self.local_out_features,), **kw)) if bias else None
        self._shapes_fit = in_features % 8 == 0 and self.local_out_features % 8 == 0
        self.reset_parameters()

    def forward(self, x, m: Optional[int] = None):
        """x: (rows, ..., in_features), this rank's rows (sequence_parallel) or all rows. ``m``:
        sequence-parallel only, all ranks' rows of the flattened input when the ranks hold unequal
        counts (RowChunks; the same on every rank); default rows * world_size."""
        cls = "ColumnParallelLinear"
        what = "this rank's rows first" if self.sequence_parallel else "every row (replicated input)"
        x2 = _flatten(cls, x, self.in_features, what)
        fused = self._fused(x2)
        if self.sequence_parallel:
            save = _Settings.save_gathered if self.save_gathered is None else self.save_gathered
            y = _ag.linear_rows_gathered(x2, self.weight, m, self.method, fused, save, self.rank, self.world_size)
        else:
            if m is not None:
                raise ValueError(f"tdist.nn.{cls}: m is for a sequence-parallel input; this layer's input is "
                                 "replicated")
            y = _ag.linear_replicated_input(x2, self.weight, self.method, fused)
        if self.bias is not None:
            y = y + self.bias
        return _unflatten(y, x)

    @classmethod
    def from_linear(cls, linear, *, sequence_parallel: bool = True, save_gathered: Optional[bool] = None,
                    method: str = "auto"):
        """This rank's slice of a full torch.nn.Linear (the same weights on every rank), on the
        Linear's device and dtype."""
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  sequence_parallel=sequence_parallel, save_gathered=save_gathered, method=method,
                  device=w.device, dtype=w.dtype)
        n, r = mod.local_out_features, mod.rank
        with torch.no_grad():
            mod.weight.copy_(w[r * n:(r + 1) * n])
            if mod.bias is not None:
                mod.bias.copy_(linear.bias[r * n:(r + 1) * n])
        return mod

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.local_out_features} on "
                f"rank {self.rank} of {self.world_size}), bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}, method={self.method!r}")


class RowParallelLinear(_ParallelLinear):
    """y = x @ W.T + b with W's input features split over the ranks (module docstring: layouts).

    Args:
        in_features, out_features: the full layer's (in_features divisible by the world size).
        bias: the whole bias (out_features,), added once after the reduction. With
            sequence_parallel its gradient is summed over ranks (each rank holds only its rows).
        sequence_parallel: True: each rank gets its rows of the sum (GEMM-ReduceScatter); False:
            every rank gets every row (GEMM-AllReduce; the output's gradient is taken as
            replicated, as every rank computes the same loss from it).
        method, device, dtype: as ColumnParallelLinear.

    The overlapped GEMMs run where dtype is bfloat16 / float16 and in_features / world_size and
    out_features are multiples of 8; otherwise torch matmuls beside tdist's collectives.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, sequence_parallel: bool = True,
                 method: str = "auto", device=None, dtype=None):
        super().__init__()
        cls = "RowParallelLinear"
        _check_features(cls, in_features, out_features)
        self.rank, self.world_size = _rank_world("nn." + cls)
        if in_features % self.world_size != 0:
            raise ValueError(f"tdist.nn.{cls}: in_features={in_features} must be divisible by the world size "
                             f"{self.world_size}")
        _overlap.check_method("nn." + cls, method)
        self.in_features, self.out_features = in_features, out_features
        self.local_in_features = in_features // self.world_size
        self.sequence_parallel = bool(sequence_parallel)
        self.method = method
        kw = {"device": _device(device), "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty((out_features, self.local_in_features), **kw))
        self.bias = torch.nn.Parameter(torch.empty((out_features,), **kw)) if bias else None
        self._shapes_fit = self.local_in_features % 8 == 0 and out_features % 8 == 0
        self.reset_parameters()

    def forward(self, x):
        """x: (M, ..., in_features / world_size), every row, this rank's feature slice. Returns this
        rank's rows (RowChunks of the flattened rows) or every row."""
        x2 = _flatten("RowParallelLinear", x, self.local_in_features,
                      f"this rank's {self.local_in_features} of {self.in_features} input features")
        fused = self._fused(x2)
        if self.sequence_parallel:
            y = _ag.linear_rows_scattered(x2, self.weight, self.method, fused, self.rank, self.world_size)
            if self.bias is not None:
                y = _ag.SequenceParallelBias.apply(y, self.bias)
        else:
            y = _ag.linear_reduced(x2, self.weight, self.method, fused)
            if self.bias is not None:
                y = y + self.bias
        return _unflatten(y, x)

    @classmethod
    def from_linear(cls, linear, *, sequence_parallel: bool = True, method: str = "auto"):
        """This rank's slice of a full torch.nn.Linear (the same weights on every rank)."""
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  sequence_parallel=sequence_parallel, method=method, device=w.device, dtype=w.dtype)
        k, r = mod.local_in_features, mod.rank
        with torch.no_grad():
            mod.weight.copy_(w[:, r * k:(r + 1) * k])
            if mod.bias is not None:
                mod.bias.copy_(linear.bias)
        return mod

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.local_in_features} on rank {self.rank} of "
                f"{self.world_size}), out_features={self.out_features}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}, method={self.method!r}")


def _convert(linear, style: str, save_gathered, method):
    if style.startswith("colwise"):
        return ColumnParallelLinear.from_linear(linear, sequence_parallel=style == "colwise",
                                                save_gathered=save_gathered, method=method)
    return RowParallelLinear.from_linear(linear, sequence_parallel=style == "rowwise", method=method)


def plan_layers(model) -> list:
    """The model's modules as the plan check takes them (nn._plan.Layer, in module order): name, type,
    whether an nn.Linear and its features, and for a Linear whose parent has an integer ``head_dim``
    (an attention block, as Hugging Face's are) that head size, so that no plan splits a head."""
    modules = dict(model.named_modules())
    layers = []
    for name, mod in modules.items():
        linear = isinstance(mod, torch.nn.Linear)
        head_dim = getattr(modules.get(name.rpartition(".")[0]), "head_dim", None) if linear and name else None
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            head_dim = None
        layers.append(Layer(name, type(mod).__name__, linear, mod.in_features if linear else None,
                            mod.out_features if linear else None, head_dim))
    return layers


def parallelize(model, plan, *, save_gathered: Optional[bool] = None, method: str = "auto"):
    """Replace the model's nn.Linear layers named by ``plan`` with tensor-parallel ones, in place.

    ``plan``: {module-name pattern: style}; patterns are dotted module names with shell wildcards per
    part ("layers.*.mlp.up_proj"); styles: "colwise" (ColumnParallelLinear, sequence-parallel
    input), "colwise_replicated" (replicated input), "rowwise" (RowParallelLinear, output
    sequence-sharded), "rowwise_replicated" (output replicated). Each named Linear must hold the
    full weights, the same on every rank (e.g. loaded from one checkpoint); this rank keeps its slice,
    on the Linear's device and dtype. Modules the plan does not name stay as they are.

    Raises ValueError naming the layer for: a pattern that matches nothing, a match that is not an
    nn.Linear, a layer given two styles, a sharded dimension not divisible by the world size, or
    (where the Linear's parent has a ``head_dim``, as attention blocks do) not into whole heads.
    Collective in effect (every rank must convert the same model the same way). Returns ``model``.
    """
    _overlap.check_method("nn.parallelize", method)
    if save_gathered is not None and not isinstance(save_gathered, bool):
        raise ValueError(f"tdist.nn.parallelize: save_gathered must be None or a bool, got {save_gathered!r}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"tdist.nn.parallelize: model must be a torch.nn.Module, got {type(model).__name__}")
    rank, world = _rank_world("nn.parallelize")
    for target in resolve_plan(plan, plan_layers(model), world):
        parent_name, _, child = target.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _convert(getattr(parent, child), target.style, save_gathered, method))
    return model


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "parallelize", "plan_layers", "set_save_gathered",
           "get_save_gathered"]
