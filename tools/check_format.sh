#!/usr/bin/env bash
# The C++ and CUDA sources against .clang-format (Google style, 100 columns).
#
#   tools/check_format.sh          list the files that differ; exit 1 if any
#   tools/check_format.sh --fix    rewrite them in place
#
# .ci/run runs the check. Debian's clang-format 14 is the reference version (another
# version may wrap a few lines differently).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  echo "check_format: clang-format is not installed (apt-get install clang-format)" >&2
  exit 2
fi
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' '*.inc')
if [[ "${1:-}" == "--fix" ]]; then
  clang-format -i "${files[@]}"
  exit 0
fi
# One clang-format process for every file; its diagnostics name the files that differ.
if ! out=$(clang-format --dry-run --Werror "${files[@]}" 2>&1); then
  mapfile -t bad < <(grep -oE '^[^:]+\.(cc|h|cu|cuh|inc):[0-9]+' <<<"${out}" | cut -d: -f1 | sort -u)
  printf 'check_format: %d file(s) differ from .clang-format (fix: tools/check_format.sh --fix):\n' "${#bad[@]}" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files match .clang-format"
