#include "train/config.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/message.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/status.h"
#include "data/blend_spec.h"
#include "data/shard.h"
#include "io/atomic_file.h"
#include "io/path_checks.h"

namespace gradsum::train {
namespace {

namespace pb = google::protobuf;

// Collects the parser's first error so that it ends up in the Status, not on stderr.
class CollectingErrors : public pb::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (first_.empty()) first_ = absl::StrCat("line ", line + 1, ":", column + 1, ": ", message);
  }
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

absl::Status Bad(absl::string_view field, const std::string& value, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, "=", value, ": ", why));
}

// "must be thread, mpi or nccl": the value names of an enum field, the only words accepted.
std::string MustBeOneOf(const pb::EnumDescriptor* e) {
  std::string out = "must be ";
  for (int i = 0; i < e->value_count(); ++i) {
    if (i > 0) absl::StrAppend(&out, i + 1 == e->value_count() ? " or " : ", ");
    absl::StrAppend(&out, e->value(i)->name());
  }
  return out;
}

// The value of enum field `f` named `word`, or InvalidArgument "path=word: must be ...".
absl::StatusOr<const pb::EnumValueDescriptor*> EnumValue(const pb::FieldDescriptor* f,
                                                         absl::string_view path,
                                                         const std::string& word) {
  const pb::EnumValueDescriptor* v = f->enum_type()->FindValueByName(word);
  if (v == nullptr) return Bad(path, word, MustBeOneOf(f->enum_type()));
  return v;
}

// Config files written before the choices were enums quote their words
// (`sharding: "replicated"`); the text format reads an enum only as a bare name. This pass
// unquotes the value of every enum field, and names the allowed words for an unknown one.
// It keeps every token's line and column, so the parser's positions stay those of `text`;
// comments are dropped. Text the tokenizer rejects is returned as is, for the parser to
// report.
absl::StatusOr<std::string> UnquoteEnumWords(absl::string_view text) {
  pb::io::ArrayInputStream input(text.data(), static_cast<int>(text.size()));
  CollectingErrors errors;
  pb::io::Tokenizer tokenizer(&input, &errors);
  tokenizer.set_comment_style(pb::io::Tokenizer::SH_COMMENT_STYLE);
  tokenizer.set_require_space_after_number(false);
  std::vector<pb::io::Tokenizer::Token> tokens;
  while (tokenizer.Next()) tokens.push_back(tokenizer.current());
  if (!errors.first().empty()) return std::string(text);
  using Tokenizer = pb::io::Tokenizer;
  using Token = Tokenizer::Token;
  // The message type of each open brace ({ or <); nullptr inside an unknown field.
  std::vector<const pb::Descriptor*> scopes = {TrainConfigFile::descriptor()};
  const pb::Descriptor* next_scope = nullptr;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const Token& t = tokens[i];
    if (t.type == Tokenizer::TYPE_SYMBOL && (t.text == "{" || t.text == "<")) {
      scopes.push_back(next_scope);
      next_scope = nullptr;
      continue;
    }
    if (t.type == Tokenizer::TYPE_SYMBOL && (t.text == "}" || t.text == ">")) {
      if (scopes.size() > 1) scopes.pop_back();
      continue;
    }
    if (t.type != Tokenizer::TYPE_IDENTIFIER || scopes.back() == nullptr) continue;
    const pb::FieldDescriptor* f = scopes.back()->FindFieldByName(t.text);
    if (f == nullptr) continue;
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      next_scope = f->message_type();
      continue;
    }
    if (f->cpp_type() != pb::FieldDescriptor::CPPTYPE_ENUM || i + 2 >= tokens.size() ||
        tokens[i + 1].text != ":") {
      continue;
    }
    Token& value = tokens[i + 2];
    std::string word;
    if (value.type == Tokenizer::TYPE_STRING) {
      pb::io::Tokenizer::ParseString(value.text, &word);
    } else if (value.type == Tokenizer::TYPE_IDENTIFIER) {
      word = value.text;
    } else {
      continue;  // a number or a symbol: the parser's to judge
    }
    absl::StatusOr<const pb::EnumValueDescriptor*> v = EnumValue(f, f->name(), word);
    if (!v.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("config textproto: line ", value.line + 1, ":",
                                                     value.column + 1, ": ", v.status().message()));
    }
    value.text = word;
  }
  std::string out;
  int line = 0, column = 0;
  for (const Token& t : tokens) {
    for (; line < t.line; ++line) out.push_back('\n'), column = 0;
    out.append(std::max(0, t.column - column), ' ');
    out.append(t.text);
    column = t.column + static_cast<int>(t.text.size());
  }
  return out;
}

absl::Status SetFromText(pb::Message* msg, const pb::FieldDescriptor* f, const std::string& path,
                         const std::string& value) {
  const pb::Reflection* r = msg->GetReflection();
  auto not_a = [&](absl::string_view type) {
    return absl::InvalidArgumentError(absl::StrCat(path, "=", value, ": not a valid ", type));
  };
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32: {
      int32_t v;
      if (!absl::SimpleAtoi(value, &v)) return not_a("int32");
      r->SetInt32(msg, f, v);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_INT64: {
      int64_t v;
      if (!absl::SimpleAtoi(value, &v)) return not_a("int64");
      r->SetInt64(msg, f, v);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_UINT64: {
      uint64_t v;
      if (!absl::SimpleAtoi(value, &v)) return not_a("uint64");
      r->SetUInt64(msg, f, v);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_DOUBLE: {
      double v;
      if (!absl::SimpleAtod(value, &v)) return not_a("number");
      r->SetDouble(msg, f, v);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_FLOAT: {
      float v;
      if (!absl::SimpleAtof(value, &v)) return not_a("number");
      r->SetFloat(msg, f, v);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_BOOL: {
      bool v;
      if (!absl::SimpleAtob(value, &v)) return not_a("bool");
      r->SetBool(msg, f, v);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_STRING:
      r->SetString(msg, f, value);
      return absl::OkStatus();
    case pb::FieldDescriptor::CPPTYPE_ENUM: {
      GRADSUM_ASSIGN_OR_RETURN(const pb::EnumValueDescriptor* v, EnumValue(f, path, value));
      r->SetEnum(msg, f, v);
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": a field of this type cannot be overridden"));
  }
}

// The top-level fields of the layout before sections (TrainConfigFile) and where each lives
// now. Every such field of TrainConfigFile is here (ParseConfigText fails otherwise).
constexpr std::pair<const char*, const char*> kLegacyFieldPaths[] = {
    {"world", "parallelism.world"},
    {"ep", "parallelism.ep"},
    {"grad_acc", "parallelism.grad_acc"},
    {"steps", "optim.steps"},
    {"backend", "comm.backend"},
    {"sharding", "parallelism.sharding"},
    {"reduce_dtype", "precision.reduce_dtype"},
    {"compute_dtype", "precision.compute_dtype"},
    {"seed", "model.seed"},
    {"alpha_b", "loss.alpha_b"},
    {"alpha_z", "loss.alpha_z"},
    {"dump_dir", "debug.dump_dir"},
    {"metrics", "log.metrics"},
    {"checkpoint_dir", "checkpoint.dir"},
    {"checkpoint_every", "checkpoint.every"},
    {"resume", "checkpoint.resume"},
    {"parity_check", "debug.parity_check"},
    {"parity_tolerance", "debug.parity_tolerance"},
    {"timeout_s", "comm.timeout_s"},
    {"ce_mode", "loss.ce_mode"},
    {"nccl_skip_agreement", "comm.nccl_skip_agreement"},
    {"layers_per_unit", "parallelism.layers_per_unit"},
    {"reshard_after_forward", "parallelism.reshard_after_forward"},
    {"reduce_every_micro_batch", "parallelism.reduce_every_micro_batch"},
    {"bucket_cap_mb", "comm.bucket_cap_mb"},
    {"first_bucket_mb", "comm.first_bucket_mb"},
    {"export_path", "checkpoint.export_path"},
    {"init_from", "checkpoint.init_from"},
    {"reproducible", "precision.reproducible"},
};

// Copies the value of singular field `from_field` of `from` into `to_field` of `to` (the same
// type).
void CopyField(const pb::Message& from, const pb::FieldDescriptor* from_field, pb::Message* to,
               const pb::FieldDescriptor* to_field) {
  const pb::Reflection* rf = from.GetReflection();
  const pb::Reflection* rt = to->GetReflection();
  switch (from_field->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32:
      return rt->SetInt32(to, to_field, rf->GetInt32(from, from_field));
    case pb::FieldDescriptor::CPPTYPE_INT64:
      return rt->SetInt64(to, to_field, rf->GetInt64(from, from_field));
    case pb::FieldDescriptor::CPPTYPE_UINT32:
      return rt->SetUInt32(to, to_field, rf->GetUInt32(from, from_field));
    case pb::FieldDescriptor::CPPTYPE_UINT64:
      return rt->SetUInt64(to, to_field, rf->GetUInt64(from, from_field));
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      return rt->SetDouble(to, to_field, rf->GetDouble(from, from_field));
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
      return rt->SetFloat(to, to_field, rf->GetFloat(from, from_field));
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      return rt->SetBool(to, to_field, rf->GetBool(from, from_field));
    case pb::FieldDescriptor::CPPTYPE_STRING:
      return rt->SetString(to, to_field, rf->GetString(from, from_field));
    case pb::FieldDescriptor::CPPTYPE_ENUM:
      return rt->SetEnumValue(to, to_field, rf->GetEnumValue(from, from_field));
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      return rt->MutableMessage(to, to_field)->CopyFrom(rf->GetMessage(from, from_field));
  }
}

// The config a parsed file describes: its sections, and each top-level field of the layout
// before sections moved to its section. A field set in both spellings to different values
// is InvalidArgument naming both.
absl::StatusOr<TrainConfig> FromConfigFile(const TrainConfigFile& file) {
  TrainConfig config;
  const pb::Descriptor* file_type = TrainConfigFile::descriptor();
  const pb::Reflection* file_refl = file.GetReflection();
  for (int i = 0; i < TrainConfig::descriptor()->field_count(); ++i) {
    const pb::FieldDescriptor* section = TrainConfig::descriptor()->field(i);
    const pb::FieldDescriptor* from = file_type->FindFieldByName(section->name());
    if (file_refl->HasField(file, from)) CopyField(file, from, &config, section);
  }
  for (int i = 0; i < file_type->field_count(); ++i) {
    const pb::FieldDescriptor* old_field = file_type->field(i);
    if (old_field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE ||
        !file_refl->HasField(file, old_field)) {
      continue;
    }
    const auto* entry = std::find_if(std::begin(kLegacyFieldPaths), std::end(kLegacyFieldPaths),
                                     [&](const auto& e) { return old_field->name() == e.first; });
    if (entry == std::end(kLegacyFieldPaths)) {
      return absl::InternalError(
          absl::StrCat("config field ", old_field->name(), " has no place in the sections"));
    }
    const std::vector<std::string> parts = absl::StrSplit(entry->second, '.');
    const pb::FieldDescriptor* section = TrainConfig::descriptor()->FindFieldByName(parts[0]);
    pb::Message* msg = config.GetReflection()->MutableMessage(&config, section);
    const pb::FieldDescriptor* new_field = msg->GetDescriptor()->FindFieldByName(parts[1]);
    std::string old_value;
    pb::TextFormat::PrintFieldValueToString(file, old_field, -1, &old_value);
    if (msg->GetReflection()->HasField(*msg, new_field)) {
      std::string new_value;
      pb::TextFormat::PrintFieldValueToString(*msg, new_field, -1, &new_value);
      if (new_value != old_value) {
        return absl::InvalidArgumentError(absl::StrCat(
            "config textproto: ", old_field->name(), "=", old_value, " and ", entry->second, "=",
            new_value, " are the same setting (", old_field->name(),
            " is its name before config sections) with different values; keep one"));
      }
      continue;
    }
    CopyField(file, old_field, msg, new_field);
  }
  return config;
}

}  // namespace

absl::StatusOr<TrainConfig> ParseConfigText(absl::string_view text) {
  TrainConfigFile file;
  GRADSUM_ASSIGN_OR_RETURN(const std::string unquoted, UnquoteEnumWords(text));
  pb::TextFormat::Parser parser;
  CollectingErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(unquoted, &file)) {
    return absl::InvalidArgumentError(absl::StrCat("config textproto: ", errors.first()));
  }
  return FromConfigFile(file);
}

absl::StatusOr<TrainConfig> LoadConfigFile(const std::string& path) {
  // Checked before the open, which a FIFO would block (ReadFileToString opens
  // non-blockingly too, should the path change in between).
  GRADSUM_RETURN_IF_ERROR(CheckInputFile("--config", path));
  absl::StatusOr<std::string> text = ReadFileToString(path, uint64_t{1} << 20);
  if (!text.ok()) return Annotate(text.status(), absl::StrCat("--config=", path));
  absl::StatusOr<TrainConfig> config = ParseConfigText(*text);
  if (!config.ok()) return Annotate(config.status(), absl::StrCat("--config=", path));
  return config;
}

absl::Status ApplyOverrides(const std::vector<FieldOverride>& overrides, TrainConfig* config) {
  for (const FieldOverride& o : overrides) {
    pb::Message* msg = config;
    std::vector<std::string> parts = absl::StrSplit(o.path, '.');
    for (size_t i = 0; i < parts.size(); ++i) {
      const pb::FieldDescriptor* f = msg->GetDescriptor()->FindFieldByName(parts[i]);
      if (f == nullptr || f->is_repeated()) {
        return absl::InvalidArgumentError(
            absl::StrCat("override '", o.path, "': no such config field"));
      }
      const bool last = i + 1 == parts.size();
      if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
        if (last) {
          return absl::InvalidArgumentError(
              absl::StrCat("override '", o.path, "': names a message, not a value"));
        }
        msg = msg->GetReflection()->MutableMessage(msg, f);
        continue;
      }
      if (!last) {
        return absl::InvalidArgumentError(
            absl::StrCat("override '", o.path, "': no such config field"));
      }
      GRADSUM_RETURN_IF_ERROR(SetFromText(msg, f, o.path, o.value));
    }
  }
  return absl::OkStatus();
}

namespace {

using absl::StrCat;

absl::Status Positive(absl::string_view name, int64_t v) {
  if (v > 0) return absl::OkStatus();
  return Bad(name, StrCat(v), "must be positive");
}

// fp32's largest finite value. A double field that the model turns into fp32 (a cast, or a
// factor of fp32 values) must not exceed it: above it the value becomes inf, and the run
// fails steps later with a NaN or an infinite bias that names neither the flag nor the step.
constexpr double kFp32Max = std::numeric_limits<float>::max();
constexpr double kMaxLogitSoftcap = 1e30;  // loss.logit_softcap: see ValidateLoss

// `v` (already known finite) within fp32's range, or InvalidArgument naming the field and
// `use`, the fp32 computation that could not hold it.
absl::Status WithinFp32(absl::string_view name, double v, absl::string_view use) {
  if (std::abs(v) <= kFp32Max) return absl::OkStatus();
  return Bad(name, StrCat(v),
             StrCat("must be at most ", kFp32Max, ", fp32's largest value: ", use));
}

// A field that the chosen configuration never reads, given a value other than its default:
// refused by name, since a value given for nothing is a mistake the run would otherwise hide
// (issue 50). A default value is accepted: every resolved config (a checkpoint's, a logged
// one) holds every field, used or not.
absl::Status Unused(absl::string_view name, const std::string& value, bool is_default,
                    absl::string_view why) {
  if (is_default) return absl::OkStatus();
  return Bad(name, value, StrCat("is not used ", why, "; leave it unset"));
}

// Each section's checks of its own fields; the checks that relate fields of different
// sections are ValidateAcrossSections'. Every division below is by a value checked positive
// before it.

absl::Status ValidateModel(const ModelConfig& m) {
  GRADSUM_RETURN_IF_ERROR(Positive("model.vocab", m.vocab()));
  GRADSUM_RETURN_IF_ERROR(Positive("model.dim", m.dim()));
  GRADSUM_RETURN_IF_ERROR(Positive("model.layers", m.layers()));
  GRADSUM_RETURN_IF_ERROR(Positive("model.experts", m.experts()));
  GRADSUM_RETURN_IF_ERROR(Positive("model.top_k", m.top_k()));
  GRADSUM_RETURN_IF_ERROR(Positive("model.expert_dim", m.expert_dim()));
  if (m.top_k() > m.experts()) {
    return Bad("model.top_k", StrCat(m.top_k()),
               StrCat("cannot exceed model.experts=", m.experts()));
  }
  if (m.attention() != ModelConfig::none) {
    GRADSUM_RETURN_IF_ERROR(Positive("model.heads", m.heads()));
    GRADSUM_RETURN_IF_ERROR(Positive("model.kv_heads", m.kv_heads()));
    if (m.heads() % m.kv_heads() != 0) {
      return Bad("model.kv_heads", StrCat(m.kv_heads()),
                 StrCat("must divide model.heads=", m.heads(), " (GQA)"));
    }
    if (m.dim() % m.heads() != 0 || (m.dim() / m.heads()) % 2 != 0) {
      return Bad(
          "model.heads", StrCat(m.heads()),
          StrCat("must divide model.dim=", m.dim(), " into an even head_dim (RoPE rotates pairs)"));
    }
    // RoPE's frequencies theta^(-2i / head_dim) and angles are computed in double
    // (model/layers.cc RopeTable) and only their cos / sin, in [-1, 1], stored as fp32: any
    // finite theta > 1 is held.
    if (!(std::isfinite(m.rope_theta()) && m.rope_theta() > 1)) {
      return Bad("model.rope_theta", StrCat(m.rope_theta()), "must be finite and > 1");
    }
  } else {
    // No attention block: its shape and RoPE base would be ignored without a word.
    const ModelConfig& d = ModelConfig::default_instance();
    constexpr absl::string_view kNoAttention =
        "with model.attention=none (the model has no attention block)";
    GRADSUM_RETURN_IF_ERROR(
        Unused("model.heads", StrCat(m.heads()), m.heads() == d.heads(), kNoAttention));
    GRADSUM_RETURN_IF_ERROR(
        Unused("model.kv_heads", StrCat(m.kv_heads()), m.kv_heads() == d.kv_heads(), kNoAttention));
    GRADSUM_RETURN_IF_ERROR(Unused("model.rope_theta", StrCat(m.rope_theta()),
                                   m.rope_theta() == d.rope_theta(), kNoAttention));
  }
  // router_scale and init_std are fp32 fields: finite is all their fp32 use needs.
  if (!(std::isfinite(m.router_scale()) && m.router_scale() > 0)) {
    return Bad("model.router_scale", StrCat(m.router_scale()), "must be finite and positive");
  }
  if (!(std::isfinite(m.init_std()) && m.init_std() > 0)) {
    return Bad("model.init_std", StrCat(m.init_std()), "must be finite and positive");
  }
  if (m.mtp_depth() < 0) {
    return Bad("model.mtp_depth", StrCat(m.mtp_depth()), "must be >= 0 (0 = off)");
  }
  return absl::OkStatus();
}

absl::Status ValidateData(const DataConfig& d) {
  GRADSUM_RETURN_IF_ERROR(Positive("data.micro_batch", d.micro_batch()));
  if (d.seq_len() < 2) return Bad("data.seq_len", StrCat(d.seq_len()), "must be >= 2");
  if (d.min_doc_len() < 2) {
    return Bad("data.min_doc_len", StrCat(d.min_doc_len()), "must be >= 2");
  }
  if (d.max_doc_len() < d.min_doc_len()) {
    return Bad("data.max_doc_len", StrCat(d.max_doc_len()),
               StrCat("must be >= data.min_doc_len=", d.min_doc_len()));
  }
  if (d.max_doc_len() > d.seq_len()) {
    return Bad("data.max_doc_len", StrCat(d.max_doc_len()),
               StrCat("must fit a sequence (data.seq_len=", d.seq_len(), ")"));
  }
  if (d.eod_token() < -1) {
    return Bad("data.eod_token", StrCat(d.eod_token()), "must be a token id, or -1 for none");
  }
  if (!d.data_path().empty()) {
    if (!d.path().empty()) {
      return Bad("data.data_path", d.data_path(),
                 StrCat("and data.path=", d.path(), " both name the data; give one of them"));
    }
    GRADSUM_RETURN_IF_ERROR(data::ParseDataPath(d.data_path()).status());
  }
  if (d.split() != DataConfig::default_instance().split()) {
    GRADSUM_RETURN_IF_ERROR(Unused("data.split", d.split(), !d.data_path().empty(),
                                   "without data.data_path (--data_path)"));
    GRADSUM_RETURN_IF_ERROR(data::ParseSplit(d.split()).status());
  }
  return Positive("data.corpus_documents", d.corpus_documents());
}

absl::Status ValidateLoss(const LossConfig& l) {
  if (!(std::isfinite(l.alpha_b()) && l.alpha_b() >= 0)) {
    return Bad("loss.alpha_b", StrCat(l.alpha_b()), "must be >= 0");
  }
  if (!(std::isfinite(l.alpha_z()) && l.alpha_z() >= 0)) {
    return Bad("loss.alpha_z", StrCat(l.alpha_z()), "must be >= 0");
  }
  // The router's loss gradients are fp32 values times these weights (the CUDA router
  // casts them to fp32).
  GRADSUM_RETURN_IF_ERROR(WithinFp32("loss.alpha_b", l.alpha_b(),
                                     "the balancing loss's gradient is fp32 scaled by it"));
  GRADSUM_RETURN_IF_ERROR(
      WithinFp32("loss.alpha_z", l.alpha_z(), "the z-loss's gradient is fp32 scaled by it"));
  if (!(l.label_smoothing() >= 0 && l.label_smoothing() < 1)) {
    return Bad("loss.label_smoothing", StrCat(l.label_smoothing()), "must be in [0, 1)");
  }
  if (!(std::isfinite(l.logit_softcap()) && l.logit_softcap() >= 0)) {
    return Bad("loss.logit_softcap", StrCat(l.logit_softcap()), "must be >= 0 (0 disables)");
  }
  // The cap is applied in fp32, z -> c tanh(z / c) (losses/cross_entropy.cc): above fp32's
  // range c is inf and every capped logit inf * tanh(0) = NaN; and z / c must stay a normal
  // fp32 (>= 1.2e-38) for logits as small as 1e-8, or the capped logits lose their precision
  // in subnormals: c <= 1e30. A cap that large never binds (logits are far below it).
  if (l.logit_softcap() > kMaxLogitSoftcap) {
    return Bad("loss.logit_softcap", StrCat(l.logit_softcap()),
               StrCat("must be at most ", kMaxLogitSoftcap,
                      ": the cap is computed in fp32 as c tanh(z / c), and z / c must stay a "
                      "normal fp32 (0 disables the cap)"));
  }
  if (!(std::isfinite(l.alpha_lse()) && l.alpha_lse() >= 0)) {
    return Bad("loss.alpha_lse", StrCat(l.alpha_lse()), "must be >= 0 (0 disables)");
  }
  GRADSUM_RETURN_IF_ERROR(WithinFp32("loss.alpha_lse", l.alpha_lse(),
                                     "the output z-loss's gradient is fp32 scaled by it"));
  if (!(std::isfinite(l.expert_bias_speed()) && l.expert_bias_speed() >= 0)) {
    return Bad("loss.expert_bias_speed", StrCat(l.expert_bias_speed()),
               "must be >= 0 and finite (0 = off; SEMANTICS.md §5.1)");
  }
  // u is rounded to fp32 once (model/moe_lm.cc UpdateExpertBias): a positive u below fp32's
  // smallest normal value would round to 0 or a subnormal, and the bias, though held, would
  // never move as asked. (Its upper bound depends on optim.steps: ValidateAcrossSections.)
  if (l.expert_bias_speed() > 0 && l.expert_bias_speed() < std::numeric_limits<float>::min()) {
    return Bad("loss.expert_bias_speed", StrCat(l.expert_bias_speed()),
               StrCat("must be 0 (off) or at least ", std::numeric_limits<float>::min(),
                      ", fp32's smallest normal value: the bias is updated in fp32"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptim(const OptimConfig& o) {
  if (o.steps() < 0) return Bad("optim.steps", StrCat(o.steps()), "must be >= 0");
  if (!(std::isfinite(o.lr()) && o.lr() > 0)) return Bad("optim.lr", StrCat(o.lr()), "must be > 0");
  // AdamW's update, lr times a step of magnitude about 1 (and lr weight_decay times the
  // parameter), is added to fp32 parameters: beyond fp32's range they would be inf after
  // step 1. (beta1, beta2 lie in [0, 1); eps is added to sqrt(v) of fp32 gradients.)
  GRADSUM_RETURN_IF_ERROR(
      WithinFp32("optim.lr", o.lr(), "AdamW adds lr-sized updates to fp32 parameters"));
  if (!(o.beta1() >= 0 && o.beta1() < 1)) {
    return Bad("optim.beta1", StrCat(o.beta1()), "must be in [0, 1)");
  }
  if (!(o.beta2() >= 0 && o.beta2() < 1)) {
    return Bad("optim.beta2", StrCat(o.beta2()), "must be in [0, 1)");
  }
  if (!(std::isfinite(o.eps()) && o.eps() > 0)) {
    return Bad("optim.eps", StrCat(o.eps()), "must be > 0");
  }
  GRADSUM_RETURN_IF_ERROR(
      WithinFp32("optim.eps", o.eps(), "AdamW divides fp32 moments by sqrt(v) + eps"));
  if (!(std::isfinite(o.weight_decay()) && o.weight_decay() >= 0)) {
    return Bad("optim.weight_decay", StrCat(o.weight_decay()), "must be >= 0");
  }
  // Decoupled decay multiplies every decayed fp32 parameter by 1 - lr weight_decay each step
  // (optim/adamw.cc, at the scheduled lr, up to lr): above 2 that factor's magnitude
  // exceeds 1, and the parameters grow geometrically until fp32 overflows.
  if (!(o.lr() * o.weight_decay() <= 2)) {
    return Bad("optim.weight_decay", StrCat(o.weight_decay()),
               StrCat("times optim.lr=", o.lr(),
                      " must be at most 2: AdamW multiplies the fp32 parameters by 1 - lr "
                      "weight_decay every step, and beyond 2 they grow until they overflow"));
  }
  // grad_clip is compared with the global norm and divided into it in double (a clip
  // factor <= 1 is what reaches fp32): any finite value is held.
  if (!(std::isfinite(o.grad_clip()) && o.grad_clip() >= 0)) {
    return Bad("optim.grad_clip", StrCat(o.grad_clip()), "must be >= 0 (0 disables)");
  }
  if (o.warmup_steps() < 0) {
    return Bad("optim.warmup_steps", StrCat(o.warmup_steps()), "must be >= 0");
  }
  if (o.lr_decay() == OptimConfig::constant) {
    // The constant schedule has no decay to end anywhere.
    const OptimConfig& d = OptimConfig::default_instance();
    constexpr absl::string_view kConstant = "with optim.lr_decay=constant (no decay)";
    GRADSUM_RETURN_IF_ERROR(
        Unused("optim.min_lr", StrCat(o.min_lr()), o.min_lr() == d.min_lr(), kConstant));
    GRADSUM_RETURN_IF_ERROR(Unused("optim.decay_steps", StrCat(o.decay_steps()),
                                   o.decay_steps() == d.decay_steps(), kConstant));
  }
  // The schedule's ends (optim/lr_schedule.h): min_lr in [0, lr], and a decay that ends
  // after the warmup.
  if (!(std::isfinite(o.min_lr()) && o.min_lr() >= 0 && o.min_lr() <= o.lr())) {
    return Bad("optim.min_lr", StrCat(o.min_lr()), StrCat("must be in [0, optim.lr=", o.lr(), "]"));
  }
  if (o.decay_steps() < 0) {
    return Bad("optim.decay_steps", StrCat(o.decay_steps()), "must be >= 0 (0: optim.steps)");
  }
  const int64_t decay_end = ToLrSchedule(o).decay_end;
  if (o.lr_decay() != OptimConfig::constant && decay_end <= o.warmup_steps()) {
    return Bad("optim.lr_decay", OptimConfig::LrDecay_Name(o.lr_decay()),
               StrCat("its end (optim.", o.decay_steps() > 0 ? "decay_steps=" : "steps=", decay_end,
                      ") must be after optim.warmup_steps=", o.warmup_steps()));
  }
  return absl::OkStatus();
}

// precision.repro_block depends on the sequence's split: ValidateAcrossSections.
absl::Status ValidatePrecision(const PrecisionConfig& precision) {
  if (precision.reproducible() && precision.reduce_dtype() != TrainConfig::f32) {
    return Bad("precision.reproducible", "true",
               "reduces gradients exactly in integers; it needs precision.reduce_dtype=f32 (got "
               "bf16)");
  }
  return absl::OkStatus();
}

absl::Status ValidateParallelism(const ParallelismConfig& p) {
  GRADSUM_RETURN_IF_ERROR(Positive("parallelism.world", p.world()));
  GRADSUM_RETURN_IF_ERROR(Positive("parallelism.ep", p.ep()));
  GRADSUM_RETURN_IF_ERROR(Positive("parallelism.grad_acc", p.grad_acc()));
  // The EP size's one check before any rank starts; the mesh built from it
  // (train/rank_main.h MakeRankMesh) is then the source of every group size.
  if (p.world() % p.ep() != 0) {
    return Bad("parallelism.ep", StrCat(p.ep()),
               StrCat("must divide parallelism.world=", p.world()));
  }
  // Sequence parallelism (§12): S consecutive ranks share each sequence.
  GRADSUM_RETURN_IF_ERROR(Positive("parallelism.sp", p.sp()));
  if (p.world() % p.sp() != 0) {
    return Bad("parallelism.sp", StrCat(p.sp()),
               StrCat("must divide parallelism.world=", p.world()));
  }
  // HSDP (§7): shard groups of N consecutive ranks, each holding whole EP groups. SP needs
  // nothing of it: parameters are not split over the SP group.
  if (p.sharding() != TrainConfig::hsdp && p.shard_group() != 0) {
    return Bad("parallelism.shard_group", StrCat(p.shard_group()),
               StrCat("is for sharding=hsdp only (sharding=",
                      TrainConfig::Sharding_Name(p.sharding()), ")"));
  }
  if (p.shard_group() < 0) {
    return Bad("parallelism.shard_group", StrCat(p.shard_group()),
               "must be >= 0 (0: the ranks of one host)");
  }
  if (p.shard_group() > 0 && p.world() % p.shard_group() != 0) {
    return Bad("parallelism.shard_group", StrCat(p.shard_group()),
               StrCat("must divide parallelism.world=", p.world()));
  }
  if (p.shard_group() > 0 && p.shard_group() % p.ep() != 0) {
    return Bad("parallelism.shard_group", StrCat(p.shard_group()),
               StrCat("must be a multiple of parallelism.ep=", p.ep(),
                      " (each EP group inside one shard group; SEMANTICS.md §7)"));
  }
  // Context parallelism (§16): C groups of S share each sequence, in 2C zigzag chunks.
  GRADSUM_RETURN_IF_ERROR(Positive("parallelism.cp", p.cp()));
  if (p.world() % (int64_t{p.sp()} * p.cp()) != 0) {
    return Bad(
        "parallelism.cp", StrCat(p.cp()),
        StrCat("times parallelism.sp=", p.sp(), " must divide parallelism.world=", p.world()));
  }
  if (p.layers_per_unit() < 1) {
    return Bad("parallelism.layers_per_unit", StrCat(p.layers_per_unit()), "must be >= 1");
  }
  return absl::OkStatus();
}

// comm.timeout_s becomes an absl::Duration (infinite beyond its range, which is what so
// long a timeout means); the bucket caps are checked against their own bound.
absl::Status ValidateComm(const CommConfig& comm) {
  if (!(std::isfinite(comm.timeout_s()) && comm.timeout_s() > 0)) {
    return Bad("comm.timeout_s", StrCat(comm.timeout_s()), "must be > 0");
  }
  for (const auto& [name, mb] :
       {std::pair<const char*, double>{"comm.bucket_cap_mb", comm.bucket_cap_mb()},
        {"comm.first_bucket_mb", comm.first_bucket_mb()}}) {
    if (!(std::isfinite(mb) && mb > 0 && mb <= 1 << 20)) {
      return Bad(name, StrCat(mb), "must be in (0, 1048576] MiB");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateCheckpoint(const CheckpointConfig& k) {
  if (k.every() < 0) return Bad("checkpoint.every", StrCat(k.every()), "must be >= 0");
  if (k.keep() < 0) return Bad("checkpoint.keep", StrCat(k.keep()), "must be >= 0 (0: all)");
  if (k.resume() && k.dir().empty()) {
    return Bad("checkpoint.resume", "true", "needs checkpoint.dir");
  }
  if (k.resume() && !k.init_from().empty()) {
    return Bad("checkpoint.init_from", k.init_from(),
               "cannot be combined with checkpoint.resume (the checkpoint holds the parameters)");
  }
  if (k.overwrite() && k.resume()) {
    return Bad("checkpoint.overwrite", "true",
               "cannot be combined with checkpoint.resume (resume continues the run in "
               "checkpoint.dir, overwrite replaces it)");
  }
  if (k.overwrite() && k.dir().empty()) {
    return Bad("checkpoint.overwrite", "true", "needs checkpoint.dir");
  }
  if (k.save_on_signal() && k.dir().empty()) {
    return Bad("checkpoint.save_on_signal", "true", "needs checkpoint.dir");
  }
  if (k.keep() > 0 && k.dir().empty()) {
    return Bad("checkpoint.keep", StrCat(k.keep()), "needs checkpoint.dir");
  }
  if (k.every() > 0 && k.dir().empty()) {
    return Bad("checkpoint.every", StrCat(k.every()), "needs checkpoint.dir");
  }
  return absl::OkStatus();
}

absl::Status ValidateLog(const LogConfig& log) {
  if (log.every() < 1) return Bad("log.every", StrCat(log.every()), "must be >= 1");
  if (log.eval_every() < 0) {
    return Bad("log.eval_every", StrCat(log.eval_every()), "must be >= 0 (0: none)");
  }
  if (log.eval_micro_batches() < 1) {
    return Bad("log.eval_micro_batches", StrCat(log.eval_micro_batches()), "must be >= 1");
  }
  if (!(std::isfinite(log.peak_tflops()) && log.peak_tflops() >= 0)) {
    return Bad("log.peak_tflops", StrCat(log.peak_tflops()),
               "must be finite and >= 0 (0: measured at start-up)");
  }
  return absl::OkStatus();
}

// parity_tolerance is compared with fp64 differences: any finite positive value is held.
absl::Status ValidateDebug(const DebugConfig& debug) {
  if (!(std::isfinite(debug.parity_tolerance()) && debug.parity_tolerance() > 0)) {
    return Bad("debug.parity_tolerance", StrCat(debug.parity_tolerance()), "must be > 0");
  }
  return absl::OkStatus();
}

// The checks that relate fields of different sections, once every section is valid on its
// own (so every size is positive here).
// How the mesh splits the model and each sequence: the vocabulary the corpus needs, the
// experts over EP, a sequence over SP and CP.
absl::Status ValidateSequenceSplit(const TrainConfig& c) {
  const ModelConfig& m = c.model();
  const DataConfig& d = c.data();
  const ParallelismConfig& p = c.parallelism();
  // The embedded corpora are byte-level; a data.path file is checked against the vocabulary
  // when it is read (data/corpus.h CheckCorpusVocab: 256 for byte text, above the largest
  // token id for a token file).
  if (!ReadsDataFiles(d) && m.vocab() != 256) {
    return Bad("model.vocab", StrCat(m.vocab()),
               "the embedded corpora are byte-level, so vocab must be 256 (a token file given "
               "to data.path may take another)");
  }
  if (m.experts() % p.ep() != 0) {
    return Bad("parallelism.ep", StrCat(p.ep()),
               StrCat("must divide model.experts=", m.experts(), " (SEMANTICS.md §7)"));
  }
  // How a sequence is split: seq_len / (sp cp) tokens per rank, in 2 cp zigzag chunks.
  if (d.seq_len() % p.sp() != 0) {
    return Bad("parallelism.sp", StrCat(p.sp()),
               StrCat("must divide data.seq_len=", d.seq_len(),
                      " (each rank holds seq_len / sp tokens of every sequence)"));
  }
  // Only with CP: without it a sequence is not cut into chunks, and any seq_len the SP
  // group divides is fine (odd ones included).
  if (p.cp() > 1 &&
      (d.seq_len() % (2 * int64_t{p.cp()}) != 0 || (d.seq_len() / p.cp()) % p.sp() != 0)) {
    return Bad("parallelism.cp", StrCat(p.cp()),
               StrCat("needs data.seq_len=", d.seq_len(),
                      " to be a multiple of 2 cp (each of cp ranks holds two of 2 cp chunks) "
                      "and seq_len / cp a multiple of parallelism.sp=",
                      p.sp()));
  }
  if (m.attention() != ModelConfig::none && m.heads() % p.sp() != 0) {
    return Bad("parallelism.sp", StrCat(p.sp()),
               StrCat("must divide model.heads=", m.heads(),
                      " (Ulysses gives each rank of the SP group whole heads)"));
  }
  return absl::OkStatus();
}

// precision.repro_block: a divisor of a rank's share, and in reproducible mode a block that
// tiles every contiguous piece a rank holds (ReproBlock, data::ContiguousPiece).
absl::Status ValidateReproBlock(const TrainConfig& c) {
  const DataConfig& d = c.data();
  const ParallelismConfig& p = c.parallelism();
  const int64_t held = d.seq_len() / (int64_t{p.sp()} * p.cp());
  const int32_t repro_block = c.precision().repro_block();
  if (repro_block < 0 || (repro_block > 0 && held % repro_block != 0)) {
    return Bad("precision.repro_block", StrCat(repro_block),
               StrCat("must be 0 or divide the ", held,
                      " tokens a rank holds of each sequence (data.seq_len / (parallelism.sp "
                      "parallelism.cp))"));
  }
  if (c.precision().reproducible()) {
    // Every contribution is computed per row block; the same blocks at every mesh need a
    // block that tiles each contiguous piece a rank holds (ReproBlock).
    const int64_t block = ReproBlock(c);
    const int64_t piece = data::ContiguousPiece(d.seq_len(), p.sp(), p.cp());
    if (piece % block != 0) {
      // The piece itself tiles every piece of this mesh (it divides seq_len).
      return Bad("precision.repro_block", StrCat(block),
                 StrCat(repro_block == 0 ? "(the default, the largest divisor of data.seq_len="
                                         : "(data.seq_len=",
                        d.seq_len(), repro_block == 0 ? " up to seq_len / 4) " : ") ",
                        "must divide the ", piece,
                        " tokens of each contiguous piece of a "
                        "sequence a rank holds at parallelism.sp=",
                        p.sp(), " parallelism.cp=", p.cp(),
                        ", for --reproducible's blocks to be the same at every mesh: "
                        "pass --repro_block=",
                        piece,
                        " (or a divisor of it) to every run to "
                        "be compared"));
    }
  }
  return absl::OkStatus();
}

// Multi-token prediction (§15) and the router's scores and bias (§5.1).
absl::Status ValidateMtpAndRouting(const TrainConfig& c) {
  const ModelConfig& m = c.model();
  const DataConfig& d = c.data();
  const LossConfig& l = c.loss();
  if (m.mtp_depth() >= d.seq_len() && d.seq_len() > 0) {
    // Depth j's label of position t is the token j + 1 ahead in the same sequence (§15):
    // from depth seq_len on no position has one, so the depth would train nothing.
    return Bad("model.mtp_depth", StrCat(m.mtp_depth()),
               StrCat("must be < data.seq_len=", d.seq_len(),
                      ": a deeper MTP depth has no label in any sequence (SEMANTICS.md §15)"));
  }
  if (m.mtp_depth() > 0 && !ReadsDataFiles(d) && m.mtp_depth() > d.max_doc_len() - 2) {
    // Depth j's label of position t is token t + j + 1 of the same document (§15.1,
    // data/streams.h): a document of n tokens gives depth j a label only if j <= n - 2, so
    // with the embedded corpus's documents of at most max_doc_len tokens the deeper depths
    // would train nothing (loss 0). A --data file's longest document is known once it is
    // read: ValidateLongestDocument checks it.
    return Bad("model.mtp_depth", StrCat(m.mtp_depth()),
               StrCat("must be at most data.max_doc_len - 2 = ", d.max_doc_len() - 2,
                      ": depth j's label is the token j + 1 ahead in the same document, so with "
                      "documents of at most ",
                      d.max_doc_len(),
                      " tokens the deeper depths would train nothing (SEMANTICS.md §15.1)"));
  }
  GRADSUM_RETURN_IF_ERROR(
      Unused("loss.mtp_scale", StrCat(l.mtp_scale()),
             m.mtp_depth() > 0 || l.mtp_scale() == LossConfig::default_instance().mtp_scale(),
             "with model.mtp_depth=0 (no MTP depth to weigh)"));
  if (m.mtp_depth() > 0 && !(l.mtp_scale() > 0 && l.mtp_scale() <= m.mtp_depth())) {
    return Bad("loss.mtp_scale", StrCat(l.mtp_scale()),
               StrCat("must be in (0, model.mtp_depth=", m.mtp_depth(), "] (SEMANTICS.md §15)"));
  }
  if (m.mtp_depth() > 0 && l.expert_bias_speed() != 0) {
    return Bad("model.mtp_depth", StrCat(m.mtp_depth()),
               StrCat("cannot be combined with loss.expert_bias_speed=", l.expert_bias_speed(),
                      ": the expert bias is not defined for MTP layers (SEMANTICS.md §15.1)"));
  }
  // The bias moves by u each step (§5.1): after optim.steps steps |b| <= u steps, which must
  // stay a finite fp32 with room for the score in [0, 1] added to it in the selection.
  if (l.expert_bias_speed() * std::max(1, c.optim().steps()) > kFp32Max / 2) {
    return Bad("loss.expert_bias_speed", StrCat(l.expert_bias_speed()),
               StrCat("times optim.steps=", c.optim().steps(), " must be at most ", kFp32Max / 2,
                      ": the fp32 expert bias moves by it every step (SEMANTICS.md §5.1)"));
  }
  if (m.router_score() == ModelConfig::sigmoid && l.alpha_b() != 0) {
    return Bad("model.router_score", "sigmoid",
               StrCat("needs loss.alpha_b=0 (got ", l.alpha_b(),
                      "): the balancing loss of SEMANTICS.md §5 is defined on softmax "
                      "probabilities; balance sigmoid routing with loss.expert_bias_speed"));
  }
  return absl::OkStatus();
}

// The held-out evaluation's fields: used only when an evaluation runs on what they name.
absl::Status ValidateEvaluation(const TrainConfig& c) {
  const DataConfig& d = c.data();
  GRADSUM_RETURN_IF_ERROR(
      Unused("log.eval_micro_batches", StrCat(c.log().eval_micro_batches()),
             c.log().eval_every() > 0 ||
                 c.log().eval_micro_batches() == LogConfig::default_instance().eval_micro_batches(),
             "with log.eval_every=0 (no evaluation)"));
  // data.eval_path is read only by the evaluation of a --data run: given otherwise it would
  // be ignored, and a missing file never noticed.
  if (!d.eval_path().empty() && !d.data_path().empty()) {
    return Bad("data.eval_path", d.eval_path(),
               "is not read with data.data_path (--data_path): the validation part of "
               "data.split (--split) is the held-out set; leave --eval_data unset");
  }
  if (!d.eval_path().empty() && d.path().empty()) {
    return Bad("data.eval_path", d.eval_path(),
               "is read only with data.path (--data): the embedded corpus holds out its own "
               "documents; leave --eval_data unset");
  }
  if (c.log().eval_every() > 0 && !d.data_path().empty()) {
    absl::StatusOr<std::array<double, 3>> split = data::ParseSplit(d.split());
    if (split.ok() && (*split)[1] == 0) {
      return Bad("log.eval_every", StrCat(c.log().eval_every()),
                 StrCat("evaluates the validation part of data.split=", d.split(),
                        ", which is empty; give it a part (e.g. --split=969,30,1)"));
    }
  }
  if (!d.eval_path().empty() && c.log().eval_every() == 0) {
    return Bad("data.eval_path", d.eval_path(),
               "is read only with log.eval_every > 0 (--eval_every): no evaluation runs; set "
               "--eval_every or leave --eval_data unset");
  }
  if (c.log().eval_every() > 0 && !d.path().empty() && d.eval_path().empty()) {
    return Bad("log.eval_every", StrCat(c.log().eval_every()),
               StrCat("with data.path=", d.path(),
                      " needs data.eval_path (--eval_data): a file of held-out documents"));
  }
  return absl::OkStatus();
}

// What the CPU backends implement only.
absl::Status ValidateBackendLimits(const TrainConfig& c) {
  const ParallelismConfig& p = c.parallelism();
  if (p.cp() > 1 && c.comm().backend() == TrainConfig::nccl) {
    return Bad("parallelism.cp", StrCat(p.cp()),
               "is implemented for the CPU backends (thread, mpi) only, not comm.backend=nccl "
               "(the GPU has no ring attention kernel yet)");
  }
  if (c.precision().reproducible() && c.comm().backend() == TrainConfig::nccl) {
    return Bad("precision.reproducible", "true",
               "is implemented for the CPU backends (thread, mpi) only, not comm.backend=nccl");
  }
  return absl::OkStatus();
}

absl::Status ValidateAcrossSections(const TrainConfig& c) {
  GRADSUM_RETURN_IF_ERROR(ValidateSequenceSplit(c));
  GRADSUM_RETURN_IF_ERROR(ValidateReproBlock(c));
  GRADSUM_RETURN_IF_ERROR(ValidateMtpAndRouting(c));
  GRADSUM_RETURN_IF_ERROR(ValidateEvaluation(c));
  return ValidateBackendLimits(c);
}

}  // namespace

absl::Status ValidateConfig(const TrainConfig& c) {
  GRADSUM_RETURN_IF_ERROR(ValidateModel(c.model()));
  GRADSUM_RETURN_IF_ERROR(ValidateData(c.data()));
  GRADSUM_RETURN_IF_ERROR(ValidateLoss(c.loss()));
  GRADSUM_RETURN_IF_ERROR(ValidateOptim(c.optim()));
  GRADSUM_RETURN_IF_ERROR(ValidatePrecision(c.precision()));
  GRADSUM_RETURN_IF_ERROR(ValidateParallelism(c.parallelism()));
  GRADSUM_RETURN_IF_ERROR(ValidateComm(c.comm()));
  GRADSUM_RETURN_IF_ERROR(ValidateCheckpoint(c.checkpoint()));
  GRADSUM_RETURN_IF_ERROR(ValidateLog(c.log()));
  GRADSUM_RETURN_IF_ERROR(ValidateDebug(c.debug()));
  return ValidateAcrossSections(c);
}

// MTP depth j needs documents of at least j + 2 tokens (§15.1): the embedded corpus's bound
// is ValidateMtpAndRouting's; a --data file's longest document is known only once it is read.
absl::Status ValidateLongestDocument(const TrainConfig& config, int64_t longest,
                                     absl::string_view source) {
  const int k = config.model().mtp_depth();
  if (k > 0 && ReadsDataFiles(config.data()) && k > longest - 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.mtp_depth=", k, ": must be at most ", longest - 2, ", the longest document of ",
        source, " (", longest,
        " tokens) less 2: depth j's label is the token j + 1 ahead in the same document, so the "
        "deeper depths would train nothing (SEMANTICS.md §15.1)"));
  }
  return absl::OkStatus();
}

namespace {
// proto2 prints only fields that were set; the logged config shows every value used.
void SetDefaultsExplicitly(pb::Message* msg) {
  const pb::Descriptor* d = msg->GetDescriptor();
  const pb::Reflection* r = msg->GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) continue;
    switch (f->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        SetDefaultsExplicitly(r->MutableMessage(msg, f));
        break;
      case pb::FieldDescriptor::CPPTYPE_INT32:
        r->SetInt32(msg, f, r->GetInt32(*msg, f));
        break;
      case pb::FieldDescriptor::CPPTYPE_INT64:
        r->SetInt64(msg, f, r->GetInt64(*msg, f));
        break;
      case pb::FieldDescriptor::CPPTYPE_UINT32:
        r->SetUInt32(msg, f, r->GetUInt32(*msg, f));
        break;
      case pb::FieldDescriptor::CPPTYPE_UINT64:
        r->SetUInt64(msg, f, r->GetUInt64(*msg, f));
        break;
      case pb::FieldDescriptor::CPPTYPE_DOUBLE:
        r->SetDouble(msg, f, r->GetDouble(*msg, f));
        break;
      case pb::FieldDescriptor::CPPTYPE_FLOAT:
        r->SetFloat(msg, f, r->GetFloat(*msg, f));
        break;
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        r->SetBool(msg, f, r->GetBool(*msg, f));
        break;
      case pb::FieldDescriptor::CPPTYPE_STRING:
        r->SetString(msg, f, r->GetString(*msg, f));
        break;
      case pb::FieldDescriptor::CPPTYPE_ENUM:
        r->SetEnum(msg, f, r->GetEnum(*msg, f));
        break;
      default:
        break;
    }
  }
}
}  // namespace

namespace {
void CollectFields(const pb::Message& msg, const std::string& prefix,
                   std::vector<FieldOverride>* out) {
  const pb::Descriptor* d = msg.GetDescriptor();
  const pb::Reflection* r = msg.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) continue;
    const std::string path = prefix.empty() ? f->name() : absl::StrCat(prefix, ".", f->name());
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      CollectFields(r->GetMessage(msg, f), path, out);
      continue;
    }
    std::string value;
    pb::TextFormat::PrintFieldValueToString(msg, f, -1, &value);
    out->push_back({path, value});
  }
}
}  // namespace

namespace {
// Appends "--flag=value" for every field of `msg` with a (flag) option whose value differs
// from the same field of `defaults` (the same message type, at its defaults).
void CollectChangedFlags(const pb::Message& msg, const pb::Message& defaults,
                         std::vector<std::string>* out) {
  const pb::Descriptor* d = msg.GetDescriptor();
  const pb::Reflection* r = msg.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) continue;
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      CollectChangedFlags(r->GetMessage(msg, f), r->GetMessage(defaults, f), out);
      continue;
    }
    const std::string& flag = f->options().GetExtension(train::flag);
    if (flag.empty()) continue;
    std::string value, default_value;
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_STRING) {
      value = r->GetString(msg, f);
      default_value = r->GetString(defaults, f);
      if (value.find_first_of(" \t'\"") != std::string::npos) {
        value = absl::StrCat("'", value, "'");
      }
    } else {
      pb::TextFormat::PrintFieldValueToString(msg, f, -1, &value);
      pb::TextFormat::PrintFieldValueToString(defaults, f, -1, &default_value);
    }
    if (value == default_value) continue;
    if (f->options().GetExtension(train::switch_flag) && value == "true") {
      out->push_back(absl::StrCat("--", flag));
    } else {
      out->push_back(absl::StrCat("--", flag, "=", value));
    }
  }
}
}  // namespace

std::string NonDefaultFlags(const TrainConfig& config) {
  std::vector<std::string> flags;
  CollectChangedFlags(config, TrainConfig::default_instance(), &flags);
  return absl::StrJoin(flags, " ");
}

std::vector<FieldOverride> ConfigFields(const TrainConfig& config) {
  std::vector<FieldOverride> out;
  CollectFields(config, "", &out);
  return out;
}

TrainConfig ResolvedConfig(const TrainConfig& in) {
  TrainConfig config = in;
  // A text file names no embedded corpus: unless one is given (an error, MakeCorpus), it
  // resolves to markov1, the value file runs recorded before markov2 became the default.
  if (ReadsDataFiles(config.data()) && !config.data().has_corpus()) {
    config.mutable_data()->set_corpus(DataConfig::markov1);
  }
  SetDefaultsExplicitly(&config);
  return config;
}

bool ReadsDataFiles(const DataConfig& data) {
  return !data.path().empty() || !data.data_path().empty();
}

int64_t GlobalBatch(const TrainConfig& config) {
  return int64_t{config.parallelism().world() / std::max(1, config.parallelism().sp()) /
                 std::max(1, config.parallelism().cp())} *
         config.parallelism().grad_acc() * config.data().micro_batch();
}

int64_t DefaultReproBlock(int64_t seq_len) {
  int64_t block = 1;
  for (int64_t b = 1; b * 4 <= seq_len; ++b) {
    if (seq_len % b == 0) block = b;
  }
  return block;
}

int64_t ReproBlock(const TrainConfig& config) {
  const int32_t explicit_block = config.precision().repro_block();
  return explicit_block > 0 ? explicit_block : DefaultReproBlock(config.data().seq_len());
}

std::string ConfigToShortText(const TrainConfig& in) {
  const TrainConfig config = ResolvedConfig(in);
  pb::TextFormat::Printer printer;
  printer.SetSingleLineMode(true);
  std::string out;
  printer.PrintToString(config, &out);
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

optim::LrSchedule ToLrSchedule(const OptimConfig& o) {
  optim::LrSchedule s;
  switch (o.lr_decay()) {
    case OptimConfig::cosine:
      s.decay = optim::LrDecay::kCosine;
      break;
    case OptimConfig::linear:
      s.decay = optim::LrDecay::kLinear;
      break;
    default:
      s.decay = optim::LrDecay::kConstant;
  }
  s.lr = o.lr();
  s.min_lr = o.min_lr();
  s.warmup_steps = o.warmup_steps();
  s.decay_end = o.decay_steps() > 0 ? o.decay_steps() : o.steps();
  return s;
}

std::optional<ResumeFieldChange> FirstResumeFieldChange(const TrainConfig& saved,
                                                        const TrainConfig& config) {
  const DataConfig &a = saved.data(), &b = config.data();
  const ModelConfig &ma = saved.model(), &mb = config.model();
  const std::pair<const char*, std::pair<std::string, std::string>> fields[] = {
      {"data.path", {a.path(), b.path()}},
      {"data.data_path", {a.data_path(), b.data_path()}},
      {"data.split", {a.split(), b.split()}},
      {"data.seq_len", {StrCat(a.seq_len()), StrCat(b.seq_len())}},
      {"data.corpus_seed", {StrCat(a.corpus_seed()), StrCat(b.corpus_seed())}},
      {"data.min_doc_len", {StrCat(a.min_doc_len()), StrCat(b.min_doc_len())}},
      {"data.max_doc_len", {StrCat(a.max_doc_len()), StrCat(b.max_doc_len())}},
      {"data.corpus_documents", {StrCat(a.corpus_documents()), StrCat(b.corpus_documents())}},
      {"data.corpus", {DataConfig::Corpus_Name(a.corpus()), DataConfig::Corpus_Name(b.corpus())}},
      {"model.vocab", {StrCat(ma.vocab()), StrCat(mb.vocab())}},
      {"model.dim", {StrCat(ma.dim()), StrCat(mb.dim())}},
      {"model.layers", {StrCat(ma.layers()), StrCat(mb.layers())}},
      {"model.experts", {StrCat(ma.experts()), StrCat(mb.experts())}},
      {"model.top_k", {StrCat(ma.top_k()), StrCat(mb.top_k())}},
      {"model.expert_dim", {StrCat(ma.expert_dim()), StrCat(mb.expert_dim())}},
      {"model.norm_topk_prob", {StrCat(ma.norm_topk_prob()), StrCat(mb.norm_topk_prob())}},
      {"model.router_scale", {StrCat(ma.router_scale()), StrCat(mb.router_scale())}},
      {"model.attention",
       {ModelConfig::Attention_Name(ma.attention()), ModelConfig::Attention_Name(mb.attention())}},
      {"model.heads", {StrCat(ma.heads()), StrCat(mb.heads())}},
      {"model.kv_heads", {StrCat(ma.kv_heads()), StrCat(mb.kv_heads())}},
      {"model.rope_theta", {StrCat(ma.rope_theta()), StrCat(mb.rope_theta())}},
      {"model.router_score",
       {ModelConfig::RouterScore_Name(ma.router_score()),
        ModelConfig::RouterScore_Name(mb.router_score())}},
      {"model.mtp_depth", {StrCat(ma.mtp_depth()), StrCat(mb.mtp_depth())}},
  };
  // Without attention (on both sides) the head layout and the RoPE base decide nothing: a
  // checkpoint written when they could be set regardless still resumes with the defaults
  // the config's validation now asks for.
  const bool no_attention =
      ma.attention() == ModelConfig::none && mb.attention() == ModelConfig::none;
  for (const auto& [name, values] : fields) {
    if (no_attention &&
        (absl::string_view(name) == "model.heads" || absl::string_view(name) == "model.kv_heads" ||
         absl::string_view(name) == "model.rope_theta")) {
      continue;
    }
    if (values.first != values.second) return ResumeFieldChange{name, values.first, values.second};
  }
  return std::nullopt;
}

}  // namespace gradsum::train
