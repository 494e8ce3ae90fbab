"""torch_py_test: a Python test run by Debian's /usr/bin/python3 with gradsum_torch importable."""

def torch_py_test(name, src, data = [], args = [], **kwargs):
    """An sh_test that runs `src` (a Python file) with /usr/bin/python3.

    Not a py_test: Bazel 4 would pick the interpreter from PATH and add __init__.py files to
    the runfiles, and a runfiles package named `torch` would then shadow PyTorch itself.
    The script's directory is on sys.path (Python's rule), and so is the gradsum_torch package.
    """
    native.sh_test(
        name = name,
        srcs = ["//torch:run_python_test.sh"],
        args = ["$(location %s)" % src] + args,
        data = [src, "//torch:gradsum_torch"] + data,
        **kwargs
    )
