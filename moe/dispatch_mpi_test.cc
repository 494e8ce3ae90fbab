// Dispatch/combine on the MPI backend (one process per rank, run by mpirun_test.sh with 2 or 4
// processes): the same problems and checks as the thread-backend test, so the routing is shown
// to depend only on the Communicator interface. Every process builds the same global problem
// from the seed and checks its own rank against the double reference.
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "collectives/mpi_backend.h"
#include "gtest/gtest.h"
#include "moe/dispatch_testing.h"

namespace gradsum::moe {
namespace {

// Runs `p` on the MPI world and checks this process's rank.
void RunAndCheck(Communicator& world, const test::Problem& p) {
  test::RankResult result;
  absl::Status status = test::RunDispatchOnRank(world, p, &result);
  ASSERT_TRUE(status.ok()) << status;
  test::ExpectRankMatchesReference(p, world.rank(), result);
}

class DispatchMpiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Communicator>> world = CreateMpiWorldCommunicator();
    ASSERT_TRUE(world.ok()) << world.status();
    world_ = std::move(*world);
  }
  // Uneven token counts, one rank without tokens.
  std::vector<int> Tokens() const {
    std::vector<int> tokens = {7, 0, 9, 4};
    tokens.resize(world_->size());
    return tokens;
  }
  std::unique_ptr<Communicator> world_;
};

TEST_F(DispatchMpiTest, WholeWorldIsTheEpGroup) {
  const int W = world_->size();
  RunAndCheck(*world_, test::MakeProblem(W, W, 2 * W, 2, Tokens(), 500 + W));
}

TEST_F(DispatchMpiTest, TwoEdpReplicasSumExpertGradients) {
  const int W = world_->size();
  if (W % 2 != 0) GTEST_SKIP() << "needs an even world";
  RunAndCheck(*world_, test::MakeProblem(W, W / 2, 4, 2, Tokens(), 600 + W));
}

TEST_F(DispatchMpiTest, AllTokensToTheLastExpert) {
  const int W = world_->size();
  test::Problem p = test::MakeProblem(W, W, W, 1, Tokens(), 700 + W);
  for (auto& idx : p.idx) {
    for (int32_t& e : idx) e = W - 1;
  }
  RunAndCheck(*world_, p);
}

}  // namespace
}  // namespace gradsum::moe
