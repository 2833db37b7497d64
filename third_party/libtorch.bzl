"""libtorch_repository: finds LibTorch and exposes it as @libtorch targets.

Search order:
  1. $LIBTORCH_HOME: an unpacked libtorch zip (include/, lib/) or a pip `torch`
     package directory.
  2. The pinned pip torch that tools/bootstrap.sh installs into the project-local
     prefix <shardtrain>/.deps/venv.

Targets: :c10, :torch_cpu (ATen, autograd, nn, optim), :c10d (rendezvous stores,
ProcessGroupGloo), :torch_cuda (CUDA kernels, ProcessGroupNCCL). Headers and
shared objects are declared inputs, so a different LibTorch changes cache keys.
@libtorch//:defs.bzl records LIBTORCH_VERSION, LIBTORCH_HAS_CUDA,
LIBTORCH_CUDA_VERSION and LIBTORCH_CXXOPTS (the C++ standard its headers need).
"""

def find_torch_dir(ctx):
    """Returns (path of the LibTorch directory, how it was found)."""
    home = ctx.os.environ.get("LIBTORCH_HOME", "")
    if home:
        p = ctx.path(home)
        if p.get_child("lib").exists and p.get_child("include").exists:
            return p, "LIBTORCH_HOME"
        fail("LIBTORCH_HOME=%s has no include/ and lib/; point it at an unpacked libtorch or a pip torch package directory" % home)
    root = ctx.path(Label("//:WORKSPACE")).dirname
    res = ctx.execute(["sh", "-c", "ls -d '%s'/.deps/venv/lib/python3*/site-packages/torch 2>/dev/null | head -n1" % root])
    found = res.stdout.strip()
    if not found:
        fail("LibTorch not found: run tools/bootstrap.sh (installs the pinned pip torch into %s/.deps/venv) or set LIBTORCH_HOME" % root)
    return ctx.path(found), "bootstrap"

def _parse_version(ctx, torch):
    version, cuda = "unknown", ""
    vpy = torch.get_child("version.py")
    if vpy.exists:
        for line in ctx.read(vpy).splitlines():
            if line.startswith("__version__"):
                version = line.split("=")[1].strip().strip("'\"")
            if line.startswith("cuda"):
                v = line.split("=")[1].strip().strip("'\"")
                cuda = "" if v == "None" else v
    else:
        bv = torch.get_child("build-version")
        if bv.exists:
            version = ctx.read(bv).strip()
    return version, cuda

def _needed(ctx, lib):
    """The DT_NEEDED sonames of the shared object at `lib`."""
    res = ctx.execute(["readelf", "-d", "--wide", str(lib)])
    if res.return_code != 0:
        fail("readelf -d %s failed (install binutils; tools/bootstrap.sh does): %s" % (lib, res.stderr))
    out = []
    for line in res.stdout.splitlines():
        if "(NEEDED)" in line and "[" in line:
            out.append(line.split("[")[1].split("]")[0])
    return out

def _closure(ctx, roots, index, skip):
    """Repository-relative paths of `roots` and every library they need, transitively,
    that `index` (soname -> (repository-relative path, real path)) knows; `skip` excluded."""
    seen = dict(skip)
    order = []
    todo = list(roots)
    for _ in range(10000):  # Starlark has no while loop
        if not todo:
            break
        so = todo.pop(0)
        if so in seen or so not in index:
            continue
        seen[so] = True
        order.append(index[so][0])
        todo.extend(_needed(ctx, index[so][1]))
    return order, seen

def _libtorch_repository_impl(ctx):
    torch, how = find_torch_dir(ctx)
    version, cuda_version = _parse_version(ctx, torch)
    has_cuda = torch.get_child("lib").get_child("libtorch_cuda.so").exists

    # PyTorch 2.13+ headers need C++20; older 2.x need C++17. ShardTrain itself is
    # written in C++20, so that is the floor either way.
    std = "-std=c++20"

    # Which C++ ABI the libraries were built with.
    abi = "1"
    res = ctx.execute(["sh", "-c", "nm -D --defined-only '%s/lib/libc10.so' | grep -c '__cxx11' || true" % torch])
    if res.stdout.strip() == "0":
        abi = "0"

    # Links to the real directories (not through <clone>/.deps), so binaries keep
    # finding their libraries when a clone whose .deps links elsewhere is moved.
    ctx.symlink(torch.get_child("include").realpath, "include")
    ctx.symlink(torch.get_child("lib").realpath, "lib")
    libdir = str(torch.get_child("lib").realpath)

    # Every shared object LibTorch needs at run time is a declared input of the
    # link (srcs), found by the soname closure of LibTorch's own libraries over
    # torch/lib and, for a pip torch, pip's nvidia/*/lib (libtorch_cpu needs
    # libcudart and libcupti even in CPU-only use). Bazel symlinks each one into
    # its _solib tree and gives the binary $ORIGIN-relative run paths to it, so
    # binaries have no absolute path of the clone or the venv, run after the clone
    # is moved, and link lines are the same for every clone path. (LibTorch's own
    # DT_RPATHs are $ORIGIN/../../nvidia/..., which do not resolve through _solib.)
    index = {}
    for f in torch.get_child("lib").readdir():
        if ".so" in f.basename:
            index[f.basename] = ("lib/" + f.basename, f)
    nvidia = torch.dirname.get_child("nvidia")
    if nvidia.exists:
        ctx.symlink(nvidia.realpath, "nvidia")
        for d in sorted(nvidia.readdir(), key = str):
            if d.get_child("lib").exists:
                for f in d.get_child("lib").readdir():
                    if f.basename.startswith("lib") and ".so" in f.basename:
                        index[f.basename] = ("nvidia/%s/lib/%s" % (d.basename, f.basename), f)
    c10_libs, seen = _closure(ctx, ["libc10.so"], index, {})
    cpu_libs, seen = _closure(ctx, ["libtorch_cpu.so"], index, seen)
    cuda_libs = []
    if has_cuda:
        # cuDNN and NVRTC open their sibling libraries with dlopen(): declare them
        # too, so they sit in the same _solib directory as the library that opens them.
        dlopened = [
            s
            for s in sorted(index.keys())
            if (s.startswith("libcudnn_") or s.startswith("libnvrtc") or s in ["libcaffe2_nvrtc.so", "libtorch_cuda_linalg.so"]) and ".alt." not in s
        ]
        cuda_libs, seen = _closure(ctx, ["libtorch_cuda.so", "libc10_cuda.so"] + dlopened, index, seen)

    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("defs.bzl", """\
# Generated by //third_party:libtorch.bzl from {how}: {torch}
LIBTORCH_VERSION = "{version}"
LIBTORCH_HAS_CUDA = {has_cuda}
LIBTORCH_CUDA_VERSION = "{cuda}"
LIBTORCH_CXXOPTS = ["{std}"]
LIBTORCH_LIB_DIR = "{libdir}"
""".format(how = how, torch = torch, version = version, has_cuda = has_cuda, cuda = cuda_version, std = std, libdir = libdir))
    ctx.file("BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])

exports_files(["defs.bzl"])

# No -rpath here: every .so below is a declared input, and Bazel gives each binary
# $ORIGIN-relative run paths into its _solib tree (see //third_party:libtorch.bzl).

cc_library(
    name = "c10",
    # c10's headers include torch/headeronly/ (found undeclared by a sandboxed build).
    hdrs = glob(["include/c10/**", "include/torch/headeronly/**"]),
    includes = ["include"],
    srcs = {c10_libs},
    defines = ["_GLIBCXX_USE_CXX11_ABI={abi}"],
    linkopts = ["-pthread"],
)

cc_library(
    name = "torch_cpu",
    hdrs = glob(["include/**"], exclude = ["include/c10/**", "include/torch/headeronly/**", "include/torch/csrc/distributed/**"]),
    includes = ["include", "include/torch/csrc/api/include"],
    srcs = {cpu_libs},
    deps = [":c10"],
)

cc_library(
    name = "c10d",
    hdrs = glob(["include/torch/csrc/distributed/**"]),
    defines = ["USE_DISTRIBUTED", "USE_C10D_GLOO"],
    deps = [":torch_cpu", "@gloo_headers//:gloo"],
)

# DT_RPATH (not RUNPATH) for binaries that use it: the loader then also searches
# the binary's $ORIGIN-relative _solib directories for libraries that LibTorch's
# CUDA code opens itself (dlopen).
cc_library(
    name = "torch_cuda",
    srcs = {cuda_libs},
    defines = ["USE_C10D_NCCL", "USE_CUDA"],
    linkopts = ["-Wl,--disable-new-dtags"],
    deps = [":c10d", "@local_cuda//:cudart"],
)
""".format(abi = abi, c10_libs = repr(c10_libs), cpu_libs = repr(cpu_libs), cuda_libs = repr(cuda_libs)))

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    environ = ["LIBTORCH_HOME", "SHARDTRAIN_TORCH_STAMP"],
    local = True,
)
