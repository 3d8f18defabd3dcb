"""The core's CUDA kernels, built once per machine.

MLX builds a ``mx.fast.cuda_kernel`` with NVRTC at its first launch in every process and
keeps the result in memory only; with MLX's device headers that costs about 3 s a kernel on
an H200 host, paid before the first token of every run. :class:`CudaKernel` takes the same
kernel body, builds it with NVRTC against CUDA's own headers into a cubin for this GPU, keeps
the cubin in MLX's kernel cache folder (``MLX_PTX_CACHE_DIR``, else MLX's default) and
launches it with ``mx.fast.precompiled_cuda_kernel``: a later process reads the file. Where
NVRTC cannot be loaded or the build fails, the kernel is ``mx.fast.cuda_kernel`` itself
(the call and its results are the same).

MLX hashes a precompiled kernel's whole image at every launch (to find its loaded module),
a host cost that grows with the image (0.2-0.4 us a KiB, ``bench/launch_cost.py``) and that
a decode step pays for each of its kernels. So where nvFatbin is installed (NVIDIA's
``nvidia-nvfatbin`` wheel, the ``cuda13`` extra) and this machine's driver loads the result,
a launch hands MLX the cubin packed into a compressed fat binary (zstd: about a third of
the bytes), kept beside the cubin; the driver unpacks it once, when MLX loads the module.
``MLXRUNNER_PACKED_KERNELS=0`` (:mod:`mlxrunner.settings`) launches the cubins themselves.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from .. import settings
from ..constants import constant, in_compiled
from .kernels import code_of, kernel_cache_folder

log = logging.getLogger("mlxrunner.nn")

#: the CUDA spelling of each dtype a kernel's inputs, outputs and ``using`` lines take
CUDA_TYPES = {mx.bool_: "bool", mx.int32: "int", mx.uint32: "unsigned int",
              mx.int64: "long long", mx.uint64: "unsigned long long", mx.float32: "float",
              mx.float16: "__half", mx.bfloat16: "__nv_bfloat16"}
HEADER = "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"

TemplateArg = tuple[str, "int | bool | mx.Dtype"]


def kernel_source(symbol: str, source: str, inputs: Sequence[tuple[str, mx.Dtype]],
                  outputs: Sequence[tuple[str, mx.Dtype]], template: Sequence[TemplateArg],
                  absent: Sequence[tuple[str, mx.Dtype]] = (),
                  absent_outputs: Sequence[tuple[str, mx.Dtype]] = ()) -> str:
    """A whole translation unit for ``source``, a kernel body as ``mx.fast.cuda_kernel``
    takes it: inputs as ``const T*``, outputs as ``T*``, template arguments as ``constexpr``
    and ``using`` lines, under the C name ``symbol``; each ``absent`` input and
    ``absent_outputs`` output a null pointer of its own (no argument)."""
    args = [f"    const {CUDA_TYPES[dtype]}* {name}" for name, dtype in inputs]
    args += [f"    {CUDA_TYPES[dtype]}* {name}" for name, dtype in outputs]
    lines = [HEADER, f'extern "C" __global__ void {symbol}(', ",\n".join(args) + ") {"]
    lines += [f"  const {CUDA_TYPES[dtype]}* const {name} = nullptr;" for name, dtype in absent]
    lines += [f"  {CUDA_TYPES[dtype]}* const {name} = nullptr;" for name, dtype in absent_outputs]
    for key, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {key} = {value};")
        else:
            lines.append(f"  using {key} = {CUDA_TYPES[value]};")
    lines += [source, "}", ""]
    return "\n".join(lines)


#: A kernel-body snippet: ``block_reduce(v, take_max, scratch)``, the block's sum (or, with
#: ``take_max``, maximum) of one float a thread, for every thread of the block (NT threads,
#: every one calling it); ``scratch``: NT / 32 floats of shared memory, free again after.
BLOCK_REDUCE = r"""
    const auto block_reduce = [&](float v, bool take_max, float* scratch) {
        for (int o = 16; o > 0; o >>= 1) {
            const float other = __shfl_xor_sync(0xffffffff, v, o);
            v = take_max ? fmaxf(v, other) : v + other;
        }
        if ((threadIdx.x & 31) == 0) {
            scratch[threadIdx.x >> 5] = v;
        }
        __syncthreads();
        float r = take_max ? -3.0e38f : 0.f;
        for (int w = 0; w < NT / 32; ++w) {
            r = take_max ? fmaxf(r, scratch[w]) : r + scratch[w];
        }
        __syncthreads();  // (scratch is written again by the next call)
        return r;
    };
"""


def block_counters(count: int) -> mx.array:
    """``count`` block counters at 0 for one launch (int32; a launch's blocks count
    themselves out on one, and the block whose count wraps it back to 0 finishes the work):
    each launch its own (two launches that share one and may run at once, as a traced step
    and the eager step checking it in one evaluation, would count each other's blocks). In
    the GPU's own memory: MLX serves arrays of up to 8 bytes, and any array made from host
    values, from managed memory, whose pages the host touches every step (a step's offset,
    its sampled token); the blocks' atomics on such a page moved it back and forth (a Gemma
    4 E2B step on an H100 waited 20 ms for its GPU, 0.1-1 ms before counters). While the
    core traces a function for ``mx.compile`` (:func:`mlxrunner.constants.compiling`),
    evaluated now: a constant every call reuses; else a fill before the launch (in a
    function compiled elsewhere, which MLX's compile may merge with another launch's)."""
    counter = mx.zeros((max(count, 4),), mx.int32)  # (16 bytes at least: past MLX's pool
    if in_compiled():                                # of managed scalars)
        mx.eval(counter)
    return counter


class NVRTC:
    """NVRTC through ctypes: CUDA source to a cubin."""

    def __init__(self, library: str, includes: Sequence[str]) -> None:
        self.lib = ctypes.CDLL(library)
        self.includes = list(includes)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)),
                    "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, result: int, call: str, log_text: str = "") -> None:
        if result:
            raise RuntimeError(f"{call} failed ({result})" + (f": {log_text}" if log_text
                                                              else ""))

    def cubin(self, source: str, arch: str) -> bytes:
        """``source`` built for ``arch`` (``sm_90``); RuntimeError with NVRTC's log."""
        program = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(),
                                                b"mlxrunner.cu", 0, None, None),
                    "nvrtcCreateProgram")
        try:
            options = [f"--gpu-architecture={arch}".encode(), b"--std=c++17",
                       *(f"--include-path={i}".encode() for i in self.includes)]
            built = self.lib.nvrtcCompileProgram(
                program, len(options), (ctypes.c_char_p * len(options))(*options))
            if built:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
                text = ctypes.create_string_buffer(size.value)
                self.lib.nvrtcGetProgramLog(program, text)
                self._check(built, "nvrtcCompileProgram",
                            text.value.decode(errors="replace").strip()[:2000])
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(program, ctypes.byref(size)),
                        "nvrtcGetCUBINSize")
            data = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(program, data), "nvrtcGetCUBIN")
            return data.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(program))


class NvFatbin:
    """nvFatbin through ctypes: a cubin into a fat binary whose one entry is compressed."""

    #: how an entry may be compressed, in the order tried: for size (zstd, which drivers
    #: read since CUDA 12.8), then for speed (LZ4, which older ones read too)
    MODES = ("size", "speed")

    def __init__(self, library: str) -> None:
        self.lib = ctypes.CDLL(library)
        self.mode = self.MODES[0]
        major, minor = ctypes.c_uint(), ctypes.c_uint()
        self._check(self.lib.nvFatbinVersion(ctypes.byref(major), ctypes.byref(minor)),
                    "nvFatbinVersion")
        self.version = (major.value, minor.value)

    def _check(self, result: int, call: str) -> None:
        if result:
            raise RuntimeError(f"{call} failed ({result})")

    def pack(self, cubin: bytes, arch: str) -> bytes:
        """``cubin``, built for ``arch`` (``sm_90``), as a fat binary compressed in
        ``mode``."""
        # -compress-all: small entries too (by default they are stored as they are)
        chosen = [b"-64", b"-host=linux", b"-compress-all", f"-compress-mode={self.mode}".encode()]
        handle = ctypes.c_void_p()
        options = (ctypes.c_char_p * len(chosen))(*chosen)
        self._check(self.lib.nvFatbinCreate(ctypes.byref(handle), options,
                                            ctypes.c_size_t(len(chosen))), "nvFatbinCreate")
        try:
            self._check(self.lib.nvFatbinAddCubin(handle, cubin, ctypes.c_size_t(len(cubin)),
                                                  arch.removeprefix("sm_").encode(),
                                                  b"mlxrunner"), "nvFatbinAddCubin")
            size = ctypes.c_size_t()
            self._check(self.lib.nvFatbinSize(handle, ctypes.byref(size)), "nvFatbinSize")
            data = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvFatbinGet(handle, data), "nvFatbinGet")
            return data.raw
        finally:
            self.lib.nvFatbinDestroy(ctypes.byref(handle))


def find_nvfatbin() -> NvFatbin | None:
    """nvFatbin where this machine has it (NVIDIA's wheel or a CUDA toolkit), the newest
    first; None if none loads."""
    for path in _libraries("nvfatbin"):
        try:
            return NvFatbin(str(path))
        except (OSError, RuntimeError, AttributeError) as exc:
            log.debug("nvFatbin %s does not load: %s", path, exc)
    return None


def driver_loads(image: bytes) -> bool:
    """Whether the CUDA driver loads ``image`` as a module on the default GPU (in its primary
    context, then unloaded): a packed kernel is only used where this holds."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        device, context, module = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
        if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0) or \
                cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device):
            return False
        try:
            if cuda.cuCtxPushCurrent_v2(context):
                return False
            try:
                if cuda.cuModuleLoadData(ctypes.byref(module), image):
                    return False
                cuda.cuModuleUnload(module)
                return True
            finally:
                cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            cuda.cuDevicePrimaryCtxRelease_v2(device)
    except (OSError, AttributeError):
        return False


def _roots() -> list[Path]:
    """The folders that may hold NVIDIA's Python packages (``nvidia/<part>/lib``)."""
    roots = [Path(p) / "nvidia" for p in sys.path if p and (Path(p) / "nvidia").is_dir()]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return roots + [Path(home)]


def _libraries(name: str) -> list[Path]:
    """``lib<name>.so.*`` in NVIDIA's wheels and a CUDA toolkit (:func:`_roots`), the
    newest version first."""
    found: list[tuple[tuple[int, ...], Path]] = []
    for root in _roots():
        for path in glob.glob(str(root / "*" / "lib" / f"lib{name}.so.*")) + \
                glob.glob(str(root / "lib64" / f"lib{name}.so.*")):
            suffix = path.rsplit(".so.", 1)[1]
            found.append((tuple(int(p) for p in suffix.split(".") if p.isdigit()), Path(path)))
    return [path for _, path in sorted(found, key=lambda v: v[0], reverse=True)]


def find_nvrtc() -> NVRTC | None:
    """NVRTC and CUDA's headers where this machine has them (NVIDIA's wheels, as MLX's CUDA
    build installs them, or a CUDA toolkit), the newest NVRTC first; None if none loads."""
    headers: list[Path] = []
    for root in _roots():
        headers += [Path(h).parent for h in glob.glob(str(root / "*" / "include" / "cuda_bf16.h"))
                    + glob.glob(str(root / "include" / "cuda_bf16.h"))]
    for path in _libraries("nvrtc"):
        # the headers beside this NVRTC first (a toolkit's, or the wheel's own folder)
        near = [h for h in headers if h.parent == path.parent.parent]
        includes = [str(h) for h in near + [h for h in headers if h not in near]][:1]
        try:
            return NVRTC(str(path), includes)
        except (OSError, RuntimeError, AttributeError) as exc:
            log.debug("NVRTC %s does not load: %s", path, exc)
    return None


def device_arch() -> str | None:
    """The default GPU's architecture for NVRTC (``sm_90``), from the CUDA driver."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(device), 0):
            return None
        # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
        if driver.cuDeviceGetAttribute(ctypes.byref(major), 75, device) or \
                driver.cuDeviceGetAttribute(ctypes.byref(minor), 76, device):
            return None
        return f"sm_{major.value}{minor.value}"
    except (OSError, AttributeError):
        return None


class Builder:
    """Builds kernel sources into cubins for one GPU architecture, each once per machine
    (a file in :func:`cache_folder`, named by a digest of everything that goes into it)."""

    def __init__(self, nvrtc: NVRTC, arch: str, folder: Path,
                 packer: NvFatbin | None = None) -> None:
        self.nvrtc, self.arch, self.folder = nvrtc, arch, folder
        #: packs cubins for launch (None: launches hand MLX the cubins)
        self.packer = packer
        self.built: dict[str, bytes] = {}
        #: what launches hand MLX, by cubin key (the packed image, or the cubin where
        #: packing failed)
        self.packed: dict[str, bytes] = {}
        self._packing = threading.Lock()
        self._driver_loaded = False  # a packed image in the packer's mode loaded
        self.compiled = 0  # builds this process ran (not read from the folder)

    def cubin(self, source: str) -> tuple[str, bytes]:
        """``source``'s digest (its cache file's name) and its cubin."""
        major, minor = self.nvrtc.version
        key = hashlib.sha256("\0".join(
            [source, self.arch, f"{major}.{minor}", *self.nvrtc.includes]).encode()
        ).hexdigest()[:24]
        if key in self.built:
            return key, self.built[key]
        path = self.folder / f"{key}.cubin"
        try:
            data = path.read_bytes()
        except OSError:
            started = time.perf_counter()
            data = self.nvrtc.cubin(source, self.arch)
            self.compiled += 1
            log.debug("built kernel %s in %.2f s", key, time.perf_counter() - started)
            self._store(path, data)
        self.built[key] = data
        return key, data

    def image(self, key: str, cubin: bytes) -> bytes:
        """What a launch hands MLX for the cubin ``key`` (:meth:`cubin`'s), settled once a
        key: packed (see the module) where the packer is, kept beside the cubin; else (no
        packer, a pack that failed) the cubin. The driver loads the first packed image
        first; where it does not, the packer's next mode is tried, and after the last every
        launch takes the cubins."""
        found = self.packed.get(key)
        if found is not None:
            return found
        with self._packing:  # (one mode at a time is tried and settled)
            if key in self.packed:
                return self.packed[key]
            data = cubin
            while self.packer is not None:
                packer = self.packer
                packed = self._packed(packer, key, cubin)
                if packed is None:
                    break
                if self._driver_loaded or driver_loads(packed):
                    self._driver_loaded = True
                    data = packed
                    break
                log.debug("the driver does not load kernels packed for %s", packer.mode)
                later = packer.MODES[packer.MODES.index(packer.mode) + 1:]
                if later:
                    packer.mode = later[0]
                else:
                    self.packer = None
            self.packed[key] = data
            return data

    def _packed(self, packer: NvFatbin, key: str, cubin: bytes) -> bytes | None:
        path = self.folder / f"{key}.{packer.mode}.fatbin"
        try:
            return path.read_bytes()
        except OSError:
            pass
        try:
            data = packer.pack(cubin, self.arch)
        except RuntimeError as exc:
            log.debug("kernel %s not packed: %s", key, exc)
            return None
        self._store(path, data)
        return data

    def _store(self, path: Path, data: bytes) -> None:
        # a temporary name, then rename: another process never reads half a file
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except OSError as exc:  # a read-only cache folder costs the next process a build
            log.debug("kernel cache %s not written: %s", path, exc)


_builder: Builder | None | bool = False  # False: not looked for yet
_lock = threading.Lock()


def builder() -> Builder | None:
    """This machine's builder, or None (no NVRTC, no GPU seen): found once."""
    global _builder
    if isinstance(_builder, Builder):  # (asked at every launch: no lock once found)
        return _builder
    with _lock:
        if _builder is False:
            nvrtc, arch = find_nvrtc(), device_arch()
            _builder = Builder(nvrtc, arch, kernel_cache_folder(), find_nvfatbin()) \
                if nvrtc and arch else None
            if _builder is None:
                log.debug("no NVRTC or GPU architecture (%s, %s): kernels build in MLX",
                          nvrtc, arch)
        return _builder if isinstance(_builder, Builder) else None


class CudaKernel:
    """``mx.fast.cuda_kernel(name, input_names, output_names, source)``, built once per
    machine where it can be (see the module's text); called the same way, except that an
    input may be given as a dtype and an output's shape as None: absent, a null pointer in
    the source that the launch neither passes nor allocates, and the results hold only the
    outputs given (each input and output costs a launch host time: MLX checks, records and
    links it, or allocates it)."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str) -> None:
        self.name, self.source = name, source
        self.input_names, self.output_names = list(input_names), list(output_names)
        self._mlx: Any = None
        # each case's launch (the image MLX is handed, the given outputs' dtypes; None:
        # NVRTC refused its source here, MLX builds it), found by one flat key of what
        # spells its source, so that a call met again (every prompt's layers) neither
        # writes nor hashes its source, nor asks the builder: microseconds a launch
        self._cases: dict[Hashable, tuple[bytes, list[mx.Dtype]] | None] = {}
        self._cases_of: Builder | None = None

    def _in_mlx(self) -> Any:
        if self._mlx is None:
            self._mlx = mx.fast.cuda_kernel(name=self.name, input_names=self.input_names,
                                            output_names=self.output_names, source=self.source)
        return self._mlx

    def __call__(self, *, inputs: Sequence[mx.array | mx.Dtype],
                 template: Sequence[TemplateArg], grid: tuple[int, int, int],
                 threadgroup: tuple[int, int, int],
                 output_shapes: Sequence[Sequence[int] | None],
                 output_dtypes: Sequence[mx.Dtype], case: Hashable = None) -> list[mx.array]:
        """``case``: a key of the caller's that settles this launch's source (its inputs'
        and outputs' dtypes, which of them are absent, its template), so that the launch
        is found by it alone (a caller launching the same case at every layer of a
        prompt); None: worked out from them."""
        build = builder()
        launch = None
        if build is not None:
            if self._cases_of is not build:
                self._cases, self._cases_of = {}, build
            packed = settings.current().packed_kernels
            # (an absent input or output is its dtype in a tuple: beside a given one's
            # dtype, another source; a template value's type too: True and 1 are equal
            # keys but spell another source)
            key = ("given", packed, case) if case is not None else (
                packed, *[x.dtype if isinstance(x, mx.array) else (x,) for x in inputs],
                *[t if s is not None else (t,) for s, t in zip(output_shapes, output_dtypes)],
                *template, *[type(value) for _, value in template])
            try:
                launch = self._cases[key]
            except KeyError:
                launch = self._cases[key] = self._launch(build, packed, inputs, template,
                                                         output_shapes, output_dtypes)
        if launch is not None:
            image, dtypes = launch
            return mx.fast.precompiled_cuda_kernel(
                name=self.name, compiled_source=image,
                inputs=[x for x in inputs if isinstance(x, mx.array)],
                output_shapes=[tuple(s) for s in output_shapes if s is not None],
                output_dtypes=dtypes, scalars=[], grid=grid, threadgroup=threadgroup,
                ensure_row_contiguous=True)
        # (MLX's own build declares every input and output: an absent one is an unread entry)
        outputs = self._in_mlx()(
            inputs=[x if isinstance(x, mx.array) else constant((0,), x) for x in inputs],
            template=list(template), grid=grid, threadgroup=threadgroup,
            output_shapes=[(1,) if s is None else tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes))
        return [y for y, s in zip(outputs, output_shapes) if s is not None]

    def _launch(self, build: Builder, packed: bool, inputs: Sequence[mx.array | mx.Dtype],
                template: Sequence[TemplateArg], output_shapes: Sequence[Sequence[int] | None],
                output_dtypes: Sequence[mx.Dtype]) -> tuple[bytes, list[mx.Dtype]] | None:
        """This case's image from ``build`` (packed with ``packed``) and its given outputs'
        dtypes, or None where NVRTC refuses its source."""
        given = [(name, x.dtype) for name, x in zip(self.input_names, inputs)
                 if isinstance(x, mx.array)]
        absent = [(name, x) for name, x in zip(self.input_names, inputs)
                  if isinstance(x, mx.Dtype)]
        outputs = list(zip(self.output_names, output_dtypes, output_shapes))
        unit = kernel_source(self.name, self.source, given,
                             [(n, t) for n, t, s in outputs if s is not None], template, absent,
                             [(n, t) for n, t, s in outputs if s is None])
        try:
            key, cubin = build.cubin(unit)
        except RuntimeError as exc:
            log.debug("%s does not build with CUDA's headers (%s); MLX builds it",
                      self.name, str(exc).splitlines()[0])
            return None
        return (build.image(key, cubin) if packed else cubin,
                [t for _, t, s in outputs if s is not None])


def one_entry(x: mx.array) -> mx.array:
    """A one-entry array as a kernel reads it, ``[1]``: itself where it is so already (a
    reshape would be another graph node at every launch)."""
    return x if x.ndim == 1 else x.reshape(1)


def row_span_grid(width: int, dtype: mx.Dtype, rows: int, threads: int
                  ) -> tuple[int, int, int]:
    """The grid (in threads) of a kernel whose block (x, y) writes span x of output row y,
    ``width`` entries a row of ``dtype``: each thread 16 bytes where a row's bytes are a
    multiple of 16, else one entry (the kernels' ``kVec``)."""
    vec = 16 // dtype.size if (width * dtype.size) % 16 == 0 else 1
    return threads * -(-width // (threads * vec)), rows, 1


@functools.cache  # (asked at every attend on CUDA: worked out once)
def kernel_code(*module_files: str) -> str | None:
    """What a kept verdict of a kernel depends on (:func:`mlxrunner.nn.kernels.serves`'s
    ``source``): the texts of the modules that define the kernel and its reference, and how
    this machine builds it (NVRTC's version, the architecture and headers, this module's
    text; or MLX's own build). None where a text cannot be read."""
    texts = [code_of(f) for f in (*module_files, __file__)]
    if any(t is None for t in texts):
        return None
    build = builder()
    how = "mlx" if build is None else \
        f"nvrtc {build.nvrtc.version} {build.arch} {' '.join(build.nvrtc.includes)}"
    return "\0".join([*(t for t in texts if t is not None), how])
