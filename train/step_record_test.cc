// The --metrics JSONL record of a step (train/metrics.proto StepMetrics) against text
// written out by hand from the proto3 JSON mapping.
#include <cmath>
#include <limits>
#include <string>

#include "gtest/gtest.h"
#include "train/trainer.h"

namespace gradsum::train {
namespace {

TEST(StepRecordTest, JsonIsTheProto3MappingInFieldOrder) {
  StepRecord r;
  r.step = 7;
  r.ce = 2.5;
  r.z = 0;  // zero values are written, not omitted
  r.bal = 0.125;
  r.loss = 2.625;
  r.valid_tokens = 4096;
  r.routed_tokens = int64_t{1} << 33;
  r.grad_norm = 0.1;  // not exact in binary: written so that it reads back exactly
  r.lr = 1e-4;
  r.maxvio = {0.5, 0};
  r.step_seconds = 1.5;
  r.comm_seconds = 0.25;
  r.comm_exposed_seconds = 0.0625;
  // all_gather, reduce_scatter, all_reduce, all_to_all, other (CommKind order).
  const double by_kind[kNumCommKinds] = {0.03125, 0.015625, 0.0078125, 0, 0.0078125};
  for (int k = 0; k < kNumCommKinds; ++k) r.comm_exposed_by_kind_seconds[k] = by_kind[k];
  r.peak_unsharded_param_bytes = 1024;
  r.full_param_bytes = 2048;
  r.wait_seconds = 0;
  r.model_seconds = 1;
  r.update_seconds = 0.5;
  r.tokens_per_second = 3e10;
  absl::StatusOr<std::string> json = r.ToJson();
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(*json,
            "{\"step\":7,\"ce\":2.5,\"z\":0,\"bal\":0.125,\"loss\":2.625,"
            "\"valid_tokens\":\"4096\",\"routed_tokens\":\"8589934592\",\"grad_norm\":0.1,"
            "\"lr\":0.0001,\"maxvio\":[0.5,0],\"step_s\":1.5,\"comm_s\":0.25,"
            "\"comm_exposed_s\":0.0625,\"peak_unsharded_param_bytes\":\"1024\","
            "\"full_param_bytes\":\"2048\",\"wait_s\":0,\"model_s\":1,\"update_s\":0.5,"
            "\"tokens_per_s\":30000000000,\"exposed_all_gather_s\":0.03125,"
            "\"exposed_reduce_scatter_s\":0.015625,\"exposed_all_reduce_s\":0.0078125,"
            "\"exposed_all_to_all_s\":0,\"exposed_other_s\":0.0078125}");
}

TEST(StepRecordTest, NonFiniteValuesAreTheMappingsStrings) {
  StepRecord r;
  r.ce = std::numeric_limits<double>::quiet_NaN();
  r.grad_norm = std::numeric_limits<double>::infinity();
  absl::StatusOr<std::string> json = r.ToJson();
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_NE(json->find("\"ce\":\"NaN\""), std::string::npos) << *json;
  EXPECT_NE(json->find("\"grad_norm\":\"Infinity\""), std::string::npos) << *json;
}

}  // namespace
}  // namespace gradsum::train
