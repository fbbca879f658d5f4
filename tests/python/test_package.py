"""CPU tests of the Python package (no GPU, no torch needed): import, errors, argument checks,
docstrings, and JIT compilation for an explicit arch."""

import builtins
import inspect
import os
import subprocess
import sys

import pytest

import tdist
from tdist import _C
from tdist._tensors import describe

HAS_GPU = _C.driver_available()


class CudaArray:
    """A stand-in device array (__cuda_array_interface__ v3); never dereferenced."""

    def __init__(self, shape, typestr="<f4", ptr=1 << 20, strides=None):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": tuple(shape), "typestr": typestr,
                                         "strides": strides, "version": 3}


def _prints_ok(code):
    """Runs `code` in a fresh interpreter (no torch imported) and expects it to print only "ok"."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "ok"


def desc(shape, typestr="<f4", ptr=1 << 20, strides=None):
    return describe(CudaArray(shape, typestr, ptr, strides), "test", "x")


# --- import -----------------------------------------------------------------------------------------

def test_import_without_torch():
    # torch blocked (sys.modules[name] = None makes `import torch` raise ImportError).
    code = ("import sys; sys.modules['torch'] = None\n"
            "import tdist\n"
            "assert tdist.is_initialized() is False\n"
            "assert tdist.ops._torch is None\n"
            "try:\n"
            "    tdist.empty((4,))\n"
            "except tdist.Error as e:\n"
            "    assert 'needs PyTorch' in str(e), e\n"
            "else:\n"
            "    raise SystemExit('tdist.empty worked without torch')\n"
            "print('ok')\n")
    _prints_ok(code)


def test_import_does_not_need_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", "import tdist, tdist.jit; print(tdist.__version__)"],
                         capture_output=True, text=True, env=env, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == tdist.__version__


def test_share_gpus_names_a_host_per_rank():
    # TDIST_SHARE_GPUS: each rank claims its own NCCL host at import (NCCL refuses two ranks on one
    # GPU of one host); a value the user set stays; without the mode nothing is set.
    code = ("import os, tdist\n"
            "print(os.environ.get('NCCL_HOSTID', '-'), tdist._runtime._launcher_device())\n")
    base = {k: v for k, v in os.environ.items() if k not in ("NCCL_HOSTID", "TDIST_SHARE_GPUS")}
    base.update(RANK="3", LOCAL_RANK="3", CUDA_VISIBLE_DEVICES="")

    def run(**extra):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                             env=dict(base, **extra))
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert run() == ["-", "3"]
    # No GPU visible: LOCAL_RANK modulo max(0 GPUs, 1).
    assert run(TDIST_SHARE_GPUS="1") == ["tdist-shared-gpu-rank-3", "0"]
    assert run(TDIST_SHARE_GPUS="1", NCCL_HOSTID="mine") == ["mine", "0"]


def test_package_ships_headers_next_to_libtdist():
    pkg = os.path.dirname(tdist.__file__)
    assert os.path.exists(os.path.join(pkg, "include", "tdist", "device.cuh"))
    assert os.path.exists(os.path.join(pkg, "include", "tdist", "kernels", "collectives"))
    assert os.path.exists(os.path.join(pkg, "libtdist.so"))


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_gpu_op_without_gpu_raises_clear_error():
    with pytest.raises(tdist.Error, match="no CUDA driver or GPU"):
        tdist.init()
    assert not tdist.is_initialized()


# --- errors -----------------------------------------------------------------------------------------

def test_error_hierarchy():
    assert issubclass(tdist.Error, RuntimeError)
    assert issubclass(tdist.TimeoutError, tdist.Error)
    assert issubclass(tdist.TimeoutError, builtins.TimeoutError)
    assert tdist.Error.__module__ == "tdist" and tdist.TimeoutError.__module__ == "tdist"
    assert tdist.Error.__doc__ and tdist.TimeoutError.__doc__


def test_cpp_errors_become_python_exceptions_with_the_same_message():
    with pytest.raises(tdist.Error) as e:
        _C._raise_error("some message")
    assert type(e.value) is tdist.Error and str(e.value) == "some message"
    with pytest.raises(tdist.TimeoutError) as e:
        _C._raise_timeout("rank 1 did not arrive")
    assert str(e.value) == "rank 1 did not arrive"
    with pytest.raises(builtins.TimeoutError):
        _C._raise_timeout("x")


def test_device_faults_without_a_gpu():
    # An aborted device wait surfaces as tdist.DeviceTimeoutError, a tdist.TimeoutError; without a
    # record (no GPU here) checking raises nothing.
    assert issubclass(tdist.DeviceTimeoutError, tdist.TimeoutError)
    assert issubclass(tdist.DeviceTimeoutError, builtins.TimeoutError)
    tdist.check_device_faults()
    assert _C.device_fault_message() is None
    site_gemm_chunk = 4
    message = _C._describe_device_fault(rank=3, site=site_gemm_chunk, address=0xABC0, expected=7, seen=6)
    for part in ("on rank 3", "chunk of rows", "0xabc0", ">= 7", "saw 6", "end the process"):
        assert part in message, (part, message)


def test_library_errors_keep_their_message():
    with pytest.raises(tdist.Error, match="TDIST_SYMMETRIC_HEAP_SIZE|heap_size"):
        _C.parse_size("12Q")
    with pytest.raises(tdist.Error, match="two_shot"):
        _C.check_methods(all_reduce="three_shot")
    with pytest.raises(tdist.Error, match="ce_push"):
        _C.check_methods(all_gather="bogus")
    with pytest.raises(tdist.Error, match="fused"):
        _C.check_methods(reduce_scatter="bogus")


# --- docstrings -------------------------------------------------------------------------------------

def _public(module):
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.ismodule(obj):
            continue
        yield f"{module.__name__}.{name}", obj
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr != "__call__":
                    continue
                if callable(member) or isinstance(member, property):
                    yield f"{module.__name__}.{name}.{attr}", member


def test_every_public_function_has_a_docstring():
    missing = [name for mod in (tdist, tdist.jit) for name, obj in _public(mod)
               if not (getattr(obj, "__doc__", None) or "").strip()]
    assert not missing, f"no docstring: {missing}"


def test_every_binding_converts_its_types():
    """A C++ type nanobind cannot convert shows up raw (std::..., (anonymous namespace)::...) in the
    generated signature, and the call would fail only when it returns; catch that without a GPU."""
    raw = []

    def check(name, obj):
        doc = getattr(obj, "__doc__", None) or ""
        if "std::" in doc or "anonymous namespace" in doc:
            raw.append(f"{name}: {doc.splitlines()[0] if doc else ''}")

    for name, obj in vars(_C).items():
        if callable(obj):
            check(name, obj)
        if isinstance(obj, type):
            for attr, member in vars(obj).items():
                target = getattr(member, "__func__", member)
                if isinstance(member, property):
                    target = member.fget
                if callable(target):
                    check(f"{name}.{attr}", target)
    assert not raw, "bindings with unconvertible types:\n" + "\n".join(raw)


def test_op_docstrings_describe_arguments():
    for f in (tdist.all_reduce, tdist.all_gather, tdist.reduce_scatter, tdist.init, tdist.empty):
        assert "Args:" in f.__doc__, f.__name__
    assert list(inspect.signature(tdist.all_gather).parameters) == ["input", "output", "method"]
    assert list(inspect.signature(tdist.reduce_scatter).parameters) == ["input", "output", "method"]
    assert list(inspect.signature(tdist.all_reduce).parameters) == ["tensor", "output", "method"]


# --- argument checks --------------------------------------------------------------------------------

def test_ops_before_init_say_so():
    x = CudaArray((8,))
    for call in (lambda: tdist.all_reduce(x), lambda: tdist.all_gather(x, CudaArray((16,))),
                 lambda: tdist.reduce_scatter(x, CudaArray((4,))), tdist.barrier, tdist.get_rank):
        with pytest.raises(tdist.Error, match=r"not initialised; call tdist\.init\(\) first"):
            call()


def test_argument_errors_without_gpu():
    with pytest.raises(tdist.Error, match="'input' must be a torch.Tensor or an array exporting DLPack"):
        tdist.all_reduce([1.0, 2.0])
    with pytest.raises(tdist.Error, match="'input' has dtype int32; supported dtypes are bfloat16, float16"):
        tdist.all_reduce(CudaArray((8,), "<i4"))
    with pytest.raises(tdist.Error, match="'input' has dtype float64"):
        tdist.all_gather(CudaArray((8,), "<f8"), CudaArray((16,)))
    with pytest.raises(tdist.Error, match="'input' must be contiguous"):
        tdist.all_reduce(CudaArray((4, 4), strides=(4, 32)))
    with pytest.raises(tdist.Error, match="'output' has dtype float16 but 'input' has float32"):
        _C.check_all_reduce(desc((8,)), desc((8,), "<f2", ptr=1 << 30))
    with pytest.raises(tdist.Error, match="'output' is required"):
        tdist.all_gather(CudaArray((8,)))
    with pytest.raises(tdist.Error, match="method must be a str"):
        tdist.all_reduce(CudaArray((8,)), method=2)


def test_dlpack_arguments():
    # A CUDA DLPack exporter made by the extension itself (never dereferenced).
    arr = _C.device_array(1 << 20, [3, 5], [], 2, 16, 0, None)
    assert describe(arr, "t", "x") == (1 << 20, 15, "float16", "cuda", 0, True)
    strided = _C.device_array(1 << 20, [3, 5], [10, 2], 4, 16, 0, None)
    assert describe(strided, "t", "x")[2:] == ("bfloat16", "cuda", 0, False)
    with pytest.raises(tdist.Error, match="must be contiguous"):
        tdist.all_reduce(strided)


def test_size_checks():
    n = 1000
    # all_reduce: same count; out-of-place buffers must not overlap.
    assert _C.check_all_reduce(desc((n,)), desc((n,), ptr=1 << 30)) == "f32"
    assert _C.check_all_reduce(desc((n,)), desc((n,))) == "f32"  # in place
    with pytest.raises(tdist.Error, match="'output' has 999 elements but 'input' has 1000"):
        _C.check_all_reduce(desc((n,)), desc((n - 1,), ptr=1 << 30))
    with pytest.raises(tdist.Error, match="overlap"):
        _C.check_all_reduce(desc((n,)), desc((n,), ptr=(1 << 20) + 64))
    # all_gather: output holds world_size x input; in place is input == output + rank * n.
    with pytest.raises(tdist.Error, match=r"expected world_size \* input.numel\(\) = 2 \* 1000 = 2000"):
        _C.check_all_gather(desc((n,)), desc((n,), ptr=1 << 30), 2)
    base = 1 << 30
    assert _C.check_all_gather(desc((n,), ptr=base + 4 * n), desc((2 * n,), ptr=base), 2, 1) == "f32"
    with pytest.raises(tdist.Error, match="overlaps 'output' other than in place"):
        _C.check_all_gather(desc((n,), ptr=base + 4), desc((2 * n,), ptr=base), 2, 1)
    # reduce_scatter: input holds world_size x output; in place is output == input + rank * n.
    with pytest.raises(tdist.Error, match=r"'input' has 1000 elements, expected world_size \* output.numel\(\) = "
                                          r"4 \* 200 = 800"):
        _C.check_reduce_scatter(desc((n,)), desc((200,), ptr=1 << 30), 4)
    assert _C.check_reduce_scatter(desc((4 * n,), ptr=base), desc((n,), ptr=base + 3 * 4 * n), 4, 3) == "f32"
    # the device check, when both are known
    with pytest.raises(tdist.Error, match="is on cuda:1 but tdist runs this rank on cuda:0"):
        _C.check_tensor("all_reduce", "input", (1 << 20, 4, "float32", "cuda", 1, True), 0)
    with pytest.raises(tdist.Error, match="must be a CUDA tensor, got one on device type 'cpu'"):
        _C.check_tensor("all_reduce", "input", (1 << 20, 4, "float32", "cpu", -1, True))


def test_init_argument_errors():
    with pytest.raises(tdist.Error, match="heap_size"):
        tdist.init(heap_size=-5)
    with pytest.raises(tdist.Error):
        tdist.init(heap_size="12Q")
    with pytest.raises(tdist.Error, match="timeout"):
        tdist.init(timeout=0)
    assert not tdist.is_initialized()
    tdist.finalize()  # a no-op when not initialised


# --- JIT --------------------------------------------------------------------------------------------

SCALE = r"""
#include <tdist/device.cuh>
template <typename T>
__global__ void scale(T* out, const T* in, T alpha, unsigned long long n) {
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (i < n) out[i] = alpha * in[i];
}
extern "C" __global__ void fill(int* out, int value) { out[threadIdx.x] = value + kOffset; }
"""


def test_jit_compile_for_explicit_arch_without_gpu():
    mod = tdist.jit.compile(SCALE, ["scale<float>", "scale<double>"], arch="sm_90a", file_name="scale.cu",
                            constants={"kOffset": ("int", 3)})
    assert mod.arch == "sm_90a"
    assert mod.cubin[:4] == b"\x7fELF"
    assert mod.lowered_name("scale<float>") == "_Z5scaleIfEvPT_PKS0_S0_y"
    assert mod.name_expressions == ["scale<float>", "scale<double>"]
    assert len(mod.key) == 64
    # the same request hits the in-process cache: same key
    again = tdist.jit.compile(SCALE, ["scale<float>", "scale<double>"], arch="90a", file_name="scale.cu",
                              constants=[("int", "kOffset", "3")])
    assert again.key == mod.key
    with pytest.raises(tdist.Error, match="scale<int>"):
        mod.lowered_name("scale<int>")


def test_jit_compile_error_has_the_log():
    with pytest.raises(tdist.Error, match=r"broken\.cu\(2\): error"):
        tdist.jit.compile("__global__ void k() {\n  undeclared_thing = 1;\n}\n", arch="sm_90a",
                          file_name="broken.cu")


def test_jit_rejects_bad_options():
    with pytest.raises(tdist.Error, match="sm_90a|arch"):
        tdist.jit.compile("__global__ void k() {}", arch="compute_90a")
    with pytest.raises(tdist.Error, match="nvrtc|nvcc|auto"):
        tdist.jit.compile("__global__ void k() {}", arch="sm_90a", compiler="gcc")


def test_jit_argument_packing():
    mod = tdist.jit.compile(SCALE, ["scale<float>"], arch="sm_90a", constants={"kOffset": ("int", 0)})
    k = mod.kernel("scale<float>", signature="float* __restrict__, const float*, float, size_t")
    assert k.signature == ["ptr", "ptr", "f32", "u64"]
    a = CudaArray((4,))
    assert tdist.jit._pack([a, None, 2.0, 4], k.signature) == [("ptr", 1 << 20), ("ptr", 0), ("f32", 2.0),
                                                              ("u64", 4)]
    assert tdist.jit._pack([a, tdist.jit.u64(4), tdist.jit.f32(1.5)], None)[1:] == [("u64", 4), ("f32", 1.5)]
    with pytest.raises(tdist.Error, match=r"Python int .* give its C type, e.g. tdist.jit.i32"):
        tdist.jit._pack([a, 4], None)
    with pytest.raises(tdist.Error, match="signature has 4 arguments, the launch passed 2"):
        tdist.jit._pack([a, a], k.signature)
    with pytest.raises(tdist.Error, match="argument 2 is tdist.jit.u64.* signature says f32"):
        tdist.jit._pack([a, a, tdist.jit.u64(1), 4], k.signature)
    with pytest.raises(tdist.Error, match="not a known type"):
        tdist.jit.parse_signature("float*, quaternion")
    with pytest.raises(tdist.Error, match="grid"):
        k(a, a, 2.0, 4, grid=0, block=32, stream=0)


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_jit_launch_without_gpu_raises_clear_error():
    mod = tdist.jit.compile(SCALE, ["scale<float>"], arch="sm_90a", constants={"kOffset": ("int", 0)})
    k = mod.kernel("scale<float>", signature="float*, const float*, float, u64")
    with pytest.raises(tdist.Error, match="no CUDA driver or GPU is available"):
        k(None, None, 2.0, 4, grid=1, block=32, stream=0)
    with pytest.raises(tdist.Error, match="out of range|does not fit|negative"):
        tdist.jit.Kernel(mod, "fill", ["ptr", "i32"])(None, 1 << 40, grid=1, block=1, stream=0)


def test_bench_help_needs_no_torch():
    out = subprocess.run([sys.executable, "-m", "tdist.bench", "--help"], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "--sizes" in out.stdout and "all_reduce" in out.stdout
    for word in ("ag_gemm", "gemm_rs", "gemm_ar", "--rows", "--json", "--graph-max"):
        assert word in out.stdout, word


@pytest.mark.parametrize("module,option", [("bench_layers", "--tokens"), ("bench_moe", "--routing"),
                                           ("bench_triton", "--rs-n"), ("bench_flash_decode", "--kv-len")])
def test_model_benchmarks_help_and_bad_options(module, option):
    """The benchmarks that need PyTorch and GPUs still print their help, and refuse an unknown option
    naming it, without them."""
    run = lambda *args: subprocess.run([sys.executable, "-m", f"tdist.{module}", *args], capture_output=True,
                                       text=True, cwd="/")
    out = run("--help")
    assert out.returncode == 0, out.stderr
    assert option in out.stdout and "--json" in out.stdout
    out = run("--no-such-option")
    assert out.returncode != 0 and "--no-such-option" in out.stderr


def test_flash_decode_random_cases():
    from tdist import bench_flash_decode as fd
    cases = fd.random_cases(300, 7, ["8b", "70b"], [1, 16, 64, 256])
    assert cases == fd.random_cases(300, 7, ["8b", "70b"], [1, 16, 64, 256])  # the seed fixes the list
    assert cases != fd.random_cases(300, 8, ["8b", "70b"], [1, 16, 64, 256])
    for model, batch, kv_len, page in cases:
        assert model in ("8b", "70b") and page in (1, 16, 64, 256)
        assert 1 <= batch < 64 and kv_len % page == 0 and kv_len >= 8 * page
        assert batch * kv_len < (4 << 20) or kv_len == 8 * page
    # spread over the draws: both models, every page size, batch 1 and batches above 32, short and long
    assert {c[0] for c in cases} == {"8b", "70b"} and {c[3] for c in cases} == {1, 16, 64, 256}
    assert min(c[1] for c in cases) == 1 and max(c[1] for c in cases) > 32
    assert min(c[2] for c in cases) < 4096 and max(c[2] for c in cases) > (512 << 10)
    assert fd._parse(["--random", "12", "--seed", "3"]).random == 12
    for bad in (["--random", "5", "--batch", "1"], ["--random", "5", "--kv-len", "4K"],
                ["--random", "5", "--plot", "x.png"], ["--random", "-1"]):
        with pytest.raises(SystemExit):
            fd._parse(bad)


def test_bench_graph_options():
    from tdist import bench
    assert bench._parse(["--graph-max", "4M"]).graph_max == 4 << 20
    assert bench._parse([]).graph_max == 0  # event timing unless asked
    with pytest.raises(SystemExit):
        bench._parse(["--ops-per-graph", "0"])


# --- overlapped GEMMs (ag_gemm, gemm_rs, gemm_ar) ---------------------------------------------------

from tdist import _overlap  # noqa: E402
from tdist._overlap import Operand  # noqa: E402

GEMMS = (tdist.ag_gemm, tdist.gemm_rs, tdist.gemm_ar)


def op_(shape, dtype="bfloat16", device="cuda", index=0, contiguous=True, ptr=1 << 20):
    return Operand(tuple(shape), dtype, device, index, contiguous, ptr)


def test_gemm_functions_exist_with_docstrings():
    for f in GEMMS:
        assert f.__name__ in tdist.__all__
        doc = f.__doc__
        for word in ("Args:", "Returns:", "Collective", "bfloat16", "float16", "multiples of 8", "torch.compile",
                     "CUDA graph", "warm-up", "heap_size", '"auto"', '"fused"', '"chunked"', '"sequential"',
                     '"baseline"'):
            assert word in doc, f"{f.__name__}: '{word}' missing from the docstring"
    assert "RowChunks" in tdist.ag_gemm.__doc__ and "RowChunks" in tdist.gemm_rs.__doc__
    assert "(M, N)" in tdist.ag_gemm.__doc__ and "(rows(rank), N)" in tdist.gemm_rs.__doc__
    sig = inspect.signature(tdist.ag_gemm)
    assert list(sig.parameters) == ["a_local", "b", "m", "method", "return_gathered"]
    assert all(sig.parameters[p].kind is inspect.Parameter.KEYWORD_ONLY for p in ("m", "method", "return_gathered"))
    for f in (tdist.gemm_rs, tdist.gemm_ar):
        sig = inspect.signature(f)
        assert list(sig.parameters) == ["a", "b", "method"]
        assert sig.parameters["method"].kind is inspect.Parameter.KEYWORD_ONLY


def test_gemm_ops_without_torch_say_so():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import tdist\n"
            "class A:\n"
            "    __cuda_array_interface__ = {'data': (1 << 20, False), 'shape': (8, 8), 'typestr': '<f2', "
            "'version': 3}\n"
            "for f in (tdist.ag_gemm, tdist.gemm_rs, tdist.gemm_ar):\n"
            "    try:\n"
            "        f(A(), A())\n"
            "    except tdist.Error as e:\n"
            "        assert f'tdist.{f.__name__} needs PyTorch' in str(e), e\n"
            "    else:\n"
            "        raise SystemExit(f'{f.__name__} ran without torch')\n"
            "try:\n"
            "    tdist.gemm_rs(A(), A(), method='quick')\n"
            "except tdist.Error as e:\n"
            "    assert 'method must be one of auto, fused, chunked, sequential, baseline' in str(e), e\n"
            "print('ok')\n")
    _prints_ok(code)


def test_gemm_methods_match_the_library():
    for m in _overlap.METHODS:
        assert _C.parse_overlap_method(m) == m
    with pytest.raises(tdist.Error, match="expected auto, fused, chunked, sequential or baseline, got 'fast'"):
        _C.parse_overlap_method("fast")
    with pytest.raises(tdist.Error, match=r"tdist.gemm_ar: method must be one of .*; got 'fast'"):
        _overlap.check_method("gemm_ar", "fast")
    with pytest.raises(tdist.Error, match="method must be a str"):
        _overlap.check_method("ag_gemm", None)


def test_row_chunks():
    # RowChunks{m, world}: the first m % world ranks own one row more, in rank order, covering [0, m).
    for m in (0, 1, 7, 8, 1001, 4096):
        for world in (1, 2, 3, 4, 8):
            rows = [_overlap.chunk_rows(m, world, r) for r in range(world)]
            assert sum(rows) == m
            assert rows == [m // world + (r < m % world) for r in range(world)]
            begins = [_overlap.chunk_begin(m, world, r) for r in range(world)]
            assert begins == [sum(rows[:r]) for r in range(world)]


def test_flash_decode_split_plan():
    from tdist.flash_decode import plan  # the module (tdist.flash_decode is the op)
    # Llama-3-8B heads (GQA 4 in one CTA), batch 1, 132 SMs: a wave of 8 x 32 CTAs at 128K; at 4K one
    # merge round of 16 splits (pieces of 256 tokens); at 1000 tokens pieces of one 64-token step.
    assert plan(1, 32, 8, 131072, 132) == (4, 1, 32)
    assert plan(1, 32, 8, 4096, 132) == (4, 1, 16)
    assert plan(1, 32, 8, 1000, 132) == (4, 1, 16)
    # Head dim 256: one CTA per SM; pieces of 128 tokens over two merge rounds of 8.
    assert plan(1, 32, 8, 2048, 132, head_dim=256, ctas_per_sm=1) == (4, 1, 16)
    # Batch 36 at 3968 tokens: 288 CTAs a split spill past the wave of 264; the model splits.
    assert plan(36, 32, 8, 3968, 132)[2] > 1
    with pytest.raises(tdist.Error, match="head_dim"):
        plan(1, 32, 8, 4096, 132, head_dim=96)


def test_flash_decode_cache_layouts():
    torch = pytest.importorskip("torch")
    from tdist.flash_decode import check_args

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    q, lens, table = meta(2, 32, 128), meta(2, dtype=torch.int32), meta(2, 10, dtype=torch.int32)
    k = meta(20, 16, 8, 128)
    assert check_args(q, k, meta(20, 16, 8, 128), lens, table)["page_stride"] == 0  # dense
    kv = meta(20, 2, 16, 8, 128)  # FlashInfer's combined cache: K and V pages two pages apart
    assert check_args(q, kv[:, 0], kv[:, 1], lens, table)["page_stride"] == 2 * 16 * 8 * 128
    padded = meta(2, 1000 + 8, 8, 128)[:, :1000]  # contiguous cache, sequences 8 rows further apart
    assert check_args(q, padded, padded, lens, None)["page_stride"] == 1008 * 8 * 128
    one = meta(1, 20, 8, 128)[:, :16]  # one page: its stride never matters
    assert check_args(q, one, meta(1, 16, 8, 128), lens, table[:, :1].contiguous())["page_stride"] == 0
    with pytest.raises(tdist.Error, match="'v_cache'.*page stride"):
        check_args(q, kv[:, 0], k, lens, table)
    with pytest.raises(tdist.Error, match="'k_cache'.*dense"):  # rows of a page not dense
        check_args(q, meta(20, 8, 16, 128).transpose(1, 2), k, lens, table)
    with pytest.raises(tdist.Error, match="'k_cache'.*apart"):  # every page the same memory
        check_args(q, k[:1].expand_as(k), k, lens, table)
    with pytest.raises(tdist.Error, match="'q'.*contiguous"):
        check_args(meta(2, 128, 32).transpose(1, 2), k, k, lens, table)


def test_ag_gemm_shape_checks():
    a, b = op_((5, 64)), op_((24, 64), ptr=1 << 30)
    # m derived: equal rows on every rank
    assert _overlap.ag_gemm_dims(a, b, None, 3, 1) == (15, 24, 64, 5)
    # m given: 14 rows over 3 ranks are 5, 5, 4
    assert _overlap.ag_gemm_dims(a, b, 14, 3, 1) == (14, 24, 64, 5)
    assert _overlap.ag_gemm_dims(op_((4, 64)), b, 14, 3, 2) == (14, 24, 64, 4)
    assert _overlap.ag_gemm_dims(op_((0, 64)), b, 2, 3, 2) == (2, 24, 64, 0)
    with pytest.raises(tdist.Error, match=r"'a_local' has 5 rows, but rank 2 owns 4 of m=14 rows over 3 ranks"):
        _overlap.ag_gemm_dims(a, b, 14, 3, 2)
    with pytest.raises(tdist.Error, match="m must be None or an int"):
        _overlap.ag_gemm_dims(a, b, 15.0, 3, 1)
    with pytest.raises(tdist.Error, match="m must be None or an int"):
        _overlap.ag_gemm_dims(a, b, True, 3, 1)
    with pytest.raises(tdist.Error, match=r"m must be in \[0, 2\^31\)"):
        _overlap.ag_gemm_dims(a, b, -3, 3, 1)
    with pytest.raises(tdist.Error, match=r"'a_local' has 64 columns but 'b' has 56; both are K"):
        _overlap.ag_gemm_dims(a, op_((24, 56)), None, 3, 1)
    with pytest.raises(tdist.Error, match=r"N \(rows of 'b'\) must be a positive multiple of 8, got 20"):
        _overlap.ag_gemm_dims(a, op_((20, 64)), None, 3, 1)
    with pytest.raises(tdist.Error, match=r"K \(columns of 'a_local' and 'b'\) must be a positive multiple of 8, got 60"):
        _overlap.ag_gemm_dims(op_((5, 60)), op_((24, 60)), None, 3, 1)


def test_gemm_operand_checks():
    a, b = op_((6, 64)), op_((24, 64))
    assert _overlap.gemm_rs_dims(a, b, 4, 1) == (6, 24, 64, 2)
    assert _overlap.gemm_rs_dims(a, b, 4, 3, op="gemm_ar") == (6, 24, 64, 1)
    cases = [
        (op_((6, 64), device="cpu", index=None), b, "'a' must be a CUDA tensor, got one on device type 'cpu'"),
        (op_((6, 64), dtype="float32"), b, "'a' has dtype float32; the overlapped GEMMs take bfloat16 or float16"),
        (a, op_((24, 64), dtype="float16"), "'b' has dtype float16 but 'a' has bfloat16; they must match"),
        (op_((6, 8, 8)), b, r"'a' must be 2-D, got shape \(6, 8, 8\)"),
        (op_((6, 64), contiguous=False), b, "'a' must be contiguous"),
        (op_((6, 64), ptr=(1 << 20) + 2), b, "'a' must start at a 16-byte aligned address, got 0x100002"),
        (a, op_((24, 64), index=1), "'b' is on cuda:1 but 'a' is on cuda:0; they must be on the same device"),
    ]
    for x, y, message in cases:
        with pytest.raises(tdist.Error, match=r"tdist\.gemm_rs: " + message):
            _overlap.gemm_rs_dims(x, y, 2, 0)
    # fake tensors: no address, no alignment check
    assert _overlap.gemm_rs_dims(op_((6, 64), ptr=None), b, 2, 0).m == 6


def test_gemm_descriptor_checks():
    """The C++ checks on descriptors (what the runtime runs right before the GEMM)."""
    base = 1 << 30
    m, n, k, world = 7, 24, 64, 2  # rank 0 owns rows 0..3, rank 1 rows 4..6
    a0, b = desc((4, k), "<f2", ptr=base), desc((n, k), "<f2", ptr=2 * base)
    d = desc((m, n), "<f2", ptr=3 * base)
    assert _C.check_overlap("ag_gemm", [a0, b, d, None], m, n, k, world, 0) == "f16"
    assert _C.check_overlap("ag_gemm", [desc((3, k), "<f2", ptr=base), b, d, desc((m, k), "<f2", ptr=4 * base)], m, n, k, world, 1) == "f16"
    with pytest.raises(tdist.Error, match=r"'a_local' has 256 elements, expected this rank's rows of m=7 \(3\) x "
                                          r"K=64 = 192"):
        _C.check_overlap("ag_gemm", [a0, b, d, None], m, n, k, world, 1)
    with pytest.raises(tdist.Error, match=r"'gathered' has 168 elements, expected m=7 x K=64 = 448"):
        _C.check_overlap("ag_gemm", [a0, b, d, desc((m, n), "<f2", ptr=4 * base)], m, n, k, world, 0)
    with pytest.raises(tdist.Error, match=r"'d' has 168 elements, expected this rank's rows of m=7 \(4\) x N=24"):
        _C.check_overlap("gemm_rs", [desc((m, k), "<f2", ptr=base), b, d, None], m, n, k, world, 0)
    assert _C.check_overlap("gemm_ar", [desc((m, k), "<f2", ptr=base), b, d, None], m, n, k, world, 0) == "f16"
    with pytest.raises(tdist.Error, match="'a' has dtype float32; the overlapped GEMMs take bfloat16 or float16"):
        _C.check_overlap("gemm_ar", [desc((m, k), ptr=base), b, d, None], m, n, k, world, 0)
    with pytest.raises(tdist.Error, match="'d' has dtype bfloat16 but 'a' has float16"):
        _C.check_overlap("gemm_ar", [desc((m, k), "<f2", ptr=base), b, (3 * base, m * n, "bfloat16", "cuda", 0, True), None], m, n, k, world, 0)
    with pytest.raises(tdist.Error, match="'d' overlaps 'b'"):
        _C.check_overlap("gemm_ar", [desc((m, k), "<f2", ptr=base), b, desc((m, n), "<f2", ptr=2 * base + 64), None], m, n, k, world, 0)
    with pytest.raises(tdist.Error, match="'b' must start at a 16-byte aligned address"):
        _C.check_overlap("gemm_ar", [desc((m, k), "<f2", ptr=base), desc((n, k), "<f2", ptr=2 * base + 8), d, None], m, n, k, world, 0)
    with pytest.raises(tdist.Error, match=r"N \(rows of 'b'\) must be a positive multiple of 8"):
        _C.check_overlap("gemm_ar", [desc((m, k), "<f2", ptr=base), desc((20, k), "<f2", ptr=2 * base), d, None], m, 20, k, world, 0)
    with pytest.raises(tdist.Error, match=r"K \(columns of 'a' and 'b'\) must be a positive multiple of 8"):
        _C.check_overlap("gemm_rs", [desc((m, 12), "<f2", ptr=base), desc((n, 12), "<f2", ptr=2 * base), d, None], m, n, 12, world, 0)
    with pytest.raises(tdist.Error, match=r"tdist.gemm_rs: takes 3 operands \(a, b, d\), got 4"):
        _C.check_overlap("gemm_rs", [desc((m, k), "<f2", ptr=base), b, d, desc((m, k), "<f2", ptr=4 * base)], m, n, k, world, 0)
    with pytest.raises(tdist.Error, match="no overlapped op is named 'gemm_a2a'"):
        _C.check_overlap("gemm_a2a", [a0, b, d, None], m, n, k, world, 0)
    with pytest.raises(tdist.Error, match="is on cuda:1 but tdist runs this rank on cuda:0"):
        _C.check_overlap("gemm_ar", [(base, m * k, "float16", "cuda", 1, True), b, d, None], m, n, k, world, 0, 0)


def test_gemm_context_bytes():
    mib = 1 << 20
    ag = _C.overlap_context_bytes("ag_gemm", "bfloat16", 16384, 0, 8192, 2)
    # gathered A + workspace (2 x 32 MiB) + the LL (2 MiB) and LL128 (4.3 MiB) buffers and flags
    assert 256 * mib + 64 * mib <= ag <= 256 * mib + 64 * mib + 7 * mib
    rs = _C.overlap_context_bytes("gemm_rs", "bfloat16", 16384, 8192, 0, 2)
    ar = _C.overlap_context_bytes("gemm_ar", "bfloat16", 16384, 8192, 0, 2)
    assert 256 * mib + 64 * mib <= rs and ar - rs >= 256 * mib
    small = _C.overlap_context_bytes("ag_gemm", "float16", 8, 0, 64, 2)
    assert small < 7 * mib  # tiny workspace for tiny problems (the LL and LL128 buffers stay)


# --- packaging: version, tools, environment report, bench contract ----------------------------------

import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402

from repo_scripts import REPO  # noqa: E402
TOOLS = ("tdistrun", "tdist-compile", "tdist-bench")


def test_one_version_everywhere():
    with open(os.path.join(REPO, "VERSION")) as f:
        expected = f.read().strip()
    assert tdist.__version__ == expected
    assert _C.version() == expected  # the libtdist that was loaded
    from importlib.metadata import version
    assert version("tdist") == expected
    report = _C.version_report()
    assert f"tdist: {expected}" in report and "NCCL built: 2." in report and "CUDA driver:" in report


def _tool_run(name, *args):
    from tdist import run
    return subprocess.run([sys.executable, "-m", "tdist.run", name, *args], capture_output=True, text=True,
                          timeout=60, cwd="/")


@pytest.mark.parametrize("name", TOOLS)
def test_tools_are_shipped_and_share_the_parser(name):
    from tdist import run
    assert os.access(run.tool_path(name), os.X_OK), run.tool_path(name)
    v = _tool_run(name, "--version")
    assert v.returncode == 0, v.stderr
    assert v.stdout.split() == [name, tdist.__version__]
    h = _tool_run(name, "--help")
    assert h.returncode == 0 and h.stdout.startswith(f"usage: {name}"), h.stderr
    bad = _tool_run(name, "--no-such-flag")
    assert bad.returncode == 2, (bad.stdout, bad.stderr)
    assert f"{name}: error: unknown option '--no-such-flag'" in bad.stderr
    assert "terminate called" not in bad.stderr


def test_console_scripts_are_installed():
    bindir = os.path.dirname(sys.executable)
    for name in TOOLS + ("tdist-collect-env",):
        assert os.access(os.path.join(bindir, name), os.X_OK), name
    out = subprocess.run([os.path.join(bindir, "tdist-bench"), "--sizes", "1K:4Q"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "tdist-bench: error: --sizes expects a size" in out.stderr


def test_tool_errors_name_no_build_machine_path():
    # A failure inside the library (no GPU here) is reported as 'tool: error:' with a path relative to
    # the source tree, and exit code 1, not an abort.
    out = _tool_run("tdist-compile", "--all", "--arch", "sm_bogus")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stderr.startswith("tdist-compile: error: ")
    assert REPO not in out.stderr and "terminate called" not in out.stderr


def _runpaths(path):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf not found")
    out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"R(?:UN)?PATH\)\s+Library r(?:un)?path: \[(.*)\]", out)


def test_libraries_carry_no_build_machine_path():
    pkg = os.path.dirname(tdist.__file__)
    from tdist import run
    files = [os.path.join(pkg, f) for f in os.listdir(pkg) if f.startswith(("libtdist", "_C."))]
    files += [run.tool_path(t) for t in TOOLS]
    assert len(files) >= 2 + len(TOOLS), files
    for path in files:
        for runpath in _runpaths(path):
            for entry in runpath.split(":"):
                assert entry.startswith("$ORIGIN"), f"{path}: RUNPATH entry {entry!r} is a build-machine path"


def test_collect_env_without_gpu_or_torch():
    env = dict(os.environ, TDIST_DEBUG="INFO", TDIST_STORE_SECRET="0123456789abcdef", TDIST_UNKNOWN_THING="1")
    out = subprocess.run([sys.executable, "-m", "tdist.collect_env"], capture_output=True, text=True, timeout=120,
                         cwd="/", env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"tdist (package): {tdist.__version__}" in text
    assert f"libtdist: {tdist.__version__}" in text
    for word in ("NCCL built:", "NCCL loaded:", "CUDA runtime built:", "CUDA runtime loaded:", "CUDA driver:",
                 "JIT cache", "TDIST_CACHE_DIR", "TDIST_HOST_TIMEOUT_S", "300 (default)", "TDIST_DEBUG",
                 "INFO (set)", "TDIST_UNKNOWN_THING", "libtdist.so"):
        assert word in text, word
    assert "0123456789abcdef" not in text  # secrets stay hidden


def test_bench_without_torch_says_what_to_install():
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("torch is installed here")
    out = subprocess.run([sys.executable, "-m", "tdist.bench", "--ops", "all_reduce"], capture_output=True,
                         text=True, timeout=60, cwd="/")
    assert out.returncode == 2
    assert "needs PyTorch" in out.stderr and "pip install torch" in out.stderr
    assert "Traceback" not in out.stderr


def test_bench_shares_flags_with_the_cpp_benches():
    from tdist import bench
    a = bench._parse(["--op", "all_gather", "--method", "auto", "--sizes", "1K:8K", "--dtype", "f16"])
    assert a.ops == ["all_gather"] and a.methods == "auto" and a.dtype == "fp16"
    assert a.sizes == [1024, 2048, 4096, 8192]
    assert a.iters == 20
    assert bench._parse(["--sizes", "4K,1M"]).sizes == [4096, 1 << 20]
    for bad in ("1K,4Q", "8K:1K", "1K,,4K"):
        with pytest.raises(SystemExit):
            bench._parse(["--sizes", bad])


def test_bench_json_is_valid_and_drawn(tmp_path):
    from tdist import bench
    args = bench._parse(["--ops", "all_reduce,ag_gemm", "--graph-max", "4K"])
    rows = [("all_reduce", 4096, {"tdist": 5.0, "nccl": float("nan")}, 1.0),
            ("all_reduce", 1 << 20, {"tdist": 20.0, "nccl": 30.0}, 1.0)]
    gemm_rows = [{"op": "ag_gemm", "m": 1024, "n": 7168, "k": 8192, "shape": "s",
                  "us": {"tdist auto": 100.0, "nccl+mm": 120.0, "mm": float("inf")}, "diff": {"tdist auto": 0.0},
                  "resolved": {"auto": "chunked"}, "tflops_per_gpu": {"tdist auto": 1.0, "nccl+mm": 0.8}}]
    doc = bench.result_document(args, 2, rows, gemm_rows, gpu="test \"gpu\"", command="x")
    text = json.dumps(doc, allow_nan=False)  # raises on NaN: non-finite numbers must be null
    back = json.loads(text)
    assert back["schema"] == "tdist.bench/1" and back["tdist_version"] == tdist.__version__
    nccl = [r for r in back["rows"] if r.get("bytes") == 4096 and r["impl"] == "nccl"]
    assert nccl and nccl[0]["us"] is None
    auto = [r for r in back["rows"] if r["op"] == "ag_gemm" and r["impl"] == "tdist"]
    assert auto[0]["resolved"] == "chunked" and auto[0]["method"] == "auto"
    plot = os.path.join(REPO, "bench", "plot.py")
    if not os.path.exists(plot):
        pytest.skip("bench/plot.py is not beside these tests")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed")
    path = tmp_path / "r.json"
    path.write_text(text)
    out = subprocess.run([sys.executable, plot, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "r.png").exists() and (tmp_path / "r_gemm.png").exists()


# --- the catalogue of overlapped ops (C++'s OverlapOpTraits, read by Python) ---------------------

def test_catalogue_matches_the_library():
    names = sorted(_overlap.ops())
    assert names == ["ag_gemm", "ag_gemm_swiglu", "gemm_ar", "gemm_rs"]
    assert sorted(tdist.overlap_ops()) == names
    swiglu = _overlap.op_traits("ag_gemm_swiglu")
    assert swiglu.n_multiple == 16 and swiglu.takes_m
    assert [o[0] for o in swiglu.inputs] == ["a_local", "b"]
    assert [o[0] for o in swiglu.outputs] == ["d"] and [o[0] for o in swiglu.optional_outputs] == ["gathered"]
    assert not _overlap.op_traits("gemm_rs").takes_m
    with pytest.raises(tdist.Error, match="no overlapped op is named 'gemm_a2a'.*known: ag_gemm, ag_gemm_swiglu"):
        _overlap.op_traits("gemm_a2a")
    # Every catalogue op beyond the hand-written three is a function of the package.
    assert "ag_gemm_swiglu" in tdist.__all__ and callable(tdist.ag_gemm_swiglu)
    assert "silu" in tdist.ag_gemm_swiglu.__doc__ and "Collective" in tdist.ag_gemm_swiglu.__doc__


def test_catalogue_shapes_of_a_new_op():
    a, b = op_((5, 64)), op_((32, 64), ptr=1 << 30)
    dims = _overlap.call_dims("ag_gemm_swiglu", {"a_local": a, "b": b}, None, 3, 1)
    assert dims == (15, 32, 64, 5)
    assert _overlap.shape_of(("M", "N/2"), dims) == (15, 16)
    assert _overlap.shape_of(("rows", "K"), dims) == (5, 64)
    with pytest.raises(tdist.Error, match=r"tdist.ag_gemm_swiglu: N \(rows of 'b'\) must be a positive multiple of "
                                          r"16, got 24"):
        _overlap.call_dims("ag_gemm_swiglu", {"a_local": a, "b": op_((24, 64))}, None, 3, 1)
    base = 1 << 30
    m, n, k, world = 7, 32, 64, 2
    good = [desc((4, k), "<f2", ptr=base), desc((n, k), "<f2", ptr=2 * base), desc((m, n // 2), "<f2", ptr=3 * base)]
    assert _C.check_overlap("ag_gemm_swiglu", good, m, n, k, world, 0) == "f16"
    with pytest.raises(tdist.Error, match=r"'d' has 224 elements, expected m=7 x N/2=16 = 112"):
        _C.check_overlap("ag_gemm_swiglu", good[:2] + [desc((m, n), "<f2", ptr=3 * base)], m, n, k, world, 0)
    with pytest.raises(tdist.Error, match="'d' is missing"):
        _C.check_overlap("ag_gemm_swiglu", good[:2], m, n, k, world, 0)
    heap = _C.overlap_context_bytes("ag_gemm_swiglu", "bfloat16", 4096, 2048, 1024, 2)
    assert heap == _C.overlap_context_bytes("ag_gemm", "bfloat16", 4096, 0, 1024, 2)  # its h is ordinary memory


def test_overlap_without_torch_says_so():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import tdist\n"
            "try:\n"
            "    tdist.overlap('ag_gemm_swiglu', object(), object())\n"
            "except tdist.Error as e:\n"
            "    assert 'tdist.ag_gemm_swiglu needs PyTorch' in str(e), e\n"
            "else:\n"
            "    raise SystemExit('ran without torch')\n"
            "print('ok')\n")
    _prints_ok(code)


# --- random benchmark sweeps (the port of include/tdist/common/random_sweep.hpp) ---------------------

def test_bench_random_sizes():
    from tdist import bench
    for elem in (2, 4):
        sizes = bench.random_sizes(600, 5, elem)
        assert len(sizes) == 600 and sizes == sorted(sizes)
        assert all(1 << 10 <= s <= 1 << 30 and s % elem == 0 for s in sizes)
        odd = [s for s in sizes if (s // elem) % 2]
        assert len(odd) > 600 // 4 and all(s % 16 for s in odd)  # odd element counts, never 16-byte multiples
        assert any(s % 16 == 0 for s in sizes)
        assert {s.bit_length() - 1 for s in sizes} == set(range(10, 30))  # log-uniform: every octave
    assert bench.random_sizes(40, 9, 2) == bench.random_sizes(40, 9, 2)
    assert bench.random_sizes(40, 9, 2) != bench.random_sizes(40, 10, 2)


def test_bench_random_gemm_shapes():
    from tdist import bench
    shapes = bench.random_gemm_shapes(600, 5)
    assert len(shapes) == 600 and shapes == sorted(shapes)
    assert all(128 <= m < 16384 for m, _, _ in shapes)
    assert sum(m % 128 != 0 for m, _, _ in shapes) > 600 // 2  # M no tile divides
    assert any(m % 128 == 0 for m, _, _ in shapes)
    assert all(1024 <= v <= 28672 and v % 8 == 0 for _, n, k in shapes for v in (n, k))
    assert max(max(n, k) for _, n, k in shapes) > 24576
    assert bench.random_gemm_shapes(20, 3) == bench.random_gemm_shapes(20, 3)


def test_bench_random_flags():
    from tdist import bench
    a = bench._parse(["--sizes", "random:30", "--seed", "7"])
    assert a.seed == 7 and a.sizes == bench.random_sizes(30, 7, 2)
    assert bench._parse(["--sizes", "random:30", "--seed", "7", "--dtype", "fp32"]).sizes == bench.random_sizes(30, 7, 4)
    assert bench._parse(["--sizes", "random:3"]).seed == 1
    g = bench._parse(["--ops", "ag_gemm,gemm_rs", "--shapes", "random:4", "--seed", "2"])
    assert g.shapes == bench.random_gemm_shapes(4, 2)
    assert bench._parse(["--ops", "gemm_rs", "--shapes", "100x1024x2048"]).shapes == [(100, 1024, 2048)]
    # ag_gemm splits N over the ranks, gemm_rs / gemm_ar K, as bench_gemm_overlap does.
    layers = [(100, 1024, 2048)]
    assert bench._gemm_shapes("ag_gemm", [], 2, layers)[0][:3] == (100, 512, 2048)
    assert bench._gemm_shapes("gemm_ar", [], 2, layers)[0][:3] == (100, 1024, 1024)
    args = bench._parse(["--sizes", "random:2", "--seed", "11"])
    assert bench.result_document(args, 2, [], [], command="x")["seed"] == 11


@pytest.mark.parametrize("argv,option", [
    (["--sizes", "random:0"], "--sizes"), (["--sizes", "random:x"], "--sizes"), (["--sizes", "random:-3"], "--sizes"),
    (["--shapes", "random:0"], "--shapes"), (["--shapes", "random:x"], "--shapes"),
    (["--shapes", "random:-3"], "--shapes"), (["--shapes", "128x1004x1024"], "--shapes"),
    (["--shapes", "random:2", "--rows", "128"], "--shapes"), (["--seed", "-1"], "--seed")])
def test_bench_random_bad_specs(argv, option, capsys):
    from tdist import bench
    with pytest.raises(SystemExit) as e:
        bench._parse(argv)
    assert e.value.code == 2
    assert option in capsys.readouterr().err


def test_bench_random_sizes_match_tdist_bench():
    bindir = os.path.dirname(sys.executable)
    for seed, dtype, elem in ((1, "bf16", 2), (42, "f32", 4), ((1 << 63) - 1, "bf16", 2)):
        out = subprocess.run([os.path.join(bindir, "tdist-bench"), "--sizes", "random:50", "--seed", str(seed),
                              "--dtype", dtype, "--print-sweep"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        from tdist import bench
        assert [int(x) for x in out.stdout.split()] == bench.random_sizes(50, seed, elem)
    for bad in ("random:0", "random:x", "random:-3"):
        out = subprocess.run([os.path.join(bindir, "tdist-bench"), "--sizes", bad], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2
        assert "tdist-bench: error: --sizes expects random:N" in out.stderr


# --- expert parallelism and the MoE ops (no GPU) -----------------------------------------------------

def test_ep_and_moe_exist():
    from tdist import ep, moe
    assert callable(ep.Buffer) and callable(ep.heap_bytes) and callable(ep.count_tokens)
    for name in ("low_latency_dispatch", "low_latency_combine", "dispatch", "combine", "check_errors", "close"):
        assert callable(getattr(ep.Buffer, name)), name
    for name in ("moe_ag_group_gemm", "moe_ag_group_gemm_fp8", "moe_group_gemm_rs", "moe_group_gemm_rs_fp8",
                 "moe_group_gemm_ar", "moe_group_gemm_ar_fp8"):
        assert getattr(tdist, name) is getattr(moe, name) and name in tdist.__all__
    assert "ep" in tdist.__all__ and "moe" in tdist.__all__


def test_ep_config_errors_name_the_field():
    assert tdist.ep.heap_bytes(128, 7168, 256, 8, 2) > tdist.ep.heap_bytes(64, 7168, 256, 8, 2) > 0
    assert tdist.ep.heap_bytes(4096, 7168, 256, 8, 2, mode="high_throughput") > 0
    for kwargs, field in ((dict(num_experts=255), "'config.num_experts'"), (dict(hidden=100), "'config.hidden'"),
                          (dict(topk=33), "'config.topk'"), (dict(max_tokens_per_rank=0), "'config.max_tokens'")):
        args = dict(max_tokens_per_rank=128, hidden=7168, num_experts=256, topk=8, world_size=2)
        args.update(kwargs)
        with pytest.raises(tdist.Error, match=field):
            tdist.ep.heap_bytes(**args)
    with pytest.raises(tdist.Error, match="'mode'"):
        tdist.ep.heap_bytes(128, 7168, 256, 8, 2, mode="fast")


def test_ep_count_tokens():
    # rank 0 holds experts 0..3, rank 1 experts 4..7; -1 masks, a repeat and an id out of range are not sent
    ranks, experts = tdist.ep.count_tokens([[0, 5], [1, -1], [7, 7], [2, 8]], 8, 2)
    assert ranks == [3, 2]
    assert experts == [1, 1, 1, 0, 0, 1, 0, 1]


def test_moe_routing_reference_and_errors():
    from tdist import moe
    ids = [[0, 1], [1, 2], [3, 0], [1, 3], [2, 0]]
    r = moe.routing_reference(ids, 4, world_size=2, rank=1)
    assert r["counts"] == [3, 3, 2, 2]
    assert r["offsets"] == [0, 128, 256, 384, 512]
    assert len(r["row_of_pair"]) == 5 and moe.capacity(5, 2, 4) >= r["offsets"][-1]
    for t, row in enumerate(ids):
        for k, e in enumerate(row):
            q = r["row_of_pair"][t][k]
            assert r["offsets"][e] <= q < r["offsets"][e] + r["counts"][e] and r["token_of_row"][q] == t
    first = [r["token_of_row"][q] for q in range(r["offsets"][1], r["offsets"][1] + 3)]
    assert first == [3, 0, 1]  # expert 1: rank 1's token 3 first, then rank 0's tokens 0 and 1
    assert moe.rows_of(5, 2, 0) == (0, 3) and moe.rows_of(5, 2, 1) == (3, 2) and moe.rows_of(1, 2, 1) == (1, 0)
    with pytest.raises(tdist.Error, match="'topk_ids'"):
        moe.routing_reference([[0, 4]], 4)
    with pytest.raises(tdist.Error, match="'topk'"):
        moe.routing_reference([[0, 1, 2]], 2)
    assert moe.method(64, 1) == "baseline" and moe.method(4096, 2) == "chunked"


def test_moe_and_ep_need_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import tdist\n"
            "for fn in (lambda: tdist.moe_ag_group_gemm(None, None, None),\n"
            "           lambda: tdist.moe_group_gemm_rs(None, None, None, None),\n"
            "           lambda: tdist.ep.Buffer(None, 128, 7168, 256, 8)):\n"
            "    try:\n"
            "        fn()\n"
            "    except tdist.Error as e:\n"
            "        assert 'needs PyTorch' in str(e), e\n"
            "    else:\n"
            "        raise SystemExit('worked without torch')\n"
            "print('ok')\n")
    _prints_ok(code)


class _StandInRuntime:
    world_size, rank, device, closed = 2, 1, 0, False


def test_ep_and_moe_fake_implementations():
    """The torch.library ops' fake implementations (shapes, argument errors) on meta tensors, with a
    stand-in buffer and runtime: no GPU needed."""
    torch = pytest.importorskip("torch")
    from tdist import _runtime, ep, moe
    b = object.__new__(ep.Buffer)
    b.max_tokens, b.hidden, b.num_experts, b.topk = 64, 384, 8, 4
    b.mode, b.expert_alignment, b.world_size, b.rank, b.device = "low_latency", 128, 2, 1, 0
    b.num_local_experts, b.id = 4, 999
    ep._buffers[999] = b
    try:
        x = torch.empty((5, 384), dtype=torch.bfloat16, device="meta")
        idx = torch.empty((5, 4), dtype=torch.int64, device="meta")
        w = torch.empty((5, 4), dtype=torch.float32, device="meta")
        rx, rs, rc, rr, meta = torch.ops.tdist.ep_ll_dispatch(999, x, idx, True, False, False)
        assert rx.shape == (4, 128, 384) and rx.dtype == torch.float8_e4m3fn and rs.shape == (4, 128, 3)
        assert rc.shape == (4,) and rr.shape == (4, 128) and meta.shape == (2,)
        rx, rs, rc, rr, meta = torch.ops.tdist.ep_ll_dispatch(999, x, idx, False, False, False)
        assert rx.dtype == torch.bfloat16 and rs.shape == (0,)
        y = torch.empty((4, 128, 384), dtype=torch.bfloat16, device="meta")
        out, m2 = torch.ops.tdist.ep_ll_combine(999, y, idx, w, rc, 1, False)
        assert out.shape == (5, 384) and out.dtype == torch.bfloat16
        with pytest.raises(tdist.Error, match="'topk_idx'"):
            torch.ops.tdist.ep_ll_dispatch(999, x, idx.int(), False, False, False)
        with pytest.raises(tdist.Error, match="'x'"):
            b.low_latency_dispatch(x.float(), idx)
        with pytest.raises(tdist.Error, match="'self'"):
            b.dispatch(x, idx, w)
    finally:
        ep._buffers.pop(999)
    _runtime._state.runtime = _StandInRuntime()
    try:
        ids = torch.empty((301, 2), dtype=torch.int32, device="meta")
        xr = torch.empty((150, 200), dtype=torch.bfloat16, device="meta")
        wt = torch.empty((8, 136, 200), dtype=torch.bfloat16, device="meta")
        d = torch.ops.tdist.moe_ag_group_gemm(xr, ids, wt, "auto")
        assert d.shape == (moe.capacity(301, 2, 8), 136)
        with pytest.raises(tdist.Error, match="'x_rows'"):
            torch.ops.tdist.moe_ag_group_gemm(torch.empty((151, 200), dtype=torch.bfloat16, device="meta"), ids, wt, "auto")
        h = torch.empty((moe.capacity(301, 2, 8), 200), dtype=torch.bfloat16, device="meta")
        tw = torch.empty((301, 2), dtype=torch.float32, device="meta")
        y = torch.ops.tdist.moe_group_gemm_rs(h, wt, ids, tw, "auto", False)
        assert y.shape == (150, 136)
        y = torch.ops.tdist.moe_group_gemm_rs(h, wt, ids, tw, "auto", True)
        assert y.shape == (301, 136)
        with pytest.raises(tdist.Error, match="'method'"):
            tdist.moe_group_gemm_rs(h, wt, ids, tw, method="ll")
        # fused is the first projection's method only
        y = torch.ops.tdist.moe_ag_group_gemm(torch.empty((150, 200), dtype=torch.bfloat16, device="meta"), ids, wt,
                                              "fused")
        with pytest.raises(tdist.Error, match="'method'.*'auto' or 'chunked' or 'baseline'"):
            tdist.moe_group_gemm_rs(h, wt, ids, tw, method="fused")
        assert moe.rs_method("fused") == "chunked" and moe.rs_method("baseline") == "baseline"
        with pytest.raises(tdist.Error, match="'h'"):
            tdist.moe_group_gemm_ar(h[:-1], wt, ids, tw)
        # FP8 AllGather: e4m3 rows [150, 208] with scales [150, 2], weights [8, 136, 208] with [8, 2, 2]
        e4m3 = torch.float8_e4m3fn
        xq = torch.empty((150, 208), dtype=e4m3, device="meta")
        xs = torch.empty((150, 2), dtype=torch.float32, device="meta")
        wq = torch.empty((8, 136, 208), dtype=e4m3, device="meta")
        ws = torch.empty((8, 2, 2), dtype=torch.float32, device="meta")
        d = torch.ops.tdist.moe_ag_group_gemm_fp8(xq, xs, ids, wq, ws, "chunked")
        assert d.shape == (moe.capacity(301, 2, 8), 136) and d.dtype == torch.bfloat16
        d = torch.ops.tdist.moe_ag_group_gemm_fp8(xq, xs, ids, wq, ws, "fused")
        assert d.shape == (moe.capacity(301, 2, 8), 136)
        d = torch.ops.tdist.moe_ag_group_gemm_fp8(xq, xs.t().contiguous().t(), ids, wq, ws, "auto")  # column-major
        assert d.shape == (moe.capacity(301, 2, 8), 136)
        bad = [(dict(method="sequential"), "'method'.*'auto' or 'fused' or 'chunked' or 'baseline'"),
               (dict(x_rows=xq.to(torch.bfloat16)), "'x_rows'"), (dict(x_rows=xq[:149]), "'x_rows'"),
               (dict(x_scales=xs[:, :1]), "'x_scales'"),
               (dict(w_scales=ws[:, :1]), "'w_scales'"), (dict(w=wq[..., :200]), "'w'"),
               (dict(w=torch.empty((8, 136, 200), dtype=e4m3, device="meta")), "'w'.*multiple of 16"),
               (dict(topk_ids=ids.float()), "'topk_ids'")]
        # FP8 second projection: h e4m3 [capacity, 208] with [capacity, 2]; w2 [8, 136, 208] with [8, 2, 2]
        hq = torch.empty((moe.capacity(301, 2, 8), 208), dtype=e4m3, device="meta")
        hs = torch.empty((moe.capacity(301, 2, 8), 2), dtype=torch.float32, device="meta")
        y = torch.ops.tdist.moe_group_gemm_rs_fp8(hq, hs, wq, ws, ids, tw, "chunked", False)
        assert y.shape == (150, 136) and y.dtype == torch.bfloat16
        y = torch.ops.tdist.moe_group_gemm_rs_fp8(hq, hs, wq, ws, ids, tw, "auto", True)
        assert y.shape == (301, 136) and y.dtype == torch.bfloat16
        for call, words in ((lambda: tdist.moe_group_gemm_rs_fp8(hq, hs, wq, ws, ids, tw, method="fused"), "'method'"),
                            (lambda: tdist.moe_group_gemm_rs_fp8(hq[:-1], hs, wq, ws, ids, tw), "'h'"),
                            (lambda: tdist.moe_group_gemm_rs_fp8(hq, hs[:, :1], wq, ws, ids, tw), "'h_scales'"),
                            (lambda: tdist.moe_group_gemm_ar_fp8(hq, hs, wq, ws, ids, tw[:, :1]), "'topk_weights'")):
            with pytest.raises(tdist.Error, match=words):
                call()
        for change, words in bad:
            args = dict(x_rows=xq, x_scales=xs, topk_ids=ids, w=wq, w_scales=ws, method="auto")
            args.update(change)
            with pytest.raises(tdist.Error, match=words):
                tdist.moe_ag_group_gemm_fp8(args["x_rows"], args["x_scales"], args["topk_ids"], args["w"],
                                            args["w_scales"], method=args["method"])
    finally:
        _runtime._state.runtime = None
