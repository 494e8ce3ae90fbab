// The step record (train/metrics.proto StepMetrics) as moe_lm reports it: the --metrics
// JSONL line against text written out by hand from the proto3 JSON mapping, the log line,
// and the summary.
#include "train/step_log.h"

#include <cmath>
#include <limits>
#include <string>

#include "absl/time/time.h"
#include "collectives/timed_communicator.h"
#include "gtest/gtest.h"
#include "train/metrics.pb.h"

namespace gradsum::train {
namespace {

// Every field set, in the order Trainer::Step sets them (not the field order).
StepMetrics FullRecord() {
  StepMetrics r;
  r.set_step(7);
  r.set_ce(2.5);
  r.set_z(0);  // zero values are written, not omitted
  r.set_bal(0.125);
  r.set_loss(2.625);
  r.set_valid_tokens(4096);
  r.set_routed_tokens(int64_t{1} << 33);
  r.set_grad_norm(0.1);  // not exact in binary: written so that it reads back exactly
  r.set_lr(1e-4);
  r.add_maxvio(0.5);
  r.add_maxvio(0);
  for (int64_t c : {6, 2, 4, 4}) r.add_tokens_per_expert(c);  // 2 layers x 2 experts
  r.set_step_s(1.5);
  r.set_comm_s(0.25);
  CommTimer::Exposed exposed;
  exposed.total = absl::Seconds(0.0625);
  // all_gather, reduce_scatter, all_reduce, all_to_all, sp_all_to_all, cp_ring, other
  // (CommKind order).
  const double by_kind[kNumCommKinds] = {0.03125,    0.015625,    0.0078125, 0,
                                         0.00390625, 0.001953125, 0.00390625};
  for (int k = 0; k < kNumCommKinds; ++k) {
    exposed.by_kind[k] = absl::Seconds(by_kind[k]);
    exposed.calls[k] = 10 + k;
  }
  SetCommExposed(exposed, &r);
  r.set_peak_unsharded_param_bytes(1024);
  r.set_full_param_bytes(2048);
  r.set_wait_s(0);
  r.set_model_s(1);
  r.set_update_s(0.5);
  r.set_tokens_per_s(3e10);
  r.set_peak_activation_bytes(int64_t{3} << 21);  // 6 MiB
  r.set_model_flops(3e9);
  r.set_hardware_flops(3.5e9);
  r.set_flops_per_s(2e9);
  r.set_mfu(0.25);
  r.set_consumed_tokens(int64_t{1} << 34);
  r.set_consumed_sequences(224);
  r.set_data_s(0.0625);
  r.set_peak_rss_bytes(int64_t{1} << 30);
  r.set_ce_max_rank(2.75);
  r.set_skipped_steps(0);
  r.set_nonfinite_steps(0);
  r.set_peak_head_scratch_bytes(int64_t{1} << 22);  // 4 MiB
  return r;
}

// The proto3 JSON mapping's members in field order, but with numbers as tools read them:
// 64-bit integers as JSON numbers (the mapping writes strings), doubles as JSON floats.
TEST(StepLogTest, JsonIsTheProtoMappingInFieldOrderWithNumbersForTools) {
  const StepMetrics r = FullRecord();
  const double by_kind[kNumCommKinds] = {0.03125,    0.015625,    0.0078125, 0,
                                         0.00390625, 0.001953125, 0.00390625};
  for (int k = 0; k < kNumCommKinds; ++k) {
    EXPECT_EQ(CommExposedSeconds(r, static_cast<CommKind>(k)), by_kind[k]) << k;
  }
  absl::StatusOr<std::string> json = StepJsonLine(r);
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(*json,
            "{\"step\":7,\"ce\":2.5,\"z\":0.0,\"bal\":0.125,\"loss\":2.625,"
            "\"valid_tokens\":4096,\"routed_tokens\":8589934592,\"grad_norm\":0.1,"
            "\"lr\":0.0001,\"maxvio\":[0.5,0.0],\"step_s\":1.5,\"comm_s\":0.25,"
            "\"comm_exposed_s\":0.0625,\"peak_unsharded_param_bytes\":1024,"
            "\"full_param_bytes\":2048,\"wait_s\":0.0,\"model_s\":1.0,\"update_s\":0.5,"
            "\"tokens_per_s\":30000000000.0,\"exposed_all_gather_s\":0.03125,"
            "\"exposed_reduce_scatter_s\":0.015625,\"exposed_all_reduce_s\":0.0078125,"
            "\"exposed_all_to_all_s\":0.0,\"exposed_other_s\":0.00390625,"
            "\"exposed_sp_all_to_all_s\":0.00390625,\"peak_activation_bytes\":6291456,"
            "\"all_gather_calls\":10,\"reduce_scatter_calls\":11,\"all_reduce_calls\":12,"
            "\"all_to_all_calls\":13,\"sp_all_to_all_calls\":14,\"other_calls\":16,"
            "\"tokens_per_expert\":[6,2,4,4],\"exposed_cp_ring_s\":0.001953125,"
            "\"cp_ring_calls\":15,\"model_flops\":3000000000.0,\"hardware_flops\":3500000000.0,"
            "\"flops_per_s\":2000000000.0,\"mfu\":0.25,\"consumed_tokens\":17179869184,"
            "\"consumed_sequences\":224,\"data_s\":0.0625,\"peak_rss_bytes\":1073741824,"
            "\"ce_max_rank\":2.75,\"skipped_steps\":0,\"nonfinite_steps\":0,"
            "\"peak_head_scratch_bytes\":4194304}");
}

TEST(StepLogTest, NonFiniteValuesAreTheMappingsStrings) {
  StepMetrics r = FullRecord();
  r.set_ce(std::numeric_limits<double>::quiet_NaN());
  r.set_grad_norm(std::numeric_limits<double>::infinity());
  absl::StatusOr<std::string> json = StepJsonLine(r);
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_NE(json->find("\"ce\":\"NaN\""), std::string::npos) << *json;
  EXPECT_NE(json->find("\"grad_norm\":\"Infinity\""), std::string::npos) << *json;
}

// A record with a field never set would drop it from the line: refused, naming it.
TEST(StepLogTest, JsonOfARecordWithAnUnsetFieldIsInternal) {
  StepMetrics r = FullRecord();
  r.clear_wait_s();
  absl::StatusOr<std::string> json = StepJsonLine(r);
  EXPECT_EQ(json.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(json.status().message().find("wait_s"), std::string::npos) << json.status();
}

TEST(StepLogTest, LogLineAndSummary) {
  StepMetrics r = FullRecord();
  EXPECT_EQ(StepLogLine(r, 500),
            "step   7/500 | ce 2.5000 | bal 0.125000 | z 0.000000 | valid 4096 | gnorm 0.1000 | "
            "lr 1.00e-04 | 30000.00M tok/s, 2.0 GFLOP/s, mfu 25.0% | comm 250.0 ms, exposed 62.5 "
            "ms (4%) | wait 0.0 ms | "
            "params 50%");
  // The held-out CE, on the steps evaluated, after z.
  StepMetrics evaluated = r;
  evaluated.set_eval_ce(1.75);
  EXPECT_EQ(StepLogLine(evaluated, 500),
            "step   7/500 | ce 2.5000 | bal 0.125000 | z 0.000000 | eval ce 1.7500 | valid 4096 | "
            "gnorm 0.1000 | lr 1.00e-04 | 30000.00M tok/s, 2.0 GFLOP/s, mfu 25.0% | comm 250.0 ms, "
            "exposed 62.5 ms (4%) | "
            "wait 0.0 ms | params 50%");
  absl::StatusOr<std::string> evaluated_json = StepJsonLine(evaluated);
  ASSERT_TRUE(evaluated_json.ok()) << evaluated_json.status();
  EXPECT_NE(evaluated_json->find("\"eval_ce\":1.75"), std::string::npos) << *evaluated_json;
  absl::StatusOr<std::string> plain_json = StepJsonLine(r);
  ASSERT_TRUE(plain_json.ok());
  EXPECT_EQ(plain_json->find("eval_ce"), std::string::npos);
  // The time left, when the trainer gives it, at the end.
  EXPECT_EQ(StepLogLine(r, 500, 185.4),
            "step   7/500 | ce 2.5000 | bal 0.125000 | z 0.000000 | valid 4096 | gnorm 0.1000 | "
            "lr 1.00e-04 | 30000.00M tok/s, 2.0 GFLOP/s, mfu 25.0% | comm 250.0 ms, exposed 62.5 "
            "ms (4%) | wait 0.0 ms | "
            "params 50% | eta 3m05s");
  EXPECT_EQ(HumanDuration(0), "0s");
  EXPECT_EQ(HumanDuration(59.4), "59s");
  EXPECT_EQ(HumanDuration(60), "1m00s");
  EXPECT_EQ(HumanDuration(7625), "2h07m");
  EXPECT_EQ(HumanDuration(-3), "0s");
  // MTP's terms (§15.1) after z, one per depth, only with --mtp_depth.
  StepMetrics with_mtp = r;
  with_mtp.add_mtp(0.25);
  with_mtp.add_mtp(0.125);
  EXPECT_EQ(StepLogLine(with_mtp, 500),
            "step   7/500 | ce 2.5000 | bal 0.125000 | z 0.000000 | mtp 0.2500 0.1250 | "
            "valid 4096 | gnorm 0.1000 | lr 1.00e-04 | 30000.00M tok/s, 2.0 GFLOP/s, mfu 25.0% | "
            "comm 250.0 ms, "
            "exposed 62.5 ms (4%) | wait 0.0 ms | params 50%");
  StepMetrics r2 = r;
  r2.set_step(8);
  r2.set_ce(1.5);
  const TrainSummary s = Summarize({r, r2}, /*first_step=*/8, /*entropy_floor=*/1.25);
  EXPECT_EQ(s.first_step, 8);
  EXPECT_EQ(s.last_step, 8);
  EXPECT_EQ(s.first_ce, 1.5);
  EXPECT_EQ(s.seconds, 1.5);  // step 7 was before this run
  EXPECT_EQ(s.comm_exposed_by_kind_seconds[static_cast<int>(CommKind::kAllGather)], 0.03125);
  EXPECT_EQ(s.median_peak_param_fraction, 0.5);
  EXPECT_EQ(s.median_peak_activation_bytes, 6 << 20);
  EXPECT_EQ(s.ToString(),
            "summary: steps 8-8 in 1.5 s, 5726.62M tok/s, comm 17% (exposed 4%), wait 0% of step "
            "time\n"
            "summary: exposed by collective (% of step time): all_gather 2.1%, reduce_scatter "
            "1.0%, all_reduce 0.5%, all_to_all 0.0%, sp_all_to_all 0.3%, cp_ring 0.1%, other "
            "0.3%\n"
            "summary: median exposed / comm 0.250; median peak unsharded / full parameter bytes "
            "0.500; median peak activation bytes 6.0 MiB\n"
            "summary: 2.0 GFLOP/s model FLOPs (3e+09 per step; hardware 3.5e+09), mfu 25.0% of "
            "8.0 GFLOP/s; data loading 4.17% of step time; peak RSS 1024.0 MiB; consumed "
            "17179869184 tokens, 224 sequences\n"
            "summary: ce 1.5000 -> 1.5000 (mean of the last steps 1.5000)\n"
            "summary: maxvio per layer: mean 0.5000 0.0000; mean of the last steps 0.5000 "
            "0.0000\n"
            "summary: entropy floor 1.2500 nats/token; ce / floor = 1.200 (NOT within 1.10)\n");
  EXPECT_EQ(Summarize({r}, 8, -1).ToString(), "summary: no steps run\n");
  // The held-out CE's first and last evaluated steps.
  StepMetrics e1 = r, e2 = r;
  e1.set_step(8);
  e1.set_eval_ce(2.25);
  e2.set_step(9);
  e2.set_eval_ce(1.125);
  const std::string with_eval = Summarize({e1, e2}, 8, -1).ToString();
  EXPECT_NE(with_eval.find("summary: held-out ce 2.2500 (step 8) -> 1.1250 (step 9)\n"),
            std::string::npos)
      << with_eval;
}

// The output z-loss of SEMANTICS.md §3.2 is its own field, set only by runs with
// --alpha_lse > 0: then the JSON line has it (field 37, also when it is 0), the log
// line shows it after z and the summary has a line for it; without it nothing changes
// (the tests above are those records).
TEST(StepLogTest, OutputZLossIsItsOwnFieldOnlyWhenSet) {
  StepMetrics r = FullRecord();
  absl::StatusOr<std::string> plain = StepJsonLine(r);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->find("z_out"), std::string::npos) << *plain;
  r.set_z_out(0.03125);
  absl::StatusOr<std::string> json = StepJsonLine(r);
  ASSERT_TRUE(json.ok()) << json.status();
  // In field-number order: after cp_ring_calls (35), before the fields from 60 on.
  const size_t before = plain->find(",\"model_flops\"");
  ASSERT_NE(before, std::string::npos) << *plain;
  auto with = [&](const std::string& member) {
    return plain->substr(0, before) + member + plain->substr(before);
  };
  EXPECT_EQ(*json, with(",\"z_out\":0.03125"));
  r.set_z_out(0);
  json = StepJsonLine(r);
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(*json, with(",\"z_out\":0.0"));
  // The exemption is z_out's alone: another unset field is still refused.
  r.clear_wait_s();
  EXPECT_EQ(StepJsonLine(r).status().code(), absl::StatusCode::kInternal);

  r = FullRecord();
  r.set_z_out(0.03125);
  EXPECT_EQ(StepLogLine(r, 500),
            "step   7/500 | ce 2.5000 | bal 0.125000 | z 0.000000 | z_out 0.031250 | valid 4096 | "
            "gnorm 0.1000 | lr 1.00e-04 | 30000.00M tok/s, 2.0 GFLOP/s, mfu 25.0% | comm 250.0 ms, "
            "exposed 62.5 ms (4%) | "
            "wait 0.0 ms | params 50%");
  StepMetrics r2 = r;
  r2.set_step(8);
  r2.set_z_out(0.015625);
  const TrainSummary s = Summarize({r, r2}, /*first_step=*/7, /*entropy_floor=*/-1);
  EXPECT_EQ(s.first_z_out, 0.03125);
  EXPECT_EQ(s.last_z_out, 0.015625);
  EXPECT_EQ(s.tail_mean_z_out, 0.0234375);
  EXPECT_NE(s.ToString().find("summary: ce 2.5000 -> 2.5000 (mean of the last steps 2.5000)\n"
                              "summary: output z-loss z_out 0.031250 -> 0.015625 (mean of the "
                              "last steps 0.023438), not in ce\n"),
            std::string::npos)
      << s.ToString();
  const TrainSummary without = Summarize({FullRecord()}, 7, -1);
  EXPECT_EQ(without.tail_mean_z_out, -1);
  EXPECT_EQ(without.ToString().find("z_out"), std::string::npos) << without.ToString();
}

// The FLOP rate, MFU against the records' peak, data share, memory and consumed counts.
TEST(StepLogTest, SummaryHasTheFlopRateAndMfu) {
  StepMetrics r = FullRecord();  // 3e9 FLOPs in 1.5 s; 2e9 FLOP/s at mfu 0.25: peak 8e9
  StepMetrics r2 = r;
  r2.set_step(8);
  r2.set_consumed_tokens(r.consumed_tokens() + 100);
  r2.set_consumed_sequences(256);
  const TrainSummary s = Summarize({r, r2}, /*first_step=*/7, /*entropy_floor=*/-1);
  EXPECT_EQ(s.model_flops, 6e9);
  EXPECT_EQ(s.hardware_flops, 7e9);
  EXPECT_EQ(s.peak_flops_per_s, 8e9);
  EXPECT_EQ(s.data_seconds, 0.125);
  EXPECT_EQ(s.consumed_sequences, 256);
  EXPECT_NE(s.ToString().find("summary: 2.0 GFLOP/s model FLOPs (3e+09 per step; hardware "
                              "3.5e+09), mfu 25.0% of 8.0 GFLOP/s; data loading 4.17% of step "
                              "time; peak RSS 1024.0 MiB; consumed 17179869284 tokens, 256 "
                              "sequences\n"),
            std::string::npos)
      << s.ToString();
}

// A source where context helps: both floors, the per-token one to beat and the context
// one to approach.
TEST(StepLogTest, SummaryWithTwoFloors) {
  StepMetrics r = FullRecord();
  r.set_ce(1.5);
  const TrainSummary s = Summarize({r}, /*first_step=*/7, /*entropy_floor=*/2.5,
                                   /*context_floor=*/1.4);
  EXPECT_NE(s.ToString().find("summary: per-token floor 2.5000, context floor 1.4000 nats/token; "
                              "ce below the per-token floor; ce / context floor = 1.071 (within "
                              "1.10)\n"),
            std::string::npos)
      << s.ToString();
  const TrainSummary worse = Summarize({r}, 7, /*entropy_floor=*/1.45, /*context_floor=*/1.2);
  EXPECT_NE(worse.ToString().find("ce NOT below the per-token floor; ce / context floor = 1.250 "
                                  "(NOT within 1.10)"),
            std::string::npos)
      << worse.ToString();
}

}  // namespace
}  // namespace gradsum::train
