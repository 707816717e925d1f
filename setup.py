"""Builds kvcopy's extension, kvcopy._C, with torch.utils.cpp_extension.

- CUDA + CPU kernels when nvcc and a CUDA build of torch are present, and beside
  them the benchmark's own module, kvcopy.tools.bench._baselines (its copy-engine
  baselines: no part of the copy core, so not in kvcopy._C);
- CPU kernels only otherwise, or with KVCOPY_NO_CUDA=1 where a CUDA build could be made (a build
  that only has to import and run on the CPU, such as benchmarks/device_check.sh --dry-run: the CUDA
  kernels are most of the compile time);
- nothing with KVCOPY_NO_EXT=1 (kvcopy then runs through its "torch" method).

Archs: TORCH_CUDA_ARCH_LIST when set, else 8.0, 9.0 and 10.0 (PTX for the
newest), keeping those the toolkit supports. One summary line is printed.
Install with `pip install --no-build-isolation .` so the build sees your torch.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = ("8.0", "9.0", "10.0")  # A100, H100/H200, B200
CPU_SOURCES = [
    "csrc/ops/registration.cpp",
    "csrc/python/module.cpp",
    "csrc/common/block_ids.cpp",
    "csrc/ops/check_ids.cpp",
    "csrc/ops/launch_cpu.cpp",
    "csrc/cpu/copy_blocks_cpu.cpp",
]
CUDA_SOURCES = [
    "csrc/ops/launch_cuda.cpp",
    "csrc/kernels/copy_blocks_sm.cu",
    "csrc/kernels/copy_blocks_dma.cpp",
    "csrc/kernels/dma_submit.cpp",
]
# kvcopy.tools.bench._baselines: the benchmark's copy-engine baselines, over the same submission code.
BENCH_BASELINES_SOURCES = [
    "csrc/bench/baselines_module.cpp",
    "csrc/bench/dma_baselines.cpp",
    "csrc/kernels/dma_submit.cpp",
]


def _summary(text: str) -> None:
    print(f"kvcopy build: {text}", file=sys.stderr, flush=True)


def _find_cuda_home() -> str | None:
    """The toolkit root. The nvcc on PATH may be a wrapper script, so a root
    is accepted only where lib64/libcudart.so (or lib/x64) exists."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        try:  # a wrapper that execs the real nvcc names it in its text
            with open(nvcc, "rb") as f:
                head = f.read(4096).decode(errors="replace")
            candidates += [os.path.dirname(os.path.dirname(w)) for w in head.split() if w.endswith("/bin/nvcc")]
        except OSError:
            pass
    candidates += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for root in candidates:
        if (
            root
            and os.path.exists(os.path.join(root, "bin", "nvcc"))
            and glob.glob(os.path.join(root, "lib*", "libcudart.so*"))
        ):
            return root
    return None


def _supported_archs(cuda_home: str) -> set[str]:
    out = subprocess.run(
        [os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"], capture_output=True, text=True, check=False
    ).stdout
    # compute_90 -> 9.0, compute_100 -> 10.0
    return {f"{n[:-1]}.{n[-1]}" for n in (w.removeprefix("compute_") for w in out.split()) if n.isdigit()}


def _cuda_arch_list(cuda_home: str) -> str:
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    supported = _supported_archs(cuda_home)
    archs = [a for a in DEFAULT_CUDA_ARCHS if not supported or a in supported]
    if not archs:
        raise RuntimeError(f"nvcc at {cuda_home} supports none of {DEFAULT_CUDA_ARCHS}; set TORCH_CUDA_ARCH_LIST")
    archs[-1] += "+PTX"
    return ";".join(archs)


def _write_build_config(**config: object) -> None:
    """Records what this build compiled in kvcopy/_build_config.json (kvcopy.build_info() reads it)."""
    with open(os.path.join(ROOT, "kvcopy", "_build_config.json"), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)
        f.write("\n")


def _extensions() -> tuple[list, dict]:
    if os.environ.get("KVCOPY_NO_EXT") == "1":
        _write_build_config(extension=False, reason="KVCOPY_NO_EXT=1")
        _summary("no extension (KVCOPY_NO_EXT=1); only the 'torch' method will run")
        return [], {}
    try:
        import torch
    except ImportError:
        _write_build_config(extension=False, reason="torch was not importable at build time")
        _summary("no extension: torch not importable at build time (use pip install --no-build-isolation)")
        return [], {}

    no_cuda = os.environ.get("KVCOPY_NO_CUDA") == "1"
    cuda_home = _find_cuda_home() if torch.version.cuda and not no_cuda else None
    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home  # read when cpp_extension is imported
        os.environ["TORCH_CUDA_ARCH_LIST"] = _cuda_arch_list(cuda_home)
    from torch.utils import cpp_extension

    # csrc/include: the torch-free headers (kvcopy/...); csrc: the rooms' own headers (cpu/, kernels/, python/).
    common = dict(
        include_dirs=[os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")], extra_link_args=["-fopenmp"]
    )
    cxx_flags = ["-O3", "-fopenmp"]  # the C++ standard is the one torch asks for
    if cuda_home:
        arch_list = os.environ["TORCH_CUDA_ARCH_LIST"]
        ext = cpp_extension.CUDAExtension(
            "kvcopy._C",
            CPU_SOURCES + CUDA_SOURCES,
            define_macros=[("KVCOPY_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
            **common,
        )
        # The benchmark's module exports only its PyInit (hidden visibility), so its own copy of
        # kernels/dma_submit.cpp, per-thread side streams included, binds within it, never to kvcopy._C's
        # (not even where modules are loaded RTLD_GLOBAL).
        baselines = cpp_extension.CUDAExtension(
            "kvcopy.tools.bench._baselines",
            BENCH_BASELINES_SOURCES,
            include_dirs=common["include_dirs"],
            extra_compile_args={"cxx": ["-O3", "-fvisibility=hidden"]},
        )
        extensions = [ext, baselines]
        _write_build_config(
            extension=True,
            cpu=True,
            cuda=True,
            cuda_archs=arch_list,
            cuda_home=cuda_home,
            cuda_version=torch.version.cuda,
            torch_version=torch.__version__,
        )
        _summary(f"CPU + CUDA kernels, CUDA {torch.version.cuda} at {cuda_home}, archs {arch_list}")
    else:
        if no_cuda:
            why = "KVCOPY_NO_CUDA=1"
        elif not torch.version.cuda:
            why = "torch is a CPU build"
        else:
            why = "no CUDA toolkit (nvcc + libcudart) found"
        ext = cpp_extension.CppExtension("kvcopy._C", CPU_SOURCES, extra_compile_args={"cxx": cxx_flags}, **common)
        _write_build_config(extension=True, cpu=True, cuda=False, reason=why, torch_version=torch.__version__)
        _summary(f"CPU kernels only ({why})")
        extensions = [ext]
    return extensions, {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
