"""tdist.nn: tensor-parallel linear layers on tdist's overlapped GEMMs, parallelize(), which
converts a model's nn.Linear layers in place from a plan, and ParallelMoE, a sparse MoE block on the
MoE ops (docs/nn.md).

    import tdist, tdist.nn
    tdist.init()
    model = tdist.nn.parallelize(model, {"layers.*.mlp.gate_proj": "colwise",
                                         "layers.*.mlp.up_proj": "colwise",
                                         "layers.*.mlp.down_proj": "rowwise"})

The plan checks (tdist.nn.resolve_plan) are plain Python; the modules need torch, which is imported
only when one of them is first used, so `import tdist.nn` works without it.
"""

from ._plan import STYLES, Layer, Target, check_plan, pattern_matches, resolve_plan

_TORCH_NAMES = ("ColumnParallelLinear", "RowParallelLinear", "parallelize", "plan_layers", "set_save_gathered",
                "get_save_gathered", "ParallelMoE")


def __getattr__(name):
    if name == "ParallelMoE":
        from . import sparse_moe  # needs torch, as the modules below
        return sparse_moe.ParallelMoE
    if name in _TORCH_NAMES:
        from . import modules  # needs torch (tdist.Error naming tdist.nn when it is missing)
        return getattr(modules, name)
    raise AttributeError(f"module 'tdist.nn' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_TORCH_NAMES))


__all__ = ["STYLES", "Layer", "Target", "check_plan", "pattern_matches", "resolve_plan", *_TORCH_NAMES]
