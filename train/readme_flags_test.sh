#!/usr/bin/env bash
# README.md's flag table (between its "generated flag table" markers) is the one
# config_flags_gen prints from train/config.proto: a flag added, renamed or re-described in
# the proto without regenerating the README fails here.
#   readme_flags_test.sh README.md GENERATED_TABLE.md
set -uo pipefail
readme="$1"
generated="$2"
got="${TEST_TMPDIR:-$(mktemp -d)}/readme_table.md"
grep -q '^<!-- BEGIN generated flag table' "$readme" || { echo "FAIL: $readme has no flag table"; exit 1; }
awk '/^<!-- END generated flag table/ { on = 0 } on { print } /^<!-- BEGIN generated flag table/ { on = 1 }' \
  "$readme" > "$got"
[ -s "$generated" ] || { echo "FAIL: the generated table is empty"; exit 1; }
if ! diff -u "$generated" "$got"; then
  echo "FAIL: README.md's flag table differs from train/config.proto's flags (above: - generated," \
    "+ README); regenerate it with ./bazelw run //train:config_flags_gen -- --markdown"
  exit 1
fi
echo "PASS"
