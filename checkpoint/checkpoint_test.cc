#include "checkpoint/checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "core/half.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "io/atomic_file.h"
#include "io/fingerprint.h"
#include "io/safetensors.h"
#include "parallel/test_util.h"
#include "testing/run_ranks.h"

namespace gradsum {
namespace {

using sharding_testing::DenseSpecs;
using sharding_testing::ExpertSpecs;
using sharding_testing::InitGroup;
using sharding_testing::ToyTrainStep;
using testing::RunRanks;

std::string TestDir(absl::string_view name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name);
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') out.push_back(e->d_name);
  }
  ::closedir(d);
  return out;
}

void CopyDir(const std::string& from, const std::string& to) {
  ::mkdir(to.c_str(), 0755);
  for (const std::string& f : ListDir(from)) {
    absl::StatusOr<std::string> bytes = ReadFileToString(from + "/" + f);
    ASSERT_TRUE(bytes.ok());
    ASSERT_TRUE(WriteFileAtomically(to + "/" + f, *bytes).ok());
  }
}

// One rank's model: a dense group over the world and (ep > 1) its EP slot's expert group
// over the EDP group, as the trainer builds them.
struct Model {
  std::unique_ptr<Communicator> edp;
  std::vector<std::unique_ptr<FlatParam>> owned;
  std::vector<FlatParam*> groups;
  std::unique_ptr<ShardedAdamW> opt;
};

struct RunSetup {
  int world = 2;
  int ep = 1;
  ShardingMode mode = ShardingMode::kSharded;
  int micro_batches = 2;
  bool same_expert_names = false;  // a misconfiguration the export must refuse
  int dense_head_rows = 3;         // change to make a layout mismatch
};

absl::StatusOr<Model> BuildModel(Communicator& comm, const RunSetup& s) {
  Model m;
  const int slot = comm.rank() % s.ep;
  GRADSUM_ASSIGN_OR_RETURN(m.edp, comm.Split(slot, comm.rank() / s.ep));
  FlatParamOptions opts;
  opts.mode = s.mode;
  std::vector<ParamSpec> dense = DenseSpecs();
  dense.back().shape[0] = s.dense_head_rows;
  GRADSUM_ASSIGN_OR_RETURN(auto d, FlatParam::Create("dense", dense, &comm, opts));
  m.owned.push_back(std::move(d));
  if (s.ep > 1) {
    const std::string name = s.same_expert_names ? "experts" : absl::StrCat("experts.ep", slot);
    GRADSUM_ASSIGN_OR_RETURN(auto e,
                             FlatParam::Create(name, ExpertSpecs(slot, 2), m.edp.get(), opts));
    m.owned.push_back(std::move(e));
  }
  for (auto& g : m.owned) {
    GRADSUM_RETURN_IF_ERROR(InitGroup(*g));
    m.groups.push_back(g.get());
  }
  GRADSUM_ASSIGN_OR_RETURN(m.opt,
                           ShardedAdamW::Create(m.groups, {.lr = 0.05, .weight_decay = 0.01}));
  return m;
}

using Params = std::map<std::string, std::vector<float>>;

// Full fp32 parameters by name, gathered from every group (collective).
absl::Status Collect(Model& m, std::mutex& mu, Params* out) {
  for (FlatParam* g : m.groups) {
    GRADSUM_RETURN_IF_ERROR(g->Unshard());
    if (g->group_rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      for (int k = 0; k < g->num_params(); ++k) {
        GRADSUM_ASSIGN_OR_RETURN(TensorView v, g->param(k));
        (*out)[g->entries()[k].name].assign(v.data<float>(), v.data<float>() + v.numel());
      }
    }
    GRADSUM_RETURN_IF_ERROR(g->Reshard());
  }
  return absl::OkStatus();
}

// Trains `steps` steps from scratch, or (load_dir set) from a checkpoint; then saves to
// save_dir if set. Returns the full parameters at the end.
absl::StatusOr<Params> Train(const RunSetup& s, int steps, const std::string& load_dir,
                             const std::string& save_dir) {
  Params out;
  std::mutex mu;
  absl::Status status = RunRanks(s.world, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(Model m, BuildModel(comm, s));
    if (!load_dir.empty()) {
      GRADSUM_ASSIGN_OR_RETURN(CheckpointInfo info, LoadCheckpoint(load_dir, comm, *m.opt));
      if (info.extra.at("data_position") != absl::StrCat(info.step * 10)) {
        return absl::InternalError("extra metadata lost");
      }
    }
    for (int t = 0; t < steps; ++t) {
      GRADSUM_RETURN_IF_ERROR(ToyTrainStep(m.groups, *m.opt, comm, s.micro_batches, 1.0));
    }
    if (!save_dir.empty()) {
      GRADSUM_RETURN_IF_ERROR(SaveCheckpoint(
          save_dir, comm, *m.opt, {{"data_position", absl::StrCat(m.opt->step() * 10)}}));
    }
    return Collect(m, mu, &out);
  });
  if (!status.ok()) return status;
  return out;
}

void ExpectBitEqual(const Params& a, const Params& b, absl::string_view what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, va] : a) {
    const std::vector<float>& vb = b.at(name);
    ASSERT_EQ(va.size(), vb.size()) << what << " " << name;
    EXPECT_TRUE(va.empty() || std::memcmp(va.data(), vb.data(), va.size() * 4) == 0)
        << what << " " << name;
  }
}

TEST(CheckpointTest, ResumeContinuesBitExactly) {
  const int n = 3;
  const RunSetup setups[] = {
      {.world = 1, .ep = 1, .mode = ShardingMode::kSharded},
      {.world = 3, .ep = 1, .mode = ShardingMode::kSharded},
      {.world = 4, .ep = 2, .mode = ShardingMode::kReplicated},
      {.world = 8, .ep = 4, .mode = ShardingMode::kSharded},
  };
  for (const RunSetup& s : setups) {
    const std::string dir = TestDir(absl::StrCat("resume_", s.world, "_", s.ep));
    absl::StatusOr<Params> straight = Train(s, 2 * n, "", "");
    ASSERT_TRUE(straight.ok()) << straight.status();
    absl::StatusOr<Params> first = Train(s, n, "", dir);
    ASSERT_TRUE(first.ok()) << first.status();
    absl::StatusOr<Params> resumed = Train(s, n, dir, "");
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    ExpectBitEqual(*straight, *resumed, absl::StrCat("world ", s.world));
    // The run really moved: the checkpointed parameters differ from the final ones.
    EXPECT_NE((*first).at("emb"), (*resumed).at("emb"));
  }
}

TEST(CheckpointTest, ShardedCheckpointResumesInReplicatedModeBitExactly) {
  // With one micro-batch per step both modes compute identical gradients, norms and
  // updates, so switching mode at a checkpoint is invisible.
  RunSetup sharded{.world = 4, .ep = 2, .mode = ShardingMode::kSharded, .micro_batches = 1};
  RunSetup replicated = sharded;
  replicated.mode = ShardingMode::kReplicated;
  const std::string dir = TestDir("mode_switch");
  absl::StatusOr<Params> straight = Train(replicated, 4, "", "");
  ASSERT_TRUE(straight.ok()) << straight.status();
  ASSERT_TRUE(Train(sharded, 2, "", dir).ok());
  absl::StatusOr<Params> resumed = Train(replicated, 2, dir, "");
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  ExpectBitEqual(*straight, *resumed, "mode switch");
}

TEST(CheckpointTest, FilesHoldOnlyUnpaddedSlicesAndExportHasFullParameters) {
  const RunSetup s{.world = 8, .ep = 4, .mode = ShardingMode::kSharded};
  const std::string dir = TestDir("export");
  absl::StatusOr<Params> params = Train(s, 2, "", dir);
  ASSERT_TRUE(params.ok()) << params.status();
  std::vector<std::string> files = ListDir(dir);
  EXPECT_EQ(files.size(), 2u * 8 + 1);  // no temporary files left behind
  // Rank files: "dense/master" slices add up to exactly numel (36): padding is not stored.
  int64_t dense_elems = 0;
  for (int r = 0; r < 8; ++r) {
    absl::StatusOr<SafetensorsFile> f =
        SafetensorsFile::Read(absl::StrCat(dir, "/rank-0000", r, ".safetensors"));
    ASSERT_TRUE(f.ok()) << f.status();
    dense_elems += f->Get("dense/master")->numel();
    EXPECT_EQ(f->Get("dense/exp_avg")->numel(), f->Get("dense/master")->numel());
  }
  EXPECT_EQ(dense_elems, 7 + 13 + 1 + 0 + 15);

  const std::string out = TestDir("export.safetensors");
  ASSERT_TRUE(ExportConsolidated(dir, out).ok());
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Read(out);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata().at("step"), "2");
  ASSERT_EQ(static_cast<size_t>(f->num_tensors()), params->size());
  for (const auto& [name, values] : *params) {
    absl::StatusOr<TensorView> t = f->Get(name);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->numel(), static_cast<int64_t>(values.size()));
    EXPECT_TRUE(values.empty() || std::memcmp(t->raw(), values.data(), values.size() * 4) == 0)
        << name;
  }
  EXPECT_EQ(f->Get("head")->shape(), (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(f->Get("expert7.w1")->shape(), (std::vector<int64_t>{3, 2}));

  const std::string out16 = TestDir("export16.safetensors");
  ASSERT_TRUE(ExportConsolidated(dir, out16, DType::kBF16).ok());
  absl::StatusOr<SafetensorsFile> f16 = SafetensorsFile::Read(out16);
  ASSERT_TRUE(f16.ok());
  absl::StatusOr<TensorView> proj = f16->Get("proj");
  ASSERT_EQ(proj->dtype(), DType::kBF16);
  for (int i = 0; i < 13; ++i) {
    EXPECT_EQ(proj->data<BF16>()[i].bits, BF16::FromFloat(params->at("proj")[i]).bits);
  }
  EXPECT_EQ(ExportConsolidated(dir, out16, DType::kI32).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointTest, ExportRefusesGroupsThatShareANameAcrossSlots) {
  const RunSetup s{.world = 4, .ep = 2, .same_expert_names = true};
  const std::string dir = TestDir("same_names");
  ASSERT_TRUE(Train(s, 1, "", dir).ok());
  absl::Status st = ExportConsolidated(dir, TestDir("same_names.safetensors"));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("\"experts\""), std::string::npos) << st;
}

// Loads `dir` on `s.world` ranks; returns every rank's status and checks that a failed
// load left the parameters untouched.
std::vector<absl::Status> LoadStatuses(const RunSetup& s, const std::string& dir) {
  std::vector<absl::Status> statuses(s.world);
  absl::Status run = RunRanks(s.world, [&](Communicator& comm) -> absl::Status {
    GRADSUM_ASSIGN_OR_RETURN(Model m, BuildModel(comm, s));
    const std::vector<float> before(m.groups[0]->master().begin(), m.groups[0]->master().end());
    absl::StatusOr<CheckpointInfo> info = LoadCheckpoint(dir, comm, *m.opt);
    statuses[comm.rank()] = info.status();
    if (!info.ok()) {
      const std::vector<float> after(m.groups[0]->master().begin(), m.groups[0]->master().end());
      if (before != after || m.opt->step() != 0) {
        return absl::InternalError("a failed load modified the parameters");
      }
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(run.ok()) << run;
  return statuses;
}

std::string Read(const std::string& path) {
  absl::StatusOr<std::string> s = ReadFileToString(path);
  return s.ok() ? *s : "";
}
void Write(const std::string& path, const std::string& bytes) {
  ASSERT_TRUE(WriteFileAtomically(path, bytes).ok());
}

TEST(CheckpointTest, CorruptOrMismatchedCheckpointsAreErrorsOnEveryRank) {
  const RunSetup s{.world = 2, .ep = 1};
  const std::string good = TestDir("good");
  ASSERT_TRUE(Train(s, 1, "", good).ok());
  ASSERT_TRUE(LoadStatuses(s, good)[1].ok());
  // Another run at the same step with the same layout (other data: other values).
  RunSetup other_run = s;
  other_run.micro_batches = 3;
  const std::string other = TestDir("other_run");
  ASSERT_TRUE(Train(other_run, 1, "", other).ok());

  struct Case {
    std::string name;
    std::function<void(const std::string& dir)> damage;
    absl::StatusCode rank1_code;  // rank 0 is intact in every case except where noted
    std::string needle;
  };
  const std::string t1 = "/rank-00001.safetensors", m1 = "/rank-00001.manifest.json";
  const std::vector<Case> cases = {
      {"truncated tensors",
       [&](const std::string& d) { Write(d + t1, Read(d + t1).substr(0, 50)); },
       absl::StatusCode::kDataLoss, "manifest says"},
      {"flipped data byte",
       [&](const std::string& d) {
         std::string b = Read(d + t1);
         b[b.size() - 3] ^= 0x40;
         Write(d + t1, b);
       },
       absl::StatusCode::kDataLoss, "fingerprint"},
      {"missing tensors", [&](const std::string& d) { ::unlink((d + t1).c_str()); },
       absl::StatusCode::kNotFound, "rank-00001.safetensors"},
      {"truncated manifest",
       [&](const std::string& d) { Write(d + m1, Read(d + m1).substr(0, 40)); },
       absl::StatusCode::kDataLoss, "rank-00001.manifest.json"},
      {"manifest layout edited",
       [&](const std::string& d) {
         // int64 members are JSON strings (the proto3 mapping, docs/CHECKPOINTS.md).
         const std::string m = Read(d + m1);
         ASSERT_NE(m.find("\"local_numel\":\"18\""), std::string::npos) << m;
         Write(d + m1, absl::StrReplaceAll(m, {{"\"local_numel\":\"18\"", "\"local_numel\":17"}}));
       },
       absl::StatusCode::kDataLoss, "local_numel 17"},
      {"manifest field wrong type",
       [&](const std::string& d) {
         const std::string m = Read(d + m1);
         ASSERT_NE(m.find("\"step\":\"1\""), std::string::npos) << m;
         Write(d + m1, absl::StrReplaceAll(m, {{"\"step\":\"1\"", "\"step\":true"}}));
       },
       absl::StatusCode::kDataLoss, "(step): invalid value true"},
      {"manifest field missing",
       [&](const std::string& d) {
         Write(d + m1,
               absl::StrReplaceAll(Read(d + m1), {{"\"offset\":\"0\"", "\"offset\":null"}}));
       },
       absl::StatusCode::kDataLoss, "missing field \"groups[0].params[0].offset\""},
      {"manifest of another version",
       [&](const std::string& d) {
         Write(d + m1, absl::StrReplaceAll(Read(d + m1), {{"\"version\":3", "\"version\":2"}}));
       },
       absl::StatusCode::kFailedPrecondition,
       "rank-00001.manifest.json' has format version 2; this build reads only version 3 (the "
       "checkpoint was written by an older build)"},
      {"manifest garbage", [&](const std::string& d) { Write(d + m1, "\x01\x02{{{"); },
       absl::StatusCode::kDataLoss, "rank-00001.manifest.json': not a valid FormatHeader in JSON"},
      {"no commit marker",
       [&](const std::string& d) { ::unlink((d + "/checkpoint.json").c_str()); },
       absl::StatusCode::kNotFound, "incomplete"},
      {"rank 1 files of another run",
       [&](const std::string& d) {
         Write(d + m1, Read(other + m1));
         Write(d + t1, Read(other + t1));
       },
       absl::StatusCode::kDataLoss,
       "rank 1's rank-00001.manifest.json is not the file this save's commit marker recorded"},
      {"marker edited",
       [&](const std::string& d) {
         const std::string m = Read(d + "/checkpoint.json");
         ASSERT_NE(m.find("\"step\":\"1\""), std::string::npos) << m;
         Write(d + "/checkpoint.json", absl::StrReplaceAll(m, {{"\"step\":\"1\"", "\"step\":2"}}));
       },
       absl::StatusCode::kDataLoss, "does not match its own fingerprint"},
      {"marker garbage",
       [&](const std::string& d) { Write(d + "/checkpoint.json", "{\"format\""); },
       absl::StatusCode::kDataLoss, "checkpoint.json"},
      {"marker of another version",
       [&](const std::string& d) {
         const std::string m = Read(d + "/checkpoint.json");
         Write(d + "/checkpoint.json",
               absl::StrReplaceAll(m, {{"\"version\":3", "\"version\":4"}}));
       },
       absl::StatusCode::kFailedPrecondition,
       "checkpoint.json' has format version 4; this build reads only version 3"},
  };
  for (const Case& c : cases) {
    const std::string dir = TestDir("case_" + absl::StrReplaceAll(c.name, {{" ", "_"}}));
    CopyDir(good, dir);
    c.damage(dir);
    std::vector<absl::Status> st = LoadStatuses(s, dir);
    EXPECT_EQ(st[1].code(), c.rank1_code) << c.name << ": " << st[1];
    EXPECT_NE(st[1].message().find(c.needle), std::string::npos) << c.name << ": " << st[1];
    EXPECT_FALSE(st[0].ok()) << c.name << ": rank 0 must not succeed alone";
    // The export reads every rank's files and fails the same way.
    EXPECT_FALSE(ExportConsolidated(dir, dir + "/../x.safetensors").ok()) << c.name;
  }

  // A checkpoint of another model (another parameter shape, a parameter more or less):
  // FailedPrecondition naming the parameter, on every rank.
  RunSetup other_layout = s;
  other_layout.dense_head_rows = 4;
  std::vector<absl::Status> st = LoadStatuses(other_layout, good);
  for (const absl::Status& x : st) {
    EXPECT_EQ(x.code(), absl::StatusCode::kFailedPrecondition) << x;
    EXPECT_NE(x.message().find("\"head\": shape is [3,5] in the checkpoint but [4,5] now"),
              std::string::npos)
        << x;
  }
  RunSetup with_experts{.world = 2, .ep = 2};
  st = LoadStatuses(with_experts, good);
  for (const absl::Status& x : st) {
    EXPECT_EQ(x.code(), absl::StatusCode::kFailedPrecondition) << x;
    EXPECT_NE(x.message().find("has no parameter \"expert"), std::string::npos) << x;
  }
  const std::string experts_dir = TestDir("with_experts");
  ASSERT_TRUE(Train(with_experts, 1, "", experts_dir).ok());
  st = LoadStatuses(s, experts_dir);
  for (const absl::Status& x : st) {
    EXPECT_EQ(x.code(), absl::StatusCode::kFailedPrecondition) << x;
    EXPECT_NE(x.message().find("has parameter \"expert0.w1\", which this model does not have"),
              std::string::npos)
        << x;
  }
  EXPECT_EQ(LoadStatuses(s, TestDir("does_not_exist"))[0].code(), absl::StatusCode::kNotFound);
}

// A checkpoint loads onto another world size (EDP size) and sharding mode: each rank reads
// the parameter ranges its new shards cover. Loading moves the master values exactly (the
// parameters gathered after the load equal the saved run's), and the moments too: the
// round trip 4 -> 2 (replicated) -> 8 -> 4 ranks writes rank files byte-identical to the
// original save.
TEST(CheckpointTest, LoadsOntoAnyWorldSizeAndModeExactly) {
  const RunSetup four{.world = 4, .ep = 2, .mode = ShardingMode::kSharded};
  const RunSetup two{.world = 2, .ep = 2, .mode = ShardingMode::kReplicated};
  const RunSetup eight{.world = 8, .ep = 2, .mode = ShardingMode::kSharded};
  const std::string a = TestDir("mesh_a"), b = TestDir("mesh_b"), c = TestDir("mesh_c"),
                    d = TestDir("mesh_d");
  absl::StatusOr<Params> saved = Train(four, 2, "", a);
  ASSERT_TRUE(saved.ok()) << saved.status();
  absl::StatusOr<Params> on_two = Train(two, 0, a, b);
  ASSERT_TRUE(on_two.ok()) << on_two.status();
  ExpectBitEqual(*saved, *on_two, "4 -> 2 ranks");
  absl::StatusOr<Params> on_eight = Train(eight, 0, b, c);
  ASSERT_TRUE(on_eight.ok()) << on_eight.status();
  ExpectBitEqual(*saved, *on_eight, "2 -> 8 ranks");
  ASSERT_TRUE(Train(four, 0, c, d).ok());
  for (int r = 0; r < 4; ++r) {
    for (const char* f : {"safetensors", "manifest.json"}) {
      const std::string name = absl::StrCat("/rank-0000", r, ".", f);
      EXPECT_EQ(Read(a + name), Read(d + name)) << name << " after 4 -> 2 -> 8 -> 4 ranks";
    }
  }
  // A flipped byte in a file another rank count reads is still caught by its fingerprint.
  const std::string e = TestDir("mesh_e");
  CopyDir(a, e);
  std::string bytes = Read(e + "/rank-00003.safetensors");
  bytes[bytes.size() - 2] ^= 0x10;
  Write(e + "/rank-00003.safetensors", bytes);
  const std::vector<absl::Status> st = LoadStatuses(two, e);
  for (const absl::Status& x : st) {
    EXPECT_EQ(x.code(), absl::StatusCode::kDataLoss) << x;
    EXPECT_NE(x.message().find("rank-00003.safetensors' does not match its manifest fingerprint"),
              std::string::npos)
        << x;
  }
}

// The files are the JSON docs/CHECKPOINTS.md describes, written out here by hand; the
// fingerprints are XXH3-64 of the files' bytes (what `xxhsum -H3` prints), and the marker's
// own covers its text without the "fingerprint" member.
TEST(CheckpointTest, FilesAreTheDocumentedJson) {
  const std::string dir = TestDir("documented_json");
  ASSERT_TRUE(Train({.world = 2, .ep = 1}, 1, "", dir).ok());
  auto hex = [](uint64_t v) { return absl::StrFormat("%016x", v); };
  const std::string t1 = Read(dir + "/rank-00001.safetensors");
  // DenseSpecs: emb [7], proj [13], scale [1], empty [0], head [3, 5]: 36 elements, 18 a rank.
  EXPECT_EQ(
      Read(dir + "/rank-00001.manifest.json"),
      absl::StrCat(R"({"format":"gradsum.sharded_checkpoint","version":3,"rank":1,"world":2,)",
                   R"("step":"1","tensors_file":"rank-00001.safetensors","tensors_bytes":")",
                   t1.size(), R"(","tensors_fingerprint":")", hex(Fingerprint64(t1)), R"(",)",
                   R"("groups":[{"name":"dense","mode":"sharded","group_size":2,"group_rank":1,)",
                   R"("numel":"36","padded_numel":"36","shard_offset":"18","local_numel":"18",)",
                   R"("params":[{"name":"emb","shape":["7"],"offset":"0"},)",
                   R"({"name":"proj","shape":["13"],"offset":"7"},)",
                   R"({"name":"scale","shape":["1"],"offset":"20"},)",
                   R"({"name":"empty","shape":["0"],"offset":"21"},)",
                   R"({"name":"head","shape":["3","5"],"offset":"21"}]}]})", "\n"));
  std::string body = R"({"format":"gradsum.sharded_checkpoint","version":3,"world":2,"step":"1",)"
                     R"("ranks":[)";
  for (int r = 0; r < 2; ++r) {
    absl::StrAppend(&body, r > 0 ? "," : "", R"({"manifest":")",
                    hex(Fingerprint64(Read(dir + absl::StrFormat("/rank-%05d.manifest.json", r)))),
                    R"(","tensors":")",
                    hex(Fingerprint64(Read(dir + absl::StrFormat("/rank-%05d.safetensors", r)))),
                    R"("})");
  }
  absl::StrAppend(&body, R"(],"extra":{"data_position":"10"})");
  EXPECT_EQ(Read(dir + "/checkpoint.json"),
            absl::StrCat(body, R"(,"fingerprint":")", hex(Fingerprint64(body + "}")), "\"}\n"));
}

TEST(CheckpointTest, SavingRemovesTheTempFilesOfInterruptedSaves) {
  const RunSetup s{.world = 2, .ep = 1};
  const std::string dir = TestDir("stale_tmp");
  ::mkdir(dir.c_str(), 0755);
  Write(dir + "/rank-00001.safetensors.tmp.4242.0", "half a file");
  Write(dir + "/checkpoint.json.tmp.4242.1", "{");
  ASSERT_TRUE(Train(s, 1, "", dir).ok());
  std::vector<std::string> files = ListDir(dir);
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"checkpoint.json", "rank-00000.manifest.json",
                                             "rank-00000.safetensors", "rank-00001.manifest.json",
                                             "rank-00001.safetensors"}));
  EXPECT_TRUE(LoadStatuses(s, dir)[0].ok());
}

}  // namespace
}  // namespace gradsum
