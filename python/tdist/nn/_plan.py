"""Parallelisation plans: which linear layers become which tensor-parallel module. Torch-free, so a
plan is checked (and tested) without torch.

A plan maps module-name patterns to styles::

    {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise", ...}

A pattern is a dotted module name whose parts may use shell wildcards (``*``, ``?``, ``[...]``,
matched with fnmatch per part, so ``*`` never crosses a dot); it matches modules with as many parts.
"""

from __future__ import annotations

import fnmatch
from typing import Iterable, List, Mapping, NamedTuple, Optional, Tuple

# style -> (the module it makes, what it shards, the dimension that must divide by world_size)
STYLES = {
    "colwise": ("ColumnParallelLinear", "output features; input sequence-sharded (AllGather-GEMM)", "out_features"),
    "colwise_replicated": ("ColumnParallelLinear", "output features; input replicated", "out_features"),
    "rowwise": ("RowParallelLinear", "input features; output sequence-sharded (GEMM-ReduceScatter)", "in_features"),
    "rowwise_replicated": ("RowParallelLinear", "input features; output replicated (GEMM-AllReduce)", "in_features"),
}


class Layer(NamedTuple):
    """What the plan check needs to know of one module of the model."""

    name: str                       # dotted name, as torch.nn.Module.named_modules gives it
    type_name: str                  # class name, for messages
    is_linear: bool                 # an instance of torch.nn.Linear
    in_features: Optional[int] = None
    out_features: Optional[int] = None
    head_dim: Optional[int] = None  # the attention block's head size, where the layer sits in one


class Target(NamedTuple):
    name: str
    style: str
    pattern: str


def _expected_styles() -> str:
    return ", ".join(f'"{s}"' for s in STYLES)


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether the dotted ``pattern`` (fnmatch wildcards per part) matches the module ``name``."""
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want))


def check_plan(plan) -> List[Tuple[str, str]]:
    """The plan's entries as (pattern, style), each checked; ValueError on the first bad one."""
    if not isinstance(plan, Mapping):
        raise ValueError(f"tdist.nn.parallelize: plan must be a dict {{module-name pattern: style}}, got "
                         f"{type(plan).__name__}")
    if not plan:
        raise ValueError("tdist.nn.parallelize: plan is empty; expected {module-name pattern: style} with styles "
                         + _expected_styles())
    entries = []
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern or any(not p for p in pattern.split(".")):
            raise ValueError(f"tdist.nn.parallelize: plan key {pattern!r} is not a dotted module name (pattern)")
        if not isinstance(style, str) or style not in STYLES:
            raise ValueError(f"tdist.nn.parallelize: plan entry {pattern!r} has style {style!r}; expected one of "
                             + _expected_styles())
        entries.append((pattern, style))
    return entries


def resolve_plan(plan, layers: Iterable[Layer], world_size: int) -> List[Target]:
    """Every module the plan names, with its style, in the model's module order.

    ValueError, naming the layer and what was expected, when: a plan entry matches no module; a
    matched module is not a torch.nn.Linear (or is the model itself); two entries give one module
    different styles; the sharded dimension (out_features for colwise, in_features for rowwise) is
    not divisible by ``world_size``; a layer with a ``head_dim`` would give a rank part of a head.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tdist.nn.parallelize: world_size must be a positive int, got {world_size!r}")
    entries = check_plan(plan)
    layers = list(layers)
    chosen = {}   # name -> (style, pattern)
    for pattern, style in entries:
        hits = [layer for layer in layers if pattern_matches(pattern, layer.name)]
        if not hits:
            names = [layer.name for layer in layers if layer.is_linear][:8]
            hint = f" (its nn.Linear modules include: {', '.join(names)})" if names else " (it has no nn.Linear)"
            raise ValueError(f"tdist.nn.parallelize: plan entry {pattern!r} matches no module of the model{hint}")
        for layer in hits:
            if layer.name == "":
                raise ValueError("tdist.nn.parallelize: the plan names the model itself; expected the names of "
                                 "nn.Linear submodules")
            if not layer.is_linear:
                raise ValueError(f"tdist.nn.parallelize: layer '{layer.name}' (plan entry {pattern!r}) is a "
                                 f"{layer.type_name}; expected a torch.nn.Linear")
            prev = chosen.get(layer.name)
            if prev is not None and prev[0] != style:
                raise ValueError(f"tdist.nn.parallelize: layer '{layer.name}' is matched by {prev[1]!r} as "
                                 f"\"{prev[0]}\" and by {pattern!r} as \"{style}\"; expected one style per layer")
            if prev is None:
                chosen[layer.name] = (style, pattern)
    targets = []
    for layer in layers:  # the model's order
        if layer.name not in chosen:
            continue
        style, pattern = chosen[layer.name]
        dim_name = STYLES[style][2]
        dim = layer.out_features if dim_name == "out_features" else layer.in_features
        if not isinstance(dim, int) or dim <= 0 or dim % world_size != 0:
            raise ValueError(f"tdist.nn.parallelize: layer '{layer.name}' ({layer.type_name}, in_features="
                             f"{layer.in_features}, out_features={layer.out_features}) as \"{style}\" splits "
                             f"{dim_name} over {world_size} ranks; expected {dim_name} divisible by {world_size}")
        if layer.head_dim and (dim // world_size) % layer.head_dim:
            raise ValueError(f"tdist.nn.parallelize: layer '{layer.name}' as \"{style}\" splits its {dim} {dim_name} "
                             f"({dim // layer.head_dim} heads of {layer.head_dim}) over {world_size} ranks, "
                             f"{dim // world_size} each: part of a head; expected a head count divisible by "
                             f"{world_size}")
        targets.append(Target(layer.name, style, pattern))
    return targets
