"""cuda_repository: the CUDA toolkit and the NCCL that LibTorch uses.

CUDA comes from $CUDA_HOME (default /usr/local/cuda). NCCL comes from the same
place the chosen LibTorch gets it: pip's nvidia/nccl next to a pip torch,
otherwise $NCCL_HOME or the CUDA toolkit. Linking a second NCCL into a process
that already has LibTorch's is a bug, so there is exactly one choice.

When CUDA is absent the repository is a placeholder: its targets exist (so
`bazel query //...` works) and CUDA_CONFIGURED in @local_cuda//:defs.bzl is False.
"""

load("//third_party:libtorch.bzl", "find_torch_dir")

def _cuda_repository_impl(ctx):
    cuda_home = ctx.path(ctx.os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    configured = cuda_home.get_child("include").get_child("cuda_runtime.h").exists
    if not configured:
        ctx.file("defs.bzl", "CUDA_CONFIGURED = False\nCUDA_HOME = \"\"\n")
        ctx.file("BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])
exports_files(["defs.bzl"])
# Placeholder: no CUDA toolkit was found at {home}. Set CUDA_HOME to use --config=cuda.
cc_library(name = "cudart")
cc_library(name = "nccl")
""".format(home = cuda_home))
        return

    nccl_dir = None
    nccl_home = ctx.os.environ.get("NCCL_HOME", "")
    if nccl_home:
        nccl_dir = ctx.path(nccl_home)
    else:
        torch, _ = find_torch_dir(ctx)
        pip_nccl = torch.dirname.get_child("nvidia").get_child("nccl")
        nccl_dir = pip_nccl if pip_nccl.exists else cuda_home
    nccl_lib = None
    for sub in ["lib", "lib64"]:
        for name in ["libnccl.so.2", "libnccl.so"]:
            p = nccl_dir.get_child(sub).get_child(name)
            if nccl_lib == None and p.exists:
                nccl_lib = p
    if nccl_lib == None:
        fail("NCCL not found under %s; set NCCL_HOME" % nccl_dir)

    ctx.symlink(cuda_home.get_child("include"), "cuda/include")
    ctx.symlink(cuda_home.get_child("lib64").get_child("libcudart.so"), "cuda/lib/libcudart.so")
    ctx.symlink(nccl_dir.get_child("include").get_child("nccl.h"), "nccl/include/nccl.h")
    ctx.symlink(nccl_lib, "nccl/lib/" + nccl_lib.basename)
    ctx.file("defs.bzl", "CUDA_CONFIGURED = True\nCUDA_HOME = \"%s\"\n" % cuda_home)
    ctx.file("BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])
exports_files(["defs.bzl"])

# No -rpath: the .so files are declared inputs, so Bazel gives each binary
# $ORIGIN-relative run paths into its _solib tree (no absolute path of the venv).
cc_library(
    name = "cudart",
    hdrs = glob(["cuda/include/**"]),
    includes = ["cuda/include"],
    srcs = ["cuda/lib/libcudart.so"],
)

cc_library(
    name = "nccl",
    hdrs = ["nccl/include/nccl.h"],
    includes = ["nccl/include"],
    srcs = ["nccl/lib/{ncclname}"],
    deps = [":cudart"],
)
""".format(ncclname = nccl_lib.basename))

cuda_repository = repository_rule(
    implementation = _cuda_repository_impl,
    environ = ["CUDA_HOME", "NCCL_HOME", "LIBTORCH_HOME", "SHARDTRAIN_TORCH_STAMP"],
    local = True,
)
