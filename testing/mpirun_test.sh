#!/usr/bin/env bash
# Runs a test binary under Open MPI: mpirun_test.sh NP BINARY [ARGS...]
#
# Used by sh_test targets so that `bazel test` launches multi-process tests. Root needs
# the OMPI_ALLOW_RUN_AS_ROOT pair; --oversubscribe lets 4 ranks share 2 cores. A hard
# `timeout` guarantees that a hung collective fails the test instead of hanging CI.
set -euo pipefail
np="$1"; shift
binary="$1"; shift
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Shared memory and loopback only; no daemons probing other interfaces.
export OMPI_MCA_btl="self,vader,tcp"
export OMPI_MCA_btl_tcp_if_include="lo"
export OMPI_MCA_oob_tcp_if_include="lo"
export OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1
# Each rank writes its own gtest XML, if Bazel asked for one.
limit="${GRADSUM_MPI_TIMEOUT_S:-240}"
exec timeout --signal=KILL "${limit}" mpirun --oversubscribe --bind-to none -np "${np}" "${binary}" "$@"
