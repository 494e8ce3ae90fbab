// Exact-gradient mode on the MPI backend (one process per rank, run by mpirun_test.sh):
// every rank's owned gradient slices and the global norm are the reference's bits, the
// same bits the thread backend gives (parallel/exact_grad_test.cc), for each sharding
// mode, micro-batch count and split of the sequences.
#include <cstring>
#include <memory>
#include <vector>

#include "collectives/mpi_backend.h"
#include "gtest/gtest.h"
#include "parallel/exact_grad_testing.h"

namespace gradsum {
namespace {

using exact_grad_testing::Config;
using exact_grad_testing::Reference;
using exact_grad_testing::Result;

TEST(ExactGradMpiTest, EveryModeGivesTheReferenceBits) {
  auto comm = CreateMpiWorldCommunicator({});
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int world = (*comm)->size();
  const Result want = Reference();
  for (const Config& cfg : {Config{world, 1, ShardingMode::kSharded, true, false},
                            Config{world, 3, ShardingMode::kSharded, true, false},
                            Config{world, 2, ShardingMode::kSharded, false, false},
                            Config{world, 2, ShardingMode::kReplicated, true, false},
                            Config{world, 3, ShardingMode::kReplicated, true, true}}) {
    for (int shift : {0, 5}) {
      std::vector<std::vector<float>> grads;
      for (const auto& g : want.grads) grads.emplace_back(g.size(), -12345.0f);
      double norm = 0;
      absl::Status s =
          exact_grad_testing::RankStep(**comm, cfg, shift, /*nan_rank=*/-1, 0, &grads, &norm);
      ASSERT_TRUE(s.ok()) << cfg.Name() << ": " << s;
      EXPECT_EQ(std::memcmp(&norm, &want.norm, sizeof(double)), 0) << cfg.Name();
      int64_t owned = 0;
      for (size_t g = 0; g < want.grads.size(); ++g) {
        for (size_t i = 0; i < want.grads[g].size(); ++i) {
          if (grads[g][i] == -12345.0f) continue;  // another rank's slice
          ++owned;
          ASSERT_EQ(std::memcmp(&grads[g][i], &want.grads[g][i], sizeof(float)), 0)
              << cfg.Name() << " shift " << shift << " group " << g << " element " << i;
        }
      }
      EXPECT_GT(owned, 0) << cfg.Name();
    }
  }
}

}  // namespace
}  // namespace gradsum
