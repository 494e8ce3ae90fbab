// MPI collectives benchmark: the library's mpi-backend all-reduce against raw MPI_Allreduce
// on the same buffers, its point-to-point Send / Recv against raw MPI_Send / MPI_Recv
// (ping-pong latency, one-way bandwidth), and BM_Memcpy (the physical limit), in one run. Run under
// mpirun, one process per rank; only rank 0 reports:
//
//   ./bazelw build -c opt //bench:collectives_mpi_bench
//   OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe
//       --bind-to none -np 2 bazel-bin/bench/collectives_mpi_bench [--benchmark_format=json]
//
// Counters as in bench/collectives_bench: bytes_per_second is the algorithm bandwidth (one
// rank's buffer per second); busbw = algbw * 2 (W - 1) / W (the NCCL-tests convention).
//
// Every rank must issue the same collectives, so each benchmark runs a fixed number of
// iterations (Google Benchmark's adaptive count could differ between processes), and every
// benchmark starts with an MPI_Barrier.

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/memcpy_bench.h"
#include "bench/transformer_grads.h"
#include "benchmark/benchmark.h"
#include "collectives/bucketer.h"
#include "collectives/communicator.h"
#include "collectives/mpi_backend.h"

namespace gradsum::bench {
namespace {

Communicator *g_comm = nullptr;          // the mpi backend over MPI_COMM_WORLD (checked)
Communicator *g_comm_nocheck = nullptr;  // the same without the agreement check
// Both again with MpiBackendOptions::blocking_sync_calls = false (MPI_Iallreduce polled
// with MPI_Test; the default is blocking MPI_Allreduce under the watchdog).
Communicator *g_comm_nonblocking = nullptr;
Communicator *g_comm_nocheck_nonblocking = nullptr;

void Check(const absl::Status &s, const char *what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

// Iterations for a buffer of `bytes`: about 256 MiB of traffic, between 2 and 200 (the
// machine is small and shared; raw MPI_Allreduce busy-polls and suffers when oversubscribed).
int64_t Iterations(int64_t bytes) {
  return std::clamp<int64_t>((int64_t{256} << 20) / std::max<int64_t>(bytes, 1), 2, 200);
}

void SetBandwidth(benchmark::State &state, int64_t bytes_per_iter) {
  const int world = g_comm->size();
  state.SetBytesProcessed(state.iterations() * bytes_per_iter);
  state.counters["busbw"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * bytes_per_iter * 2.0 * (world - 1) / world,
      benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}

// The same gradient set as bench/collectives_bench (bench/transformer_grads.h).
using ::gradsum::bench::TransformerGradSizes;

int64_t TransformerBytes() { return ::gradsum::bench::TransformerGradBytes(); }

// A gradsum mpi communicator (`comm`), in place, f32 SUM.
void LatencyOn(Communicator *comm, benchmark::State &state) {
  const size_t n = static_cast<size_t>(state.range(0)) / sizeof(float);
  std::vector<float> buf(n, 0.0f);  // zeros: the sum stays finite whatever the count
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) {
    Check(comm->AllReduce(buf.data(), buf.data(), n, DType::kF32, ReduceOp::kSum), "AllReduce");
  }
  SetBandwidth(state, state.range(0));
}

// gradsum's mpi backend (the default options), in place, f32 SUM.
void BM_MpiAllReduceContiguous(benchmark::State &state) { LatencyOn(g_comm, state); }

// The same buffer through MPI_Allreduce directly (blocking, in place) on `comm`.
void RawAllreduceOn(MPI_Comm comm, benchmark::State &state) {
  const int n = static_cast<int>(static_cast<size_t>(state.range(0)) / sizeof(float));
  std::vector<float> buf(n, 0.0f);
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) {
    MPI_Allreduce(MPI_IN_PLACE, buf.data(), n, MPI_FLOAT, MPI_SUM, comm);
  }
  SetBandwidth(state, state.range(0));
}

void BM_RawMpiAllreduce(benchmark::State &state) { RawAllreduceOn(MPI_COMM_WORLD, state); }

// bf16 through the mpi backend (widened to fp32, reduced, rounded once); bytes
// are bf16 bytes, so compare with the f32 rows at twice the size for equal
// element counts.
void BM_MpiAllReduceContiguousBF16(benchmark::State &state) {
  const size_t n = static_cast<size_t>(state.range(0)) / 2;
  std::vector<uint16_t> buf(n, 0);
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) {
    Check(g_comm->AllReduce(buf.data(), buf.data(), n, DType::kBF16, ReduceOp::kSum),
          "AllReduce bf16");
  }
  SetBandwidth(state, state.range(0));
}

// The 300-tensor set through the GradBucketer (default 25 MiB buckets),
// gradients marked ready last-first as backward would.
void BM_MpiAllReduceBucketed(benchmark::State &state) {
  const std::vector<size_t> sizes = TransformerGradSizes();
  GradBucketer bucketer(g_comm);
  for (size_t i = 0; i < sizes.size(); ++i) {
    Check(bucketer.Register(absl::StrCat("g", i), DType::kF32, static_cast<int64_t>(sizes[i]))
              .status(),
          "Register");
  }
  Check(bucketer.Finalize(), "Finalize");
  state.counters["buckets"] = bucketer.num_buckets();
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) {
    for (int id = bucketer.num_params() - 1; id >= 0; --id) Check(bucketer.MarkReady(id), "Mark");
    Check(bucketer.Finish(), "Finish");
  }
  SetBandwidth(state, TransformerBytes());
}

// The same set, one async all-reduce per tensor (issued last-first, then all
// waited).
void BM_MpiAllReducePerTensor(benchmark::State &state) {
  const std::vector<size_t> sizes = TransformerGradSizes();
  std::vector<std::vector<float>> grads;
  for (size_t n : sizes) grads.emplace_back(n, 0.0f);
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) {
    std::vector<std::unique_ptr<Work>> works;
    works.reserve(sizes.size());
    for (size_t i = sizes.size(); i-- > 0;) {
      auto w = g_comm->AllReduceAsync(grads[i].data(), grads[i].data(), sizes[i], DType::kF32,
                                      ReduceOp::kSum);
      Check(w.status(), "AllReduceAsync");
      works.push_back(std::move(*w));
    }
    for (auto &w : works) Check(w->Wait(), "Wait");
  }
  SetBandwidth(state, TransformerBytes());
}

// The same set, one raw MPI_Allreduce per tensor (blocking).
void BM_RawMpiAllreducePerTensor(benchmark::State &state) {
  const std::vector<size_t> sizes = TransformerGradSizes();
  std::vector<std::vector<float>> grads;
  for (size_t n : sizes) grads.emplace_back(n, 0.0f);
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) {
    for (size_t i = sizes.size(); i-- > 0;) {
      MPI_Allreduce(MPI_IN_PLACE, grads[i].data(), static_cast<int>(sizes[i]), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
    }
  }
  SetBandwidth(state, TransformerBytes());
}

// ---- Small-message latency, as nccl-tests reports it (8 B .. 64 KiB, doubling). ----

// The mpi backend, sync f32 SUM in place, with the default agreement check (one
// descriptor all-reduce per call) or without it (data movement only).
void BM_MpiAllReduceLatency(benchmark::State &state) { BM_MpiAllReduceContiguous(state); }

void BM_MpiAllReduceLatencyNoCheck(benchmark::State &state) { LatencyOn(g_comm_nocheck, state); }
void BM_MpiAllReduceLatencyNonBlocking(benchmark::State &state) {
  LatencyOn(g_comm_nonblocking, state);
}
void BM_MpiAllReduceLatencyNoCheckNonBlocking(benchmark::State &state) {
  LatencyOn(g_comm_nocheck_nonblocking, state);
}

void BM_RawMpiAllreduceLatency(benchmark::State &state) { BM_RawMpiAllreduce(state); }

// Raw MPI_Allreduce on a duplicate of MPI_COMM_WORLD, as the backend uses: separates the
// backend's own cost from any difference between communicators.
void BM_RawMpiAllreduceDupLatency(benchmark::State &state) {
  static MPI_Comm dup = [] {
    MPI_Comm c;
    MPI_Comm_dup(MPI_COMM_WORLD, &c);
    return c;
  }();
  RawAllreduceOn(dup, state);
}

// Memcpy on rank 0 alone (the others idle through the same iteration count), so
// that it is the single-process copy bandwidth that bench/collectives_bench
// also reports.
void BM_MemcpySynced(benchmark::State &state) {
  MPI_Barrier(MPI_COMM_WORLD);
  if (g_comm->rank() == 0) {
    BM_Memcpy(state);
    return;
  }
  for (auto _ : state) {
  }
}

// ---- Point-to-point between ranks 0 and 1 (the others idle through the iterations). ----
// Ping-pong: rank 0 sends, rank 1 receives and sends it back; one iteration is one round
// trip (latency = time / 2), bytes_per_second counts both directions. One-way: rank 0 sends
// and rank 1 receives, one message per iteration, each finished before the next (gradsum's
// send completes once the receiver matched it). Raw MPI runs the same pattern with
// MPI_Send / MPI_Recv on MPI_COMM_WORLD.

template <typename Send, typename Recv>
void PingPong(benchmark::State &state, Send &&send, Recv &&recv) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> buf(bytes, 1);
  const int rank = g_comm->rank();
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) {
    if (rank == 0) {
      send(buf.data(), bytes, 1);
      recv(buf.data(), bytes, 1);
    } else if (rank == 1) {
      recv(buf.data(), bytes, 0);
      send(buf.data(), bytes, 0);
    }
  }
  state.SetBytesProcessed(state.iterations() * 2 * state.range(0));
}

template <typename Send, typename Recv>
void OneWay(benchmark::State &state, Send &&send, Recv &&recv) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> buf(bytes, 1);
  const int rank = g_comm->rank();
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) {
    if (rank == 0) send(buf.data(), bytes, 1);
    if (rank == 1) recv(buf.data(), bytes, 0);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void GradsumSend(char *buf, size_t bytes, int peer) {
  Check(g_comm->Send(buf, bytes / 4, DType::kF32, peer), "Send");
}
void GradsumRecv(char *buf, size_t bytes, int peer) {
  Check(g_comm->Recv(buf, bytes / 4, DType::kF32, peer), "Recv");
}
void RawSend(char *buf, size_t bytes, int peer) {
  MPI_Send(buf, static_cast<int>(bytes / 4), MPI_FLOAT, peer, 0, MPI_COMM_WORLD);
}
void RawRecv(char *buf, size_t bytes, int peer) {
  MPI_Recv(buf, static_cast<int>(bytes / 4), MPI_FLOAT, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
}

void BM_MpiPingPong(benchmark::State &state) { PingPong(state, GradsumSend, GradsumRecv); }
void BM_RawMpiPingPong(benchmark::State &state) { PingPong(state, RawSend, RawRecv); }
void BM_MpiSendOneWay(benchmark::State &state) { OneWay(state, GradsumSend, GradsumRecv); }
void BM_RawMpiSendOneWay(benchmark::State &state) { OneWay(state, RawSend, RawRecv); }

void RegisterPointToPoint() {
  for (int64_t bytes = 8; bytes <= (64 << 10); bytes *= 8) {
    for (auto [name, fn] : {std::pair("BM_RawMpiPingPong", &BM_RawMpiPingPong),
                            std::pair("BM_MpiPingPong", &BM_MpiPingPong)}) {
      benchmark::RegisterBenchmark(name, fn)->Arg(bytes)->Iterations(2000)->UseRealTime();
    }
  }
  for (int64_t bytes : {int64_t{1} << 20, int64_t{16} << 20, int64_t{64} << 20}) {
    for (auto [name, fn] : {std::pair("BM_Memcpy", &BM_MemcpySynced),
                            std::pair("BM_RawMpiSendOneWay", &BM_RawMpiSendOneWay),
                            std::pair("BM_MpiSendOneWay", &BM_MpiSendOneWay)}) {
      benchmark::RegisterBenchmark(name, fn)
          ->Arg(bytes)
          ->Iterations(Iterations(bytes))
          ->UseRealTime();
    }
  }
}

void RegisterAll() {
  // GRADSUM_BENCH_P2P_ONLY=1: the point-to-point rows alone (a shorter run).
  if (const char *only = std::getenv("GRADSUM_BENCH_P2P_ONLY"); only != nullptr && *only == '1') {
    RegisterPointToPoint();
    return;
  }
  RegisterPointToPoint();
  const int64_t kSizes[] = {4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20};
  for (int64_t bytes : kSizes) {
    for (auto [name, fn] : {std::pair("BM_Memcpy", &BM_MemcpySynced),
                            std::pair("BM_MpiAllReduceContiguous", &BM_MpiAllReduceContiguous),
                            std::pair("BM_RawMpiAllreduce", &BM_RawMpiAllreduce)}) {
      benchmark::RegisterBenchmark(name, fn)
          ->Arg(bytes)
          ->Iterations(Iterations(bytes))
          ->UseRealTime();
    }
  }
  for (int64_t bytes = 8; bytes <= (64 << 10); bytes *= 2) {
    for (auto [name, fn] :
         {std::pair("BM_Memcpy", &BM_MemcpySynced),
          std::pair("BM_RawMpiAllreduceLatency", &BM_RawMpiAllreduceLatency),
          std::pair("BM_MpiAllReduceLatency", &BM_MpiAllReduceLatency),
          std::pair("BM_RawMpiAllreduceDupLatency", &BM_RawMpiAllreduceDupLatency),
          std::pair("BM_MpiAllReduceLatencyNoCheck", &BM_MpiAllReduceLatencyNoCheck),
          std::pair("BM_MpiAllReduceLatencyNonBlocking", &BM_MpiAllReduceLatencyNonBlocking),
          std::pair("BM_MpiAllReduceLatencyNoCheckNonBlocking",
                    &BM_MpiAllReduceLatencyNoCheckNonBlocking)}) {
      benchmark::RegisterBenchmark(name, fn)->Arg(bytes)->Iterations(3000)->UseRealTime();
    }
  }
  benchmark::RegisterBenchmark("BM_MpiAllReduceContiguousBF16", &BM_MpiAllReduceContiguousBF16)
      ->Arg(32 << 20)
      ->Iterations(Iterations(64 << 20))
      ->UseRealTime();
  const int64_t set_bytes = TransformerBytes();
  for (auto [name, fn] : {std::pair("BM_MpiAllReduceBucketed", &BM_MpiAllReduceBucketed),
                          std::pair("BM_MpiAllReducePerTensor", &BM_MpiAllReducePerTensor),
                          std::pair("BM_RawMpiAllreducePerTensor", &BM_RawMpiAllreducePerTensor)}) {
    benchmark::RegisterBenchmark(name, fn)->Iterations(Iterations(set_bytes))->UseRealTime();
  }
  benchmark::RegisterBenchmark("BM_MpiAllReduceContiguous/set", &BM_MpiAllReduceContiguous)
      ->Arg(set_bytes)
      ->Iterations(Iterations(set_bytes))
      ->UseRealTime();
}

// Ranks other than 0 run every benchmark but print nothing.
class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context &) override { return true; }
  void ReportRuns(const std::vector<Run> &) override {}
};

}  // namespace
}  // namespace gradsum::bench

int main(int argc, char **argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  {
    auto comm = gradsum::CreateMpiWorldCommunicator();
    gradsum::bench::Check(comm.status(), "CreateMpiWorldCommunicator");
    gradsum::bench::g_comm = comm->get();
    std::unique_ptr<gradsum::Communicator> variants[3];
    gradsum::Communicator **slots[3] = {&gradsum::bench::g_comm_nocheck,
                                        &gradsum::bench::g_comm_nonblocking,
                                        &gradsum::bench::g_comm_nocheck_nonblocking};
    for (int v = 0; v < 3; ++v) {
      gradsum::MpiBackendOptions o;
      o.check_agreement = v == 1;
      o.blocking_sync_calls = v == 0;
      auto c = gradsum::CreateMpiWorldCommunicator(o);
      gradsum::bench::Check(c.status(), "CreateMpiWorldCommunicator (variant)");
      variants[v] = std::move(*c);
      *slots[v] = variants[v].get();
    }
    benchmark::Initialize(&argc, argv);
    gradsum::bench::RegisterAll();
    if (rank == 0) {
      benchmark::RunSpecifiedBenchmarks();
    } else {
      gradsum::bench::SilentReporter silent;
      benchmark::RunSpecifiedBenchmarks(&silent);
    }
    gradsum::bench::g_comm = nullptr;
    for (gradsum::Communicator **slot : slots) *slot = nullptr;
  }
  MPI_Finalize();
  return 0;
}
