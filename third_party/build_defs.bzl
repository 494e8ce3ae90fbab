"""Build macros: protoc with the system compiler, nvcc for .cu files, GPU tests."""

load("@gradsum_system//:config.bzl", "CUDA_ROOT")

def proto_cc_library(name, src, deps = [], visibility = None):
    """A cc_library for one .proto, compiled by the system protoc.

    Bazel 4's native proto_library needs protobuf's source repository, which cannot be
    downloaded here. The generated header is included as "<package>/<file>.pb.h".
    """
    base = src[:-len(".proto")]
    native.genrule(
        name = name + "_protoc",
        srcs = [src],
        outs = [base + ".pb.h", base + ".pb.cc"],
        cmd = "protoc --proto_path=$$(dirname $(location %s)) --cpp_out=$$(dirname $(location %s.pb.h)) $(location %s)" % (src, base, src),
    )
    native.cc_library(
        name = name,
        srcs = [base + ".pb.cc"],
        hdrs = [base + ".pb.h"],
        deps = deps + ["//third_party:protobuf"],
        visibility = visibility,
    )

def _cuda_compatible():
    return select({
        "//third_party:cuda_enabled": [],
        "//conditions:default": ["@platforms//:incompatible"],
    })

def cuda_library(name, srcs, hdrs = [], deps = [], cu_hdrs = [], copts = [], visibility = None, testonly = False):
    """A cc_library whose .cu sources are compiled by nvcc for sm_90.

    Only built under --config=cuda; elsewhere the target is incompatible and skipped by
    `bazel build //...`. Every header a .cu file includes from this repo must be in
    `hdrs` or `cu_hdrs` (files or filegroups): nvcc runs in a sandbox of declared inputs.
    Sources that do not end in `.cu` (host `.cc` files, e.g. argument checking and
    absl::Status wrappers) go to the host C++ compiler unchanged, with `deps` visible.
    `copts` are passed to nvcc only.
    """
    objs = []
    host_srcs = []
    for src in srcs:
        if not src.endswith(".cu"):
            host_srcs.append(src)
            continue
        obj = name + "_" + src.replace("/", "_")[:-len(".cu")] + ".o"
        native.genrule(
            name = obj + "_nvcc",
            srcs = [src] + hdrs + cu_hdrs,
            outs = [obj],
            cmd = (CUDA_ROOT + "/bin/nvcc -std=c++17 -O3 -arch=sm_90 -lineinfo " +
                   "-Xcompiler -fPIC -I. -I$(GENDIR) -Iexternal/gradsum " +
                   "%s -c $(location %s) -o $@") % (" ".join(copts), src),
            tags = ["manual"],
            testonly = testonly,
            target_compatible_with = _cuda_compatible(),
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs + host_srcs,
        hdrs = hdrs,
        deps = deps + ["//third_party:cuda"],
        visibility = visibility,
        testonly = testonly,
        target_compatible_with = _cuda_compatible(),
        linkstatic = 1,
    )

def gpu_test(name, tags = [], **kwargs):
    """A cc_test that needs a GPU: tagged `gpu`, built only under --config=cuda.

    Run with `bazel test --config=cuda --test_tag_filters=gpu //...`. Where no device is
    present the test must skip with a clear message (see //testing:gpu_test_util).
    """
    native.cc_test(
        name = name,
        tags = tags + ["gpu"],
        target_compatible_with = _cuda_compatible(),
        **kwargs
    )
