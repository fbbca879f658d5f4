"""Start and end of the Python benchmarks: under torchrun one process per GPU, or a plain
`python -m tdist.bench_*` run as one rank."""

from __future__ import annotations

import os


def start(what: str):
    """Environment defaults (NVLink multicast off), this process's GPU, torch.distributed over NCCL.
    Returns (torch, dist). tdist is imported before torch, so that its NCCL (>= 2.28) is the one the
    process loads; tdist.init is the caller's (some benchmarks need it only with peers)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import tdist

    try:
        import torch
    except ImportError:
        raise SystemExit(f"{what} needs PyTorch with CUDA (pip install torch), which is not installed") from None
    import torch.distributed as dist

    if "RANK" not in os.environ:  # one rank, without torchrun: a free local port for the rendezvous
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local = tdist._runtime._launcher_device()  # LOCAL_RANK (modulo the GPUs under TDIST_SHARE_GPUS)
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return torch, dist


def pick(parser, text: str, allowed, what: str) -> list:
    """The comma-separated names of an option, each one of `allowed`, at least one; otherwise a
    parser error naming the option."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        parser.error(f"--{what} lists nothing (expected some of {', '.join(allowed)})")
    for x in items:
        if x not in allowed:
            parser.error(f"unknown {what} '{x}' (expected {', '.join(allowed)})")
    return items


def finish(dist, tdist_initialised: bool = True) -> None:
    import tdist

    if tdist_initialised:
        tdist.finalize()
    dist.destroy_process_group()
