"""The one place ShardTrain loads C++ rules from.

Every package loads st_cc_library / st_cc_binary / st_cc_test from here, so a move
to a newer Bazel (bzlmod, the real rules_cc) is one edit. The wrappers add the
C++ standard that the chosen LibTorch's headers need and the project's warnings,
and compile a target's .cc files as one translation unit where it says `unity = 1`.
"""

load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library", "cc_test")
load("@libtorch//:defs.bzl", "LIBTORCH_CXXOPTS")

ST_COPTS = LIBTORCH_CXXOPTS + ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

# Targets that need CUDA are skipped (not failed) unless --config=cuda.
CUDA_ONLY = select({
    "//tools:cuda_enabled": [],
    "//conditions:default": ["@platforms//:incompatible"],
})

def _unity_srcs(name, srcs, unity):
    """srcs with its .cc files compiled as `unity` translation units (0: as they are).

    Nearly every .cc here includes LibTorch's headers, which take ~16 s of the
    ~25 s a compile takes on this project's machines; a target's .cc files
    concatenated into one generated file parse them once (docs/build.md, "Unity
    translation units"). `#line` markers keep each file's own name in
    diagnostics and __FILE__. The files stay ordinary sources: edit, format and
    query them as before (bazel query still lists them through the genrule). A
    .cc file's file-scope names must then differ from its siblings': the
    compiler says which collide.
    """
    if not unity or type(srcs) != "list":
        return srcs
    ccs = [s for s in srcs if s.endswith(".cc")]
    others = [s for s in srcs if not s.endswith(".cc")]
    if len(ccs) < 2:
        return srcs
    groups = [ccs[i::unity] for i in range(min(unity, len(ccs)))]
    out = []
    for i, group in enumerate(groups):
        gen = "%s_unity%d" % (name, i)
        native.genrule(
            name = gen,
            srcs = group,
            outs = [gen + ".cc"],
            cmd = "for f in $(SRCS); do echo \"#line 1 \\\"$$f\\\"\"; cat \"$$f\"; echo; done > $@",
            visibility = ["//visibility:private"],
        )
        out.append(":" + gen)
    return others + out

def _st_cc(rule, name, copts, srcs, unity, **kwargs):
    rule(name = name, srcs = _unity_srcs(name, srcs, unity), copts = ST_COPTS + copts, **kwargs)

def st_cc_library(name, copts = [], linkstatic = True, srcs = [], unity = 0, **kwargs):
    # linkstatic: no per-library .so, so builds run half the link actions.
    _st_cc(cc_library, name, copts, srcs, unity, linkstatic = linkstatic, **kwargs)

def st_cc_binary(name, copts = [], srcs = [], unity = 0, **kwargs):
    _st_cc(cc_binary, name, copts, srcs, unity, **kwargs)

def st_cc_test(name, copts = [], linkstatic = True, srcs = [], unity = 0, **kwargs):
    _st_cc(cc_test, name, copts, srcs, unity, linkstatic = linkstatic, **kwargs)

def _st_cc_link_only_impl(ctx):
    return [cc_common.merge_cc_infos(cc_infos = [
        CcInfo(linking_context = dep[CcInfo].linking_context)
        for dep in ctx.attr.deps
    ])]

# Forwards only what its deps add to a link (libraries, link options), none of
# their headers, include paths or defines. A library that implements part of its
# API in a configuration-specific dependency (//trainer/plugins:accelerator's CUDA
# backend) links it through this rule, so that its dependents' compile commands
# stay the same in every configuration and --config=cuda reuses the CPU build's
# compiles (docs/build.md, "CI time budget").
st_cc_link_only = rule(
    implementation = _st_cc_link_only_impl,
    attrs = {"deps": attr.label_list(providers = [CcInfo])},
)

# A library kept at its old label for one release after its code moved
# (docs/migration.md): its header at the old path forwards to the new one, and
# Bazel warns every dependent with `deprecation`, naming the new label.
def st_forwarding_library(name, hdr, actual):
    cc_library(
        name = name,
        hdrs = [hdr],
        deps = [actual],
        deprecation = "moved to %s (docs/migration.md); this label goes in the next release" % actual,
        visibility = ["//visibility:public"],
    )
