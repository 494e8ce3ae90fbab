// Proves that Open MPI links and runs: an MPI_Allreduce of the ranks, checked on every
// rank against the closed form size*(size-1)/2. Exit status is non-zero on mismatch.
#include <mpi.h>

#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  long long mine = rank, total = -1;
  MPI_Allreduce(&mine, &total, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  const long long expected = static_cast<long long>(size) * (size - 1) / 2;
  int ok = (total == expected) ? 1 : 0;
  int all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) std::printf("mpi_smoke: size=%d sum=%lld expected=%lld\n", size, total, expected);
  MPI_Finalize();
  return (all_ok == 1 && size >= 2) ? 0 : 1;
}
