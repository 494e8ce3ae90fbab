"""MPI test targets: a gtest binary run under mpirun at several process counts."""

def mpirun_tests(name_pattern, binary, process_counts, size = "small"):
    """One sh_test per process count N, running `mpirun -np N binary` through
    //testing:mpirun_test.sh (which skips, saying why, where mpirun cannot start).

    Args:
      name_pattern: the test name with %d for N, e.g. "dispatch_mpi_np%d_test".
      binary: the label of the test binary (a cc_binary linking //testing:mpi_gtest_main).
      process_counts: the values of N.
      size: the tests' size.
    """
    for np in process_counts:
        native.sh_test(
            name = name_pattern % np,
            size = size,
            srcs = ["//testing:mpirun_test.sh"],
            args = [str(np), "$(location %s)" % binary],
            data = [binary],
        )
