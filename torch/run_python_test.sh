#!/usr/bin/env bash
# Runs a Python test file with Debian's /usr/bin/python3 (python3-torch), the gradsum_torch
# package of this build importable. Used by torch_py_test (torch/build_defs.bzl).
#
#   run_python_test.sh path/to/test.py [ARGS...]     (from the runfiles root)
set -euo pipefail
export PYTHONPATH="${PWD}/torch${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONDONTWRITEBYTECODE=1
# gloo over loopback: the machine's hostname may resolve to an address gloo cannot bind.
export GLOO_SOCKET_IFNAME=lo
exec /usr/bin/python3 "$@"
