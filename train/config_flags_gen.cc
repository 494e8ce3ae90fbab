// config_flags_gen: the moe_lm flags, generated from train/config.proto's field options.
//
// Every overridable field of TrainConfig declares its flag once, in config.proto:
//
//   optional int32 world = 1 [default = 2, (flag) = "world", (help) = "ranks ..."];
//
// This tool reads those options from the compiled descriptor and prints either
//
//   config_flags_gen --header     the X-macro list GRADSUM_TRAIN_CONFIG_FLAGS(X), one
//                                 X(type, default, name, "field.path", "help") per flag,
//                                 which train/config_flags.cc expands into the ABSL_FLAG
//                                 definitions and the OverridableFlags table;
//   config_flags_gen --markdown   the flag table of README.md ("Flags"), which
//                                 //train:readme_flags_test compares with the README.
//
// The flags stay ABSL_FLAGs defined at compile time (so --help lists them under
// train/config_flags.cc, absl rejects unknown flags and parses each value as its type) and
// nothing is written twice by hand. A field's flag type follows from its proto type: int32,
// int64 and uint64 as themselves, float and double as double, string and enum as string
// (the enum's value names are the words the flag takes), bool as std::optional<bool>, or,
// with (switch_flag), as a plain bool that sets the field only when given. Value flags are
// std::optional and unset unless given: a config file's value is never overridden by a
// default. A bad option (a flag without help, a switch on a non-bool, a name used twice) is
// an error, and the build fails.

#include <google/protobuf/descriptor.h>
#include <google/protobuf/text_format.h>

#include <cstdlib>
#include <iostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "train/config.pb.h"

namespace gradsum::train {
namespace {

namespace pb = google::protobuf;

struct Flag {
  const pb::FieldDescriptor* field;
  std::string path;  // "parallelism.world"
  std::string name;  // "world"
  std::string help;
  bool is_switch;
};

// Every field of TrainConfig's sections with a (flag) option, sections and fields in
// declaration order. Exits with status 1 on an inconsistent option.
std::vector<Flag> CollectFlags() {
  std::vector<Flag> flags;
  std::set<std::string> names = {"config"};  // --config=FILE is the one flag of no field
  const pb::Descriptor* root = TrainConfig::descriptor();
  for (int s = 0; s < root->field_count(); ++s) {
    const pb::FieldDescriptor* section = root->field(s);
    if (section->message_type() == nullptr) continue;
    const pb::Descriptor* d = section->message_type();
    for (int i = 0; i < d->field_count(); ++i) {
      const pb::FieldDescriptor* f = d->field(i);
      const pb::FieldOptions& o = f->options();
      const std::string path = section->name() + "." + f->name();
      if (!o.HasExtension(flag)) {
        if (o.HasExtension(help) || o.HasExtension(switch_flag)) {
          std::cerr << path << ": (help) or (switch_flag) without (flag)\n";
          std::exit(1);
        }
        continue;
      }
      Flag out{f, path, o.GetExtension(flag), o.GetExtension(help), o.GetExtension(switch_flag)};
      if (out.help.empty()) {
        std::cerr << path << ": (flag) = \"" << out.name << "\" has no (help)\n";
        std::exit(1);
      }
      if (out.is_switch && f->cpp_type() != pb::FieldDescriptor::CPPTYPE_BOOL) {
        std::cerr << path << ": (switch_flag) on a field that is not a bool\n";
        std::exit(1);
      }
      if (f->is_repeated() || f->message_type() != nullptr) {
        std::cerr << path << ": only a singular scalar field can have a (flag)\n";
        std::exit(1);
      }
      if (!names.insert(out.name).second) {
        std::cerr << path << ": flag --" << out.name << " is declared twice\n";
        std::exit(1);
      }
      flags.push_back(std::move(out));
    }
  }
  return flags;
}

// The absl flag type of a field's flag (see the file comment).
std::string FlagType(const Flag& f) {
  if (f.is_switch) return "bool";
  switch (f.field->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32:
      return "std::optional<int32_t>";
    case pb::FieldDescriptor::CPPTYPE_INT64:
      return "std::optional<int64_t>";
    case pb::FieldDescriptor::CPPTYPE_UINT32:
      return "std::optional<uint32_t>";
    case pb::FieldDescriptor::CPPTYPE_UINT64:
      return "std::optional<uint64_t>";
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      return "std::optional<double>";
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      return "std::optional<bool>";
    case pb::FieldDescriptor::CPPTYPE_STRING:
    case pb::FieldDescriptor::CPPTYPE_ENUM:
      return "std::optional<std::string>";
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
  std::cerr << f.path << ": no flag type\n";
  std::exit(1);
}

// `s` as a C++ string literal (UTF-8 bytes kept as they are).
std::string CLiteral(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

void PrintHeader(const std::vector<Flag>& flags) {
  std::cout << "// Generated by //train:config_flags_gen from train/config.proto: do not edit.\n"
               "// One X(type, default, name, \"field.path\", \"help\") per (flag) field.\n"
               "#ifndef GRADSUM_TRAIN_CONFIG_FLAGS_LIST_H_\n"
               "#define GRADSUM_TRAIN_CONFIG_FLAGS_LIST_H_\n\n"
               "#define GRADSUM_TRAIN_CONFIG_FLAGS(X)";
  for (const Flag& f : flags) {
    std::cout << " \\\n  X(" << FlagType(f) << ", " << (f.is_switch ? "false" : "std::nullopt")
              << ", " << f.name << ", " << CLiteral(f.path) << ", " << CLiteral(f.help) << ")";
  }
  std::cout << "\n\n#endif  // GRADSUM_TRAIN_CONFIG_FLAGS_LIST_H_\n";
}

// A Markdown table cell: `|` would end the cell.
std::string Cell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

void PrintMarkdown(const std::vector<Flag>& flags) {
  const TrainConfig defaults;
  std::cout << "| Flag | Config field | Default | Description |\n"
               "| --- | --- | --- | --- |\n";
  for (const Flag& f : flags) {
    const pb::Message& section = defaults.GetReflection()->GetMessage(
        defaults, TrainConfig::descriptor()->FindFieldByName(f.path.substr(0, f.path.find('.'))));
    std::string value;
    pb::TextFormat::PrintFieldValueToString(section, f.field, -1, &value);
    std::cout << "| `--" << f.name << "` | `" << f.path << "` | `" << Cell(value) << "` | "
              << Cell(f.help) << " |\n";
  }
}

}  // namespace
}  // namespace gradsum::train

int main(int argc, char** argv) {
  const std::string mode = argc == 2 ? argv[1] : "";
  if (mode != "--header" && mode != "--markdown") {
    std::cerr << "usage: config_flags_gen --header | --markdown\n";
    return 2;
  }
  const std::vector<gradsum::train::Flag> flags = gradsum::train::CollectFlags();
  if (mode == "--header") {
    gradsum::train::PrintHeader(flags);
  } else {
    gradsum::train::PrintMarkdown(flags);
  }
  return std::cout.good() ? 0 : 1;
}
