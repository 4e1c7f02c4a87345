"""Local repository rules for the jaxtdist Bazel build (no downloads).

* debian_bazel_rules: Debian's packaged rules_cc / rules_java (bazel-rules-cc,
  bazel-rules-java), copied into the external repository and, for rules_cc,
  patched for Bazel 4.2.3 (which has no `use_cpp_toolchain()`).
* jaxtdist_python: XLA FFI headers shipped by the installed jaxlib, pybind11
  headers from the installed pybind11 package, and Python's headers, all found
  by running python.
* jaxtdist_cuda: CUDA headers + libcudart_static.a from a CUDA toolkit, else
  NVIDIA's pip packages (bazel/find_cuda.py), else a CPU-only stub.
"""

_RULES_DIRS = [
    "/usr/share/bazel/rules",  # Debian / Ubuntu bazel-rules-* packages
]

def _python(rctx):
    for name in ["PYTHON_BIN_PATH", "JAXTDIST_PYTHON"]:
        p = rctx.os.environ.get(name, "")
        if p:
            return p
    for name in ["python3", "python"]:
        p = rctx.which(name)
        if p:
            return str(p)
    fail("jaxtdist: no python3 on PATH (set PYTHON_BIN_PATH)")

def _run(rctx, args, what):
    res = rctx.execute(args, quiet = True)
    if res.return_code != 0:
        fail("jaxtdist: %s failed (%s):\n%s%s" % (what, " ".join([str(a) for a in args]), res.stdout, res.stderr))
    return res.stdout.strip()

# --- Debian's rules_cc / rules_java ------------------------------------------

def _debian_bazel_rules_impl(rctx):
    roots = []
    if rctx.os.environ.get("JAXTDIST_BAZEL_RULES_DIR", ""):
        roots.append(rctx.os.environ["JAXTDIST_BAZEL_RULES_DIR"])
    roots += _RULES_DIRS
    src = None
    for root in roots:
        cand = rctx.path(root + "/" + rctx.attr.subdir)
        if cand.exists:
            src = cand
            break
    if src == None:
        fail(("jaxtdist: Debian's rules_%s not found under %s. Install it with " +
              "`apt-get install bazel-rules-cc bazel-rules-java` or set " +
              "JAXTDIST_BAZEL_RULES_DIR.") % (rctx.attr.subdir, roots))

    # A real copy (not a symlink) so that the patch below never touches Debian's files.
    _run(rctx, ["cp", "-RL", str(src) + "/.", "."], "copying " + str(src))

    if rctx.attr.patch_use_cpp_toolchain:
        # Bazel 4.2.3's @bazel_tools has no use_cpp_toolchain(); rules_cc 0.0.4 calls it.
        files = _run(rctx, ["grep", "-rl", "--include=*.bzl", "use_cpp_toolchain", "."], "grep")
        for f in files.splitlines():
            text = rctx.read(f)
            text = text.replace(', "use_cpp_toolchain")', ")")
            text = text.replace("use_cpp_toolchain()", '["@bazel_tools//tools/cpp:toolchain_type"]')
            rctx.file(f, text, executable = False)

debian_bazel_rules = repository_rule(
    implementation = _debian_bazel_rules_impl,
    attrs = {
        "subdir": attr.string(mandatory = True),
        "patch_use_cpp_toolchain": attr.bool(default = False),
    },
    environ = ["JAXTDIST_BAZEL_RULES_DIR"],
    local = True,
)

# --- Python, pybind11, XLA FFI headers ---------------------------------------

_FIND_PY = """
import sysconfig
import jax.ffi
import pybind11
print(jax.ffi.include_dir())
print(pybind11.get_include())
print(sysconfig.get_paths()["include"])
"""

_PYTHON_BUILD = """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "xla_ffi",
    hdrs = glob(["xla_ffi/xla/ffi/api/**"]),
    includes = ["xla_ffi"],
)

cc_library(
    name = "python_headers",
    hdrs = glob(["python/**/*.h"]),
    includes = ["python"],
)

cc_library(
    name = "pybind11",
    hdrs = glob(["pybind11/pybind11/**/*.h"]),
    includes = ["pybind11"],
    deps = [":python_headers"],
)
"""

def _jaxtdist_python_impl(rctx):
    py = _python(rctx)
    out = _run(rctx, [py, "-c", _FIND_PY], "locating jax/pybind11/Python headers with " + py)
    xla, pybind, pyinc = out.splitlines()[-3:]
    if not rctx.path(xla + "/xla/ffi/api/ffi.h").exists:
        fail("jaxtdist: XLA FFI headers not found in %s; install jax/jaxlib first" % xla)
    rctx.symlink(xla, "xla_ffi")
    rctx.symlink(pybind, "pybind11")
    rctx.symlink(pyinc, "python")
    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)
    rctx.file("BUILD", _PYTHON_BUILD)
    rctx.file("paths.txt", "python=%s\nxla_ffi=%s\npybind11=%s\npython_include=%s\n" % (py, xla, pybind, pyinc))

jaxtdist_python = repository_rule(
    implementation = _jaxtdist_python_impl,
    environ = ["PYTHON_BIN_PATH", "JAXTDIST_PYTHON", "PATH", "PYENV_VERSION", "VIRTUAL_ENV"],
    local = True,
)

# --- CUDA --------------------------------------------------------------------

_CUDA_BUILD = """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
)

{cudart}

cc_library(
    name = "cuda",
    deps = [":cuda_headers", ":cudart"],
    linkopts = {linkopts},
)
"""

_CUDART_STATIC = """
cc_import(
    name = "cudart",
    static_library = "lib/libcudart_static.a",
)
"""

_CUDART_SHARED = """
cc_library(name = "cudart")
"""

_NO_CUDA_BUILD = """
package(default_visibility = ["//visibility:public"])

cc_library(name = "cuda")
"""

def _first_existing(rctx, base, rels):
    for rel in rels:
        p = rctx.path(base + "/" + rel)
        if p.exists:
            return p
    return None

def _find_toolkit(rctx):
    roots = []
    for name in ["JAXTDIST_CUDA_PATH", "CUDA_HOME", "CUDA_PATH"]:
        if rctx.os.environ.get(name, ""):
            roots.append(rctx.os.environ[name])
    roots.append("/usr/local/cuda")
    nvcc = rctx.which("nvcc")
    if nvcc:
        # Resolve wrappers/symlinks (e.g. /usr/local/bin/nvcc -> toolkit/bin/nvcc).
        res = rctx.execute(["readlink", "-f", str(nvcc)], quiet = True)
        if res.return_code == 0:
            roots.append(str(rctx.path(res.stdout.strip()).dirname.dirname))
    for root in roots:
        inc = _first_existing(rctx, root, ["include", "targets/x86_64-linux/include", "targets/sbsa-linux/include"])
        if inc == None or not rctx.path(str(inc) + "/cuda_runtime_api.h").exists or not rctx.path(str(inc) + "/cuda.h").exists:
            continue
        lib = _first_existing(rctx, root, [
            "lib64/libcudart_static.a",
            "lib/libcudart_static.a",
            "targets/x86_64-linux/lib/libcudart_static.a",
            "targets/sbsa-linux/lib/libcudart_static.a",
        ])
        if lib != None:
            return root, inc, lib
    return None

def _jaxtdist_cuda_impl(rctx):
    enabled = rctx.os.environ.get("JAXTDIST_CUDA", "1") not in ["0", "OFF", "off", "false", "no"]
    found = None
    kind = "none"
    if enabled:
        tk = _find_toolkit(rctx)
        if tk != None:
            root, inc, lib = tk
            rctx.symlink(inc, "include")
            rctx.symlink(lib, "lib/libcudart_static.a")
            rctx.file("BUILD", _CUDA_BUILD.format(
                cudart = _CUDART_STATIC,
                linkopts = repr(["-ldl", "-lrt", "-lpthread"]),
            ))
            found = root
            kind = "toolkit"
        else:
            # NVIDIA's pip packages (shared libcudart only), like CMakeLists.txt does.
            script = rctx.path(Label("//bazel:find_cuda.py"))
            res = rctx.execute([_python(rctx), str(script)], quiet = True)
            if res.return_code == 0 and res.stdout.strip():
                inc, lib = res.stdout.strip().split(";")
                rctx.symlink(inc, "include")
                libdir = str(rctx.path(lib).dirname)
                rctx.file("BUILD", _CUDA_BUILD.format(
                    cudart = _CUDART_SHARED,
                    linkopts = repr([lib, "-Wl,-rpath," + libdir, "-ldl", "-lrt", "-lpthread"]),
                ))
                found = inc
                kind = "pip"
    if found == None:
        why = "JAXTDIST_CUDA=%s" % rctx.os.environ.get("JAXTDIST_CUDA") if not enabled else "no CUDA headers found (toolkit or NVIDIA pip packages)"

        # buildifier: disable=print
        print("jaxtdist: %s: building the CPU FFI handlers only; GPUs will not be usable." % why)
        rctx.file("BUILD", _NO_CUDA_BUILD)
    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)
    rctx.file("defs.bzl", "CUDA_ENABLED = %s\nCUDA_SOURCE = %r\nCUDA_ROOT = %r\n" % (
        found != None,
        kind,
        str(found) if found != None else "",
    ))

jaxtdist_cuda = repository_rule(
    implementation = _jaxtdist_cuda_impl,
    environ = ["JAXTDIST_CUDA", "JAXTDIST_CUDA_PATH", "CUDA_HOME", "CUDA_PATH", "PATH", "PYTHON_BIN_PATH", "JAXTDIST_PYTHON"],
    local = True,
)

def jaxtdist_dependencies():
    """Declares every external repository of the jaxtdist build (all local)."""
    debian_bazel_rules(name = "rules_cc", subdir = "cc", patch_use_cpp_toolchain = True)
    debian_bazel_rules(name = "rules_java", subdir = "java")
    jaxtdist_python(name = "jaxtdist_python")
    jaxtdist_cuda(name = "jaxtdist_cuda")
