"""Local stand-ins for Bazel rule repositories so that Bazel 4 works offline.

Debian's bazel-rules-cc is too new for Bazel 4.2.3, so `@rules_cc` is a tiny
generated repository whose cc/defs.bzl re-exports the native rules. Moving to a
newer Bazel with the real rules_cc replaces this one repository.
"""

_CC_RULES = ["cc_binary", "cc_import", "cc_library", "cc_proto_library", "cc_shared_library", "cc_test", "cc_toolchain", "cc_toolchain_suite", "fdo_prefetch_hints", "fdo_profile", "objc_library"]

def _rules_cc_shim_impl(ctx):
    ctx.file("WORKSPACE", 'workspace(name = "rules_cc")\n')
    ctx.file("BUILD.bazel", "")
    ctx.file("cc/BUILD.bazel", "")
    ctx.file("cc/defs.bzl", "".join([
        "def {r}(**kwargs):\n    native.{r}(**kwargs)\n\n".format(r = r)
        for r in _CC_RULES
    ]))

rules_cc_shim = repository_rule(implementation = _rules_cc_shim_impl)

def _remote_coverage_tools_shim_impl(ctx):
    ctx.file("WORKSPACE", 'workspace(name = "remote_coverage_tools")\n')
    ctx.file("BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])
filegroup(name = "coverage_report_generator", srcs = [])
filegroup(name = "lcov_merger", srcs = [])
""")

remote_coverage_tools_shim = repository_rule(implementation = _remote_coverage_tools_shim_impl)
