"""Repositories that gradsum needs, for this workspace and for outside ones.

An outside repo uses gradsum like this (WORKSPACE):

    local_repository(name = "gradsum", path = "/path/to/gradsum")
    load("@gradsum//:deps.bzl", "gradsum_deps")
    gradsum_deps()

It must be called before anything else that could define rules_cc, rules_java,
platforms or remote_coverage_tools: Bazel 4.2.3 would otherwise try to download them.
"""

load("//third_party:repositories.bzl", "bazel_shim_repositories", "gradsum_system_repository")

def gradsum_deps():
    bazel_shim_repositories()
    gradsum_system_repository(name = "gradsum_system")
