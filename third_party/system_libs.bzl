"""system_library: a Debian-packaged C/C++ library behind an @-repository.

Headers and shared objects are symlinked into the repository and declared as
inputs, so upgrading the Debian package changes Bazel's cache keys.
"""

def _find_lib(ctx, dirs, lib):
    for d in dirs:
        for ext in [".so", ".a"]:
            p = ctx.path(d + "/lib" + lib + ext)
            if p.exists:
                return p
    fail("system_library %s: lib%s.so/.a not found in %s; install the Debian -dev package (tools/bootstrap.sh does)" % (ctx.name, lib, dirs))

def _system_library_impl(ctx):
    inc = ctx.attr.include_dir
    for h in ctx.attr.headers:
        src = ctx.path(inc + "/" + h)
        if not src.exists:
            fail("system_library %s: %s not found; install its Debian -dev package (tools/bootstrap.sh does)" % (ctx.name, src))
        ctx.symlink(src, "include/" + h)
    build = ['package(default_visibility = ["//visibility:public"])\n']
    linked = {}
    for target, libs in ctx.attr.libs.items():
        srcs = []
        for lib in libs:
            found = _find_lib(ctx, ctx.attr.lib_dirs, lib)
            dest = "lib/" + found.basename
            if dest not in linked:
                ctx.symlink(found, dest)
                linked[dest] = True
            srcs.append('"%s"' % dest)
        build.append("""cc_library(
    name = "{t}",
    hdrs = glob(["include/**"]),
    includes = ["include"],
    srcs = [{srcs}],
    linkopts = ["-pthread"],
)
""".format(t = target, srcs = ", ".join(srcs)))
    ctx.file("BUILD.bazel", "\n".join(build))
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)

system_library = repository_rule(
    implementation = _system_library_impl,
    attrs = {
        "headers": attr.string_list(doc = "entries under include_dir to expose"),
        "libs": attr.string_list_dict(doc = "target name -> shared libraries (without lib/.so)"),
        "include_dir": attr.string(default = "/usr/include"),
        "lib_dirs": attr.string_list(default = ["/usr/lib/x86_64-linux-gnu", "/usr/lib", "/usr/lib64"]),
    },
    local = True,
)
