// main() for GoogleTest binaries run under mpirun, one process per rank.
//
// - Initialises MPI at MPI_THREAD_MULTIPLE (the mpi backend's progress threads need it)
//   and finalises it after the tests.
// - Rank 0 prints gtest's normal report and writes the XML file Bazel asks for; other
//   ranks print only their failures, each line prefixed "[rank r]".
// - The exit status is non-zero on every rank if any rank failed (an MPI_Allreduce of the
//   failure flags), so mpirun and Bazel see a failure wherever it happened.
//
// Every rank runs the same tests in the same order, so collectives inside tests match.

#include <mpi.h>

#include <cstdio>
#include <cstdlib>

#include "gtest/gtest.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (rank != 0) {
    // Bazel's per-test files are rank 0's to write: the premature-exit marker would
    // otherwise be created and removed by every rank at once.
    unsetenv("TEST_PREMATURE_EXIT_FILE");
  }
  ::testing::InitGoogleTest(&argc, argv);
  if (rank != 0) {
    GTEST_FLAG_SET(output, "");  // only rank 0 writes the XML report
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  } else {
    std::printf("mpi_gtest_main: %d ranks, MPI thread level %d\n", size, provided);
  }
  const int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed && !failed) {
    std::printf("mpi_gtest_main: rank 0 passed, but another rank failed (see [rank r] lines)\n");
  }
  MPI_Finalize();
  return any_failed ? 1 : 0;
}
