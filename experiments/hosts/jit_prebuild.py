"""Build SGLang 0.5.14's JIT kernels for the H200 (sm_90) here, on the CPU machine, so that a lease does not
spend its minutes compiling them: Marlin's INT4 MoE kernel alone took 328–380 s of a cold H200 host's time.

SGLang loads a JIT module straight from `$TVM_FFI_CACHE_DIR/<name>__arch_<arch>__tvmffi_<version>/<name>.so`
when that file exists, and `<name>` hashes the kernel's sources; so a module built here from the same wheel, for
the same arch and tvm-ffi version, is the one the host would build. The compiler is CUDA 13.0's nvcc from PyPI
(the host's is 13.0 too), installed into `.cache/cuda-13.0` on first use.

    python -m experiments.hosts.jit_prebuild --out .cache/tvm-ffi-sm90
    then carry .cache/tvm-ffi-sm90 with the device call that runs `bin/h200` (it copies them into TVM_FFI_CACHE_DIR)

Only the `.so` files are kept. The build imports `sglang.jit_kernel` through a package shim (and a stub
torchvision), because the whole `sglang` package pulls in the overlay's torchvision, whose operators this machine's
CPU torch does not register.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CUDA_WHEELS = ["nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-cccl==13.0.85",
               "nvidia-cuda-crt==13.0.88", "nvidia-nvvm==13.0.88", "apache-tvm-ffi==0.1.9"]
SGLANG = ROOT / ".cache" / "sglang-0.5.14"   # bin/setup's overlay: the wheel the H200 bundle installs
SHIM_LINKS = ("jit_kernel", "kernel_api_logging.py", "utils.py", "srt")
# module: the call that builds it (the Python expression SGLang itself runs on first use). These are the ones
# the H200 host built serving the Kimi miniature (baseline, NGRAM; 2026-12-02, its tvm-ffi cache listing).
MODULES = {
    "gptq_marlin_repack": "_jit_gptq_marlin_repack_module()",
    "moe_wna16_marlin": "_jit_moe_wna16_marlin_module(torch.bfloat16)",
    "activation": "_jit_activation_module(torch.bfloat16)",
    "clamp_position": "_jit_clamp_position_module(torch.int64)",
    "rope": "_jit_fused_rope_module(False, 64, torch.bfloat16)",   # MLA's 64 rope dims, not neox
}
# ngram_corpus (NGRAM's trie, C++ only, seconds to build there) is left to the host: its result.h misses
# <cstddef>, which this machine's gcc 12 refuses
BUILD = """
import sys, time, torch
from sglang.jit_kernel import utils
major, minor, module, call = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
start = time.time()
with utils.override_jit_cuda_arch(major, minor, ""):
    mod = __import__(f"sglang.jit_kernel.{module}", fromlist=["*"])
    eval(call, {"torch": torch, **vars(mod)})
print(f"jit_prebuild: {module} built in {time.time() - start:.0f} s", flush=True)
"""


def cuda_toolkit(target: Path) -> Path:
    """CUDA 13.0's compiler, headers and runtime from PyPI, laid out as nvcc and tvm-ffi expect."""
    home = target / "nvidia" / "cu13"
    if not (home / "bin" / "nvcc").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        *CUDA_WHEELS], check=True)
    (home / "lib64").unlink(missing_ok=True)
    (home / "lib64").symlink_to("lib")        # tvm-ffi links with -L$CUDA_HOME/lib64 -lcudart
    cudart = home / "lib" / "libcudart.so"
    if not cudart.exists():
        cudart.symlink_to("libcudart.so.13")
    return home


def sglang_shim(where: Path) -> Path:
    """A `sglang` package holding only what `sglang.jit_kernel` imports, linked to the overlay's files."""
    if not (SGLANG / "sglang" / "jit_kernel").is_dir():
        raise SystemExit(f"jit_prebuild: {SGLANG} is missing: run bin/setup (it installs the SGLang 0.5.14 overlay)")
    pkg = where / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    for name in SHIM_LINKS:
        link = pkg / name
        if not link.is_symlink():
            link.symlink_to(SGLANG / "sglang" / name)
    # sglang.srt.utils imports torchvision.io.decode_jpeg at module level; nothing built here calls it
    (where / "torchvision").mkdir(exist_ok=True)
    (where / "torchvision" / "__init__.py").write_text("")
    (where / "torchvision" / "io.py").write_text(
        "def decode_jpeg(*args, **kwargs):\n    raise RuntimeError('jit_prebuild: torchvision is not loaded')\n")
    return where


def build(out: Path, arch: tuple[int, int], modules: list[str], work: Path) -> list[Path]:
    """Build each module into work/cache, then copy its .so (only) into out, under SGLang's cache dir name."""
    home = cuda_toolkit(work / "cuda-13.0")
    env = {**os.environ, "CUDA_HOME": str(home), "PATH": f"{home / 'bin'}:{os.environ['PATH']}",
           "TVM_FFI_CACHE_DIR": str(work / "cache"),
           "PYTHONPATH": os.pathsep.join([str(sglang_shim(work / "shim")), str(work / "cuda-13.0"), str(SGLANG)])}
    for module in modules:
        subprocess.run([sys.executable, "-c", BUILD, str(arch[0]), str(arch[1]), module, MODULES[module]],
                       env=env, check=True)
    kept = []
    for so in sorted((work / "cache").glob("*/*.so")):
        target = out / so.parent.name / so.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, target)
        kept.append(target)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "tvm-ffi-sm90")
    parser.add_argument("--arch", default="9.0", help="compute capability of the GPU that loads them (H200: 9.0)")
    parser.add_argument("--modules", default=",".join(MODULES), help=f"of {', '.join(MODULES)}")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "jit-prebuild")
    args = parser.parse_args()
    modules = [m for m in args.modules.split(",") if m]
    unknown = sorted(set(modules) - set(MODULES))
    if unknown:
        parser.error(f"unknown modules {unknown}: known are {sorted(MODULES)}")
    major, minor = (int(x) for x in args.arch.split("."))
    start = time.time()
    for so in build(args.out, (major, minor), modules, args.work):
        print(f"jit_prebuild: {so} ({so.stat().st_size / 2**20:.1f} MiB)")
    print(f"jit_prebuild: done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
