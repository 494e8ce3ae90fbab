#include "train/config_flags.h"

#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gradsum::train {
namespace {

using ::testing::HasSubstr;

TEST(ConfigFlagsTest, EveryFlagMapsToARealField) {
  for (const FlagField& f : OverridableFlags()) {
    ASSERT_NE(absl::FindCommandLineFlag(f.flag), nullptr) << f.flag;
    TrainConfig c;
    // "1" parses as every numeric and bool type the flags use, and an enum flag takes its
    // last word (not the default), so only a wrong path can fail.
    const google::protobuf::Descriptor* d = TrainConfig::descriptor();
    const google::protobuf::FieldDescriptor* field = nullptr;
    for (absl::string_view part : absl::StrSplit(f.field_path, '.')) {
      ASSERT_NE(d, nullptr) << f.field_path;
      field = d->FindFieldByName(std::string(part));
      ASSERT_NE(field, nullptr) << f.field_path;
      d = field->message_type();
    }
    const google::protobuf::EnumDescriptor* e = field->enum_type();
    const std::string value = e == nullptr ? "1" : e->value(e->value_count() - 1)->name();
    absl::Status s = ApplyOverrides({{f.field_path, value}}, &c);
    EXPECT_TRUE(s.ok()) << f.flag << ": " << s;
    // Unset until given: the flag's own default never overrides a config file.
    EXPECT_TRUE(absl::FindCommandLineFlag(f.flag)->CurrentValue().empty() ||
                absl::FindCommandLineFlag(f.flag)->CurrentValue() == "false")
        << f.flag;
  }
}

// The flags are generated from config.proto's field options: each (flag) field has its
// flag, with the (help) text, of the kind the field's type gives, and nothing else.
TEST(ConfigFlagsTest, EveryFlagIsDeclaredByItsFieldOptions) {
  int declared = 0;
  const google::protobuf::Descriptor* root = TrainConfig::descriptor();
  for (int s = 0; s < root->field_count(); ++s) {
    const google::protobuf::Descriptor* section = root->field(s)->message_type();
    ASSERT_NE(section, nullptr) << root->field(s)->name();
    for (int i = 0; i < section->field_count(); ++i) {
      const google::protobuf::FieldOptions& o = section->field(i)->options();
      if (!o.HasExtension(flag)) continue;
      ++declared;
      const std::string path = root->field(s)->name() + "." + section->field(i)->name();
      absl::CommandLineFlag* f = absl::FindCommandLineFlag(o.GetExtension(flag));
      ASSERT_NE(f, nullptr) << path;
      EXPECT_EQ(f->Help(), o.GetExtension(help)) << path;
      EXPECT_EQ(f->IsOfType<bool>(), o.GetExtension(switch_flag)) << path;
      EXPECT_THAT(f->Filename(), HasSubstr("train/config_flags.cc")) << path;
      bool in_table = false;
      for (const FlagField& ff : OverridableFlags()) {
        if (ff.flag == o.GetExtension(flag)) {
          EXPECT_EQ(ff.field_path, path);
          in_table = true;
        }
      }
      EXPECT_TRUE(in_table) << path;
    }
  }
  EXPECT_EQ(declared, static_cast<int>(OverridableFlags().size()));
  // Every flag of the hand-written table before the generator (72), and --eod_token,
  // --data_path, --split, --peak_tflops and --tensorboard_dir since.
  EXPECT_EQ(declared, 77);
}

// One process-wide parse: flags given on the command line override the file; flags
// not given leave the file's values alone.
TEST(ConfigFlagsTest, CommandLineOverridesFileOnlyWhereGiven) {
  const std::string path = ::testing::TempDir() + "/flags.textproto";
  std::ofstream(path) << "world: 4 ep: 4 steps: 11 model { dim: 40 experts: 8 }\n";
  const std::string config_arg = "--config=" + path;
  std::vector<const char*> argv = {"moe_lm",       config_arg.c_str(),      "--dim=24",
                                   "--grad_acc=3", "--sharding=replicated", "--parity_check",
                                   "--ep=2",       "--norm_topk_prob=false"};
  absl::ParseCommandLine(static_cast<int>(argv.size()), const_cast<char**>(argv.data()));
  absl::StatusOr<TrainConfig> c = ConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  // The file is in the layout before config sections: its top-level fields still count.
  EXPECT_EQ(c->parallelism().world(), 4);  // file
  EXPECT_EQ(c->parallelism().ep(), 2);     // flag, although 2 is also the proto default
  EXPECT_FALSE(c->model().norm_topk_prob());
  EXPECT_EQ(c->model().experts(), 8);  // file
  EXPECT_EQ(c->optim().steps(), 11);   // file
  EXPECT_EQ(c->model().dim(), 24);     // flag beats file
  EXPECT_EQ(c->parallelism().grad_acc(), 3);
  EXPECT_EQ(c->parallelism().sharding(), TrainConfig::replicated);
  EXPECT_TRUE(c->debug().parity_check());

  // A bad combination is caught at start, naming the field.
  std::ofstream(path) << "parallelism { world: 3 }\n";  // --ep=2 does not divide it
  absl::StatusOr<TrainConfig> bad = ConfigFromFlags();
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("parallelism.ep=2: must divide parallelism.world=3"));
  // The value came from --ep: the message starts with the flag the user typed (issue 50).
  EXPECT_THAT(std::string(bad.status().message()),
              ::testing::StartsWith("--ep: parallelism.ep=2: "));
  // A value from the file alone is named by its field only.
  std::ofstream(path) << "parallelism { world: 4 } model { top_k: 9 }\n";
  absl::StatusOr<TrainConfig> from_file = ConfigFromFlags();
  ASSERT_FALSE(from_file.ok());
  EXPECT_THAT(std::string(from_file.status().message()), ::testing::StartsWith("model.top_k=9: "));
}

}  // namespace
}  // namespace gradsum::train
