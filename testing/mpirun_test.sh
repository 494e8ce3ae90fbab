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
# Under --config=asan: Open MPI's own allocations live until exit and are reported as
# leaks from plugins it has already dlclose()d, which no suppression can name; attributing
# them needs full unwinding on every malloc, which makes a 4-rank test take minutes on 2
# cores. Leak checking is therefore off for MPI tests (address and UB checks stay on).
if [[ -n "${ASAN_OPTIONS:-}" ]]; then
  export ASAN_OPTIONS="${ASAN_OPTIONS}:detect_leaks=0"
fi
# Under --config=tsan: Open MPI is not instrumented, and its internal locking (inside
# MPI_Init and its plugins) shows up as lock-order and mutex reports. Ignore what happens
# inside it; gradsum's own code and its pthread-based locking stay checked.
if [[ -n "${TSAN_OPTIONS:-}" ]]; then
  supp="$(mktemp "${TEST_TMPDIR:-/tmp}/mpi_tsan.XXXXXX")"
  for lib in libmpi.so libopen-pal.so libopen-rte.so libhwloc.so libevent_core libevent_pthreads; do
    printf 'called_from_lib:%s\n' "${lib}"
  done >"${supp}"
  for kind in race deadlock mutex; do
    printf "${kind}:%s\\n" mca_ libpmix libmpi libopen-pal libopen-rte libevent
  done >>"${supp}"
  export TSAN_OPTIONS="${TSAN_OPTIONS}:suppressions=${supp}"
  # TSan aborts if a library named in called_from_lib is unloaded; keep plugins loaded.
  export OMPI_MCA_mca_base_component_disable_dlclose=1
fi
# Rank 0 writes the gtest XML Bazel asks for (see //testing:mpi_gtest_main).
limit="${GRADSUM_MPI_TIMEOUT_S:-240}"
exec timeout --signal=KILL "${limit}" mpirun --oversubscribe --bind-to none -np "${np}" "${binary}" "$@"
