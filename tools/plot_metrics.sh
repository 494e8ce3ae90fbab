#!/usr/bin/env bash
# //tools:plot_metrics: runs plot_metrics.py with Debian's /usr/bin/python3 (python3-matplotlib,
# installed by ./bazelw), from the directory `bazel run` was called in, so relative paths work.
set -euo pipefail
script="${BASH_SOURCE[0]}.runfiles/gradsum/tools/plot_metrics.py"
[[ -f $script ]] || script="$(dirname "${BASH_SOURCE[0]}")/plot_metrics.py"
script="$(cd "$(dirname "$script")" && pwd)/$(basename "$script")"
cd "${BUILD_WORKING_DIRECTORY:-.}"
exec /usr/bin/python3 "$script" "$@"
