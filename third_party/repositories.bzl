"""Repository rules that make gradsum build offline against system libraries.

- bazel_shim_repositories(): local stand-ins for rules_cc, rules_java,
  remote_coverage_tools and platforms, which Bazel 4.2.3 would otherwise download.
- gradsum_system_repository(): one repository, @gradsum_system, with a cc_library per
  outside library (abseil, GoogleTest, Google Benchmark, protobuf, Eigen, Open MPI,
  CUDA, NCCL, Python's headers, libtorch with pybind11, sentencepiece). Link flags come from pkg-config where the package ships a .pc file;
  header trees outside /usr/include are symlinked in so Bazel can see them.
"""

_RULES_CC_DEFS = """
cc_library = native.cc_library
cc_binary = native.cc_binary
cc_test = native.cc_test
cc_import = native.cc_import
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
cc_proto_library = native.cc_proto_library
"""

_RULES_JAVA_DEFS = """
java_import = native.java_import
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain
java_binary = native.java_binary
java_library = native.java_library
"""

_COVERAGE_BUILD = """
package(default_visibility = ["//visibility:public"])
filegroup(name = "coverage_report_generator")
filegroup(name = "lcov_merger")
"""

def _files_repo_impl(ctx):
    for path, content in ctx.attr.files.items():
        ctx.file(path, content, executable = False)

_files_repository = repository_rule(
    implementation = _files_repo_impl,
    attrs = {"files": attr.string_dict()},
)

def bazel_shim_repositories():
    if not native.existing_rule("rules_cc"):
        _files_repository(
            name = "rules_cc",
            files = {"WORKSPACE": "", "BUILD": "", "cc/BUILD": "", "cc/defs.bzl": _RULES_CC_DEFS},
        )
    if not native.existing_rule("rules_java"):
        _files_repository(
            name = "rules_java",
            files = {"WORKSPACE": "", "BUILD": "", "java/BUILD": "", "java/defs.bzl": _RULES_JAVA_DEFS},
        )
    if not native.existing_rule("remote_coverage_tools"):
        _files_repository(
            name = "remote_coverage_tools",
            files = {"WORKSPACE": "", "BUILD": _COVERAGE_BUILD},
        )
    if not native.existing_rule("platforms"):
        native.local_repository(name = "platforms", path = "/usr/share/bazel/tools/platforms")

# Abseil groups: target name -> pkg-config modules.
_ABSL = {
    "absl_base": ["absl_base", "absl_core_headers"],
    "absl_status": ["absl_status", "absl_statusor"],
    "absl_strings": ["absl_strings", "absl_str_format"],
    "absl_synchronization": ["absl_synchronization"],
    "absl_time": ["absl_time"],
    "absl_flags": ["absl_flags", "absl_flags_parse", "absl_flags_usage"],
    "absl_containers": ["absl_flat_hash_map", "absl_flat_hash_set", "absl_inlined_vector"],
    "absl_random": ["absl_random_random"],
}

def _pkg_config(ctx, modules, what):
    res = ctx.execute(["pkg-config", what] + modules)
    if res.return_code != 0:
        return None
    return [f for f in res.stdout.strip().split(" ") if f]

def _quote_list(items):
    return "[" + ", ".join(['"%s"' % i for i in items]) + "]"

def _lib(name, linkopts = [], hdrs_glob = None, includes = [], deps = [], defines = []):
    hdrs = "glob(%s)" % _quote_list(hdrs_glob) if hdrs_glob else "[]"
    return """
cc_library(
    name = "{name}",
    hdrs = {hdrs},
    includes = {includes},
    linkopts = {linkopts},
    defines = {defines},
    deps = {deps},
)
""".format(
        name = name,
        hdrs = hdrs,
        includes = _quote_list(includes),
        linkopts = _quote_list(linkopts),
        defines = _quote_list(defines),
        deps = _quote_list(deps),
    )

def _system_repo_impl(ctx):
    build = ['package(default_visibility = ["//visibility:public"])\n']
    missing = []

    for name, modules in _ABSL.items():
        libs = _pkg_config(ctx, modules, "--libs")
        if libs == None:
            missing.append(name)
            libs = []
        build.append(_lib(name, linkopts = libs))

    for name, mod, fallback in [
        ("gtest", ["gtest"], ["-lgtest", "-pthread"]),
        ("gtest_main", ["gtest_main"], ["-lgtest_main", "-lgtest", "-pthread"]),
        ("gmock", ["gmock"], ["-lgmock", "-lgtest", "-pthread"]),
        ("benchmark", ["benchmark"], ["-lbenchmark", "-pthread"]),
        ("protobuf", ["protobuf"], ["-lprotobuf", "-pthread"]),
        ("xxhash", ["libxxhash"], ["-lxxhash"]),
        ("nlohmann_json", ["nlohmann_json"], []),
        # libsentencepiece-dev: its header clashes with abseil's (shared/spec/ENVIRONMENT.md),
        # so only tools/sentencepiece.cc, which includes no abseil header, uses it.
        ("sentencepiece", ["sentencepiece"], ["-lsentencepiece", "-lsentencepiece_train"]),
    ]:
        libs = _pkg_config(ctx, mod, "--libs") or fallback
        build.append(_lib(name, linkopts = libs))
    build.append(_lib("benchmark_main", linkopts = ["-lbenchmark_main"], deps = ["benchmark"]))

    # Eigen: headers only, under /usr/include/eigen3.
    eigen_dir = ctx.path("/usr/include/eigen3")
    if eigen_dir.exists:
        ctx.symlink(eigen_dir, "eigen3")
        build.append(_lib("eigen", hdrs_glob = ["eigen3/Eigen/**", "eigen3/unsupported/**"], includes = ["eigen3"], defines = ["EIGEN_MPL2_ONLY"]))
    else:
        missing.append("eigen")
        build.append(_lib("eigen"))

    # Open MPI: headers live outside /usr/include.
    mpi_cflags = _pkg_config(ctx, ["ompi-c"], "--cflags-only-I") or []
    mpi_libs = _pkg_config(ctx, ["ompi-c"], "--libs") or ["-lmpi"]
    mpi_inc = [f[2:] for f in mpi_cflags if f.startswith("-I")]
    if mpi_inc and ctx.path(mpi_inc[0]).exists:
        ctx.symlink(ctx.path(mpi_inc[0]), "mpi_include")
        build.append(_lib("mpi", hdrs_glob = ["mpi_include/*.h"], includes = ["mpi_include"], linkopts = mpi_libs, defines = ["OMPI_SKIP_MPICXX=1"]))
    else:
        missing.append("mpi")
        build.append(_lib("mpi", linkopts = mpi_libs))

    # OpenBLAS: cblas.h lives in the variant's directory (openblas-pthread), outside
    # /usr/include; the library picks its CPU kernels at run time (DYNAMIC_ARCH).
    blas_cflags = _pkg_config(ctx, ["openblas"], "--cflags-only-I") or []
    blas_libs = _pkg_config(ctx, ["openblas"], "--libs") or ["-lopenblas"]
    blas_inc = [f[2:] for f in blas_cflags if f.startswith("-I")]
    if blas_inc and ctx.path(blas_inc[0] + "/cblas.h").exists:
        ctx.symlink(ctx.path(blas_inc[0]), "openblas_include")
        build.append(_lib("openblas", hdrs_glob = ["openblas_include/*.h"], includes = ["openblas_include"], linkopts = blas_libs))
    else:
        missing.append("openblas")
        build.append(_lib("openblas", linkopts = blas_libs))

    # Python headers of Debian's /usr/bin/python3 (the interpreter the torch extension is
    # built for), symlinked in so that Bazel can declare them.
    py = ctx.execute(["/usr/bin/python3", "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"])
    py_inc = py.stdout.strip() if py.return_code == 0 else ""
    if py_inc and ctx.path(py_inc + "/Python.h").exists:
        ctx.symlink(ctx.path(py_inc), "python_include")
        build.append(_lib("python_headers", hdrs_glob = ["python_include/**/*.h"], includes = ["python_include"]))
    else:
        missing.append("python_headers")
        build.append(_lib("python_headers"))

    # Debian's libtorch (libtorch-dev) and pybind11 (pybind11-dev). Their headers are in
    # /usr/include (ATen/, c10/, torch/csrc/, pybind11/), a system directory, so nothing is
    # symlinked. libtorch is built by the system g++ with the C++11 std::string ABI, the
    # default here, and its pybind11 ids (_gcc, _libstdcpp, _cxxabi1017) are pybind11's
    # defaults for this compiler, so no ABI flags are needed.
    if ctx.path("/usr/include/ATen/ATen.h").exists and ctx.path("/usr/include/pybind11/pybind11.h").exists:
        build.append(_lib("torch", linkopts = ["-ltorch", "-ltorch_cpu", "-lc10"]))
        build.append(_lib("torch_python", linkopts = ["-ltorch_python"], deps = ["torch", "python_headers"]))
    else:
        missing.append("torch")
        build.append(_lib("torch"))
        build.append(_lib("torch_python", deps = ["torch", "python_headers"]))

    # CUDA and NCCL (only linked under --config=cuda; an empty stand-in elsewhere).
    cuda_root = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    has_cuda = ctx.path(cuda_root + "/include/cuda_runtime.h").exists
    if has_cuda:
        ctx.symlink(ctx.path(cuda_root + "/include"), "cuda_include")
        rpath = "-Wl,-rpath," + cuda_root + "/lib64"
        build.append(_lib("cuda", hdrs_glob = ["cuda_include/**"], includes = ["cuda_include"], linkopts = ["-L" + cuda_root + "/lib64", rpath, "-lcudart", "-lcublas"]))
        build.append(_lib("nccl", linkopts = ["-L" + cuda_root + "/lib64", rpath, "-lnccl"], deps = ["cuda"]))
    else:
        build.append(_lib("cuda"))
        build.append(_lib("nccl"))

    ctx.file("BUILD", "".join(build))
    ctx.file("WORKSPACE", "")
    ctx.file("config.bzl", "CUDA_ROOT = \"%s\"\nHAS_CUDA = %s\nMISSING = %s\n" % (cuda_root, has_cuda, _quote_list(missing)))

gradsum_system_repository = repository_rule(
    implementation = _system_repo_impl,
    environ = ["CUDA_PATH", "PKG_CONFIG_PATH"],
    local = True,
)
