#include "sharding/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/half.h"
#include "core/status.h"
#include "core/tensor.h"
#include "sharding/atomic_file.h"
#include "sharding/flat_param.h"
#include "sharding/checkpoint.pb.h"
#include "sharding/proto_json.h"
#include "sharding/safetensors.h"
#include "sharding/status_agreement.h"

namespace gradsum {
namespace {

namespace cp = ::gradsum::checkpoint;  // sharding/checkpoint.proto
namespace pb = ::google::protobuf;

constexpr absl::string_view kFormat = "gradsum.sharded_checkpoint";
// 2: the marker records every rank's file fingerprints. 3: the files are the proto3 JSON of
// sharding/checkpoint.proto (int64 values as strings).
constexpr int32_t kVersion = 3;
constexpr absl::string_view kMarkerName = "checkpoint.json";

std::string RankStem(int64_t rank) { return absl::StrFormat("rank-%05d", rank); }
std::string ManifestName(int64_t rank) { return RankStem(rank) + ".manifest.json"; }
std::string TensorsName(int64_t rank) { return RankStem(rank) + ".safetensors"; }
std::string Join(const std::string& dir, absl::string_view name) {
  return absl::StrCat(dir, "/", name);
}

absl::Status MakeDir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0755) == 0 || errno == EEXIST) {
    struct stat st;
    if (::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("'", dir, "' exists and is not a directory"));
  }
  return ErrnoStatus(errno, absl::StrCat("mkdir '", dir, "'"));
}

// ---- Manifest records and their strict reading (every problem is DataLoss). ----

struct GroupRecord {
  std::string name;
  std::string mode;
  int64_t group_size = 0, group_rank = 0, numel = 0, padded_numel = 0, shard_offset = 0,
          local_numel = 0;
  std::vector<FlatParamEntry> params;
};

struct Manifest {
  int64_t rank = 0, world = 0, step = 0;
  std::string tensors_file;
  int64_t tensors_bytes = 0;
  uint64_t tensors_fingerprint = 0;
  uint64_t file_fingerprint = 0;  // of the manifest file itself
  std::vector<GroupRecord> groups;
};

std::string Hex(uint64_t v) { return absl::StrFormat("%016x", v); }

absl::Status Loss(const std::string& file, absl::string_view what) {
  return absl::DataLossError(absl::StrCat("checkpoint file '", file, "': ", what));
}

// 16 hex digits, as Hex writes them.
absl::StatusOr<uint64_t> FromHex(const std::string& file, absl::string_view field,
                                 const std::string& hex) {
  uint64_t v = 0;
  if (hex.size() != 16 || !absl::SimpleHexAtoi(hex, &v)) {
    return Loss(file, absl::StrCat("\"", field, "\" is \"", hex, "\", not 16 hex digits"));
  }
  return v;
}

// Reads the JSON file at `path` into `message`: first its format and version (a file of
// another version is FailedPrecondition naming both versions, whatever else it holds), then
// the whole message, every field required. `fingerprint` gets the file's.
absl::Status ReadJsonFile(const std::string& path, pb::Message* message,
                          uint64_t* fingerprint = nullptr) {
  GRADSUM_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, uint64_t{1} << 30));
  if (fingerprint != nullptr) *fingerprint = Fingerprint64(text);
  cp::FormatHeader header;
  absl::Status s = ProtoFromJson(text, &header, /*ignore_unknown_fields=*/true);
  if (!s.ok()) return Loss(path, s.message());
  if (!header.has_format()) return Loss(path, "missing field \"format\"");
  if (header.format() != kFormat) {
    return Loss(path, absl::StrCat("format is \"", header.format(), "\", not ", kFormat));
  }
  if (!header.has_version()) return Loss(path, "missing field \"version\"");
  if (header.version() != kVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint file '", path, "' has format version ", header.version(),
        "; this build reads only version ", kVersion,
        header.version() < kVersion ? " (the checkpoint was written by an older build)" : ""));
  }
  s = ProtoFromJson(text, message);
  if (!s.ok()) return Loss(path, s.message());
  const std::string missing = FirstMissingField(*message);
  if (!missing.empty()) return Loss(path, absl::StrCat("missing field \"", missing, "\""));
  return absl::OkStatus();
}

cp::GroupRecord GroupToProto(const FlatParam& g) {
  cp::GroupRecord o;
  o.set_name(g.name());
  o.set_mode(ShardingModeName(g.options().mode));
  o.set_group_size(g.group_size());
  o.set_group_rank(g.group_rank());
  o.set_numel(g.numel());
  o.set_padded_numel(g.padded_numel());
  o.set_shard_offset(g.shard_offset());
  o.set_local_numel(g.local_numel());
  for (const FlatParamEntry& e : g.entries()) {
    cp::ParamRecord* p = o.add_params();
    p->set_name(e.name);
    for (int64_t d : e.shape) p->add_shape(d);
    p->set_offset(e.offset);
  }
  return o;
}

absl::StatusOr<GroupRecord> GroupFromProto(const cp::GroupRecord& o, const std::string& file) {
  GroupRecord g;
  g.name = o.name();
  g.mode = o.mode();
  g.group_size = o.group_size();
  g.group_rank = o.group_rank();
  g.numel = o.numel();
  g.padded_numel = o.padded_numel();
  g.shard_offset = o.shard_offset();
  g.local_numel = o.local_numel();
  const std::string where = absl::StrCat("group \"", g.name, "\": ");
  for (const auto& [field, v] : {std::pair<const char*, int64_t>{"group_size", g.group_size},
                                 {"group_rank", g.group_rank},
                                 {"numel", g.numel},
                                 {"padded_numel", g.padded_numel},
                                 {"shard_offset", g.shard_offset},
                                 {"local_numel", g.local_numel}}) {
    if (v < 0) return Loss(file, absl::StrCat(where, "field \"", field, "\" is negative: ", v));
  }
  // The layout must be the one FlatParam computes; anything else is corruption.
  if (g.group_size < 1 || g.group_rank >= g.group_size || g.numel > (int64_t{1} << 60)) {
    return Loss(file, absl::StrCat(where, "group_rank ", g.group_rank, " / group_size ",
                                   g.group_size, " / numel ", g.numel, " are inconsistent"));
  }
  const int64_t padded = (g.numel + g.group_size - 1) / g.group_size * g.group_size;
  const int64_t shard = padded / g.group_size;
  if (g.padded_numel != padded || g.shard_offset != g.group_rank * shard ||
      g.local_numel != std::clamp<int64_t>(g.numel - g.shard_offset, 0, shard)) {
    return Loss(file, absl::StrCat(where, "padded_numel ", g.padded_numel, ", shard_offset ",
                                   g.shard_offset, ", local_numel ", g.local_numel,
                                   " do not match numel ", g.numel, " over ", g.group_size,
                                   " ranks"));
  }
  if (g.mode != ShardingModeName(ShardingMode::kSharded) &&
      g.mode != ShardingModeName(ShardingMode::kReplicated)) {
    return Loss(file, absl::StrCat(where, "unknown mode \"", g.mode, "\""));
  }
  int64_t offset = 0;
  for (const cp::ParamRecord& p : o.params()) {
    FlatParamEntry e;
    e.name = p.name();
    e.offset = p.offset();
    for (int64_t d : p.shape()) {
      if (d < 0) return Loss(file, absl::StrCat(where, "parameter \"", e.name, "\" has a bad shape"));
      e.shape.push_back(d);
    }
    absl::StatusOr<int64_t> n = NumElements(e.shape);
    if (!n.ok() || e.offset != offset || *n > g.numel - offset) {
      return Loss(file, absl::StrCat(where, "parameter \"", e.name, "\" at offset ", e.offset,
                                     " does not fit the flat layout"));
    }
    e.numel = *n;
    offset += *n;
    g.params.push_back(std::move(e));
  }
  if (offset != g.numel) {
    return Loss(file,
                absl::StrCat(where, "parameters cover ", offset, " of ", g.numel, " elements"));
  }
  return g;
}

absl::StatusOr<Manifest> ReadManifest(const std::string& dir, int64_t rank) {
  const std::string path = Join(dir, ManifestName(rank));
  Manifest m;
  cp::RankManifest v;
  GRADSUM_RETURN_IF_ERROR(ReadJsonFile(path, &v, &m.file_fingerprint));
  m.rank = v.rank();
  m.world = v.world();
  m.step = v.step();
  m.tensors_file = v.tensors_file();
  m.tensors_bytes = v.tensors_bytes();
  for (const auto& [field, value] : {std::pair<const char*, int64_t>{"rank", m.rank},
                                     {"world", m.world},
                                     {"step", m.step},
                                     {"tensors_bytes", m.tensors_bytes}}) {
    if (value < 0) return Loss(path, absl::StrCat("field \"", field, "\" is negative: ", value));
  }
  GRADSUM_ASSIGN_OR_RETURN(m.tensors_fingerprint,
                           FromHex(path, "tensors_fingerprint", v.tensors_fingerprint()));
  if (m.rank != rank) return Loss(path, absl::StrCat("records rank ", m.rank, ", expected ", rank));
  if (m.tensors_file != TensorsName(rank)) {
    return Loss(path, absl::StrCat("tensors_file \"", m.tensors_file, "\" is not ", TensorsName(rank)));
  }
  std::set<std::string> names;
  for (const cp::GroupRecord& gp : v.groups()) {
    GRADSUM_ASSIGN_OR_RETURN(GroupRecord g, GroupFromProto(gp, path));
    if (!names.insert(g.name).second) {
      return Loss(path, absl::StrCat("duplicate group \"", g.name, "\""));
    }
    m.groups.push_back(std::move(g));
  }
  return m;
}

// Reads the rank's tensor file, checks it against the manifest's size and fingerprint
// (flipped bits in an otherwise valid file are caught here), then parses it.
absl::StatusOr<SafetensorsFile> ReadRankTensors(const std::string& dir, const Manifest& m) {
  const std::string path = Join(dir, m.tensors_file);
  GRADSUM_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
  if (static_cast<int64_t>(bytes.size()) != m.tensors_bytes) {
    return absl::DataLossError(absl::StrCat("checkpoint file '", path, "' has ", bytes.size(),
                                            " bytes, the manifest says ", m.tensors_bytes,
                                            " (truncated or replaced)"));
  }
  if (Fingerprint64(bytes) != m.tensors_fingerprint) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file '", path, "' does not match its manifest fingerprint (corrupt)"));
  }
  return SafetensorsFile::Parse(bytes, path);
}

// The f32 [local_numel] tensor "<group>/<what>" copied out, or DataLoss.
absl::StatusOr<std::vector<float>> ReadSlice(const SafetensorsFile& f, const GroupRecord& g,
                                             absl::string_view what) {
  const std::string name = absl::StrCat(g.name, "/", what);
  absl::StatusOr<TensorView> t = f.Get(name);
  if (!t.ok()) {
    return absl::DataLossError(absl::StrCat("checkpoint file '", f.source(), "' lacks \"", name, "\""));
  }
  if (t->dtype() != DType::kF32 || t->rank() != 1 || t->dim(0) != g.local_numel) {
    return absl::DataLossError(absl::StrCat("checkpoint file '", f.source(), "': \"", name,
                                            "\" is ", t->DebugString(), ", expected f32[",
                                            g.local_numel, "]"));
  }
  const float* p = t->data<float>();
  return std::vector<float>(p, p + g.local_numel);
}

struct MarkerRecord {
  int64_t world = 0, step = 0;
  // Per rank: the fingerprints of its manifest and tensor files as saved.
  std::vector<std::pair<uint64_t, uint64_t>> rank_files;
  std::map<std::string, std::string> extra;
};

// The marker's own fingerprint covers every other member, as ProtoToJson writes them.
absl::StatusOr<uint64_t> MarkerBodyFingerprint(cp::CommitMarker marker) {
  marker.clear_fingerprint();
  GRADSUM_ASSIGN_OR_RETURN(std::string body, ProtoToJson(marker));
  return Fingerprint64(body);
}

absl::StatusOr<MarkerRecord> ReadMarker(const std::string& dir) {
  const std::string path = Join(dir, kMarkerName);
  if (::access(path.c_str(), F_OK) != 0) {
    if (::access(dir.c_str(), F_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("no checkpoint directory '", dir, "'"));
    }
    return absl::NotFoundError(absl::StrCat("'", dir, "' has no ", kMarkerName,
                                            ": no checkpoint, or an incomplete one"));
  }
  cp::CommitMarker v;
  GRADSUM_RETURN_IF_ERROR(ReadJsonFile(path, &v));
  MarkerRecord m;
  GRADSUM_ASSIGN_OR_RETURN(uint64_t fingerprint, FromHex(path, "fingerprint", v.fingerprint()));
  GRADSUM_ASSIGN_OR_RETURN(uint64_t body_fingerprint, MarkerBodyFingerprint(v));
  if (fingerprint != body_fingerprint) {
    return Loss(path, "does not match its own fingerprint (corrupt)");
  }
  m.world = v.world();
  m.step = v.step();
  if (m.world < 1) return Loss(path, absl::StrCat("world is ", m.world));
  if (m.step < 0) return Loss(path, absl::StrCat("field \"step\" is negative: ", m.step));
  if (v.ranks_size() != m.world) {
    return Loss(path, absl::StrCat("records the files of ", v.ranks_size(), " ranks, world is ",
                                   m.world));
  }
  for (const cp::RankFiles& files : v.ranks()) {
    GRADSUM_ASSIGN_OR_RETURN(uint64_t manifest, FromHex(path, "manifest", files.manifest()));
    GRADSUM_ASSIGN_OR_RETURN(uint64_t tensors, FromHex(path, "tensors", files.tensors()));
    m.rank_files.push_back({manifest, tensors});
  }
  for (const auto& [key, value] : v.extra()) m.extra[key] = value;
  return m;
}

// A rank's files must be the ones this save's commit marker recorded: a file copied in from
// another run or left from another save at the same step is DataLoss naming rank and file.
absl::Status CheckAgainstMarker(const std::string& dir, const MarkerRecord& marker,
                                const Manifest& m) {
  if (m.world != marker.world || m.step != marker.step) {
    return absl::DataLossError(absl::StrCat("checkpoint '", dir, "': rank ", m.rank, "'s ",
                                            ManifestName(m.rank), " records world ", m.world,
                                            " step ", m.step, ", the commit marker world ",
                                            marker.world, " step ", marker.step,
                                            " (files from different saves)"));
  }
  const auto& [manifest_fp, tensors_fp] = marker.rank_files[m.rank];
  if (m.file_fingerprint != manifest_fp || m.tensors_fingerprint != tensors_fp) {
    const bool manifest = m.file_fingerprint != manifest_fp;
    return absl::DataLossError(absl::StrCat(
        "checkpoint '", dir, "': rank ", m.rank, "'s ",
        manifest ? ManifestName(m.rank) : TensorsName(m.rank),
        " is not the file this save's commit marker recorded (fingerprint ",
        Hex(manifest ? m.file_fingerprint : m.tensors_fingerprint), ", recorded ",
        Hex(manifest ? manifest_fp : tensors_fp),
        "): it comes from another run or another save"));
  }
  return absl::OkStatus();
}

// A checkpoint group must have the layout of the live group it is loaded into.
absl::Status CheckLayout(const GroupRecord& rec, const FlatParam& g) {
  auto mismatch = [&](absl::string_view field, auto saved, auto current) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint group \"", g.name(), "\": ", field,
                                                      " is ", saved, " in the checkpoint but ",
                                                      current, " now"));
  };
  if (rec.group_size != g.group_size()) return mismatch("group_size", rec.group_size, g.group_size());
  if (rec.group_rank != g.group_rank()) return mismatch("group_rank", rec.group_rank, g.group_rank());
  if (rec.numel != g.numel()) return mismatch("numel", rec.numel, g.numel());
  if (rec.params.size() != g.entries().size()) {
    return mismatch("parameter count", rec.params.size(), g.entries().size());
  }
  for (size_t i = 0; i < rec.params.size(); ++i) {
    const FlatParamEntry& a = rec.params[i];
    const FlatParamEntry& b = g.entries()[i];
    if (a.name != b.name) return mismatch(absl::StrCat("parameter ", i), a.name, b.name);
    if (a.shape != b.shape) {
      return mismatch(absl::StrCat("shape of \"", a.name, "\""),
                      absl::StrCat("[", absl::StrJoin(a.shape, ","), "]"),
                      absl::StrCat("[", absl::StrJoin(b.shape, ","), "]"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckIdle(const ShardedAdamW& optimizer) {
  for (const FlatParam* g : optimizer.groups()) {
    if (g->grad_reduce_in_flight() || g->unshard_in_flight()) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint: group \"", g->name(), "\" has a collective in flight"));
    }
  }
  return absl::OkStatus();
}

// The owned slice of a vector stored beside master() (m or v).
absl::Span<const float> OwnedPart(const FlatParam& g, absl::Span<const float> beside_master) {
  return g.options().mode == ShardingMode::kSharded
             ? beside_master
             : beside_master.subspan(g.shard_offset(), g.local_numel());
}

// Writes the rank's files; `fingerprints` gets (manifest, tensors) file fingerprints.
absl::Status WriteRankFiles(const std::string& dir, int rank, int world,
                            const ShardedAdamW& optimizer, std::array<int64_t, 2>* fingerprints) {
  SafetensorsWriter writer;
  cp::RankManifest manifest;
  for (size_t gi = 0; gi < optimizer.groups().size(); ++gi) {
    const FlatParam& g = *optimizer.groups()[gi];
    const std::pair<const char*, absl::Span<const float>> parts[] = {
        {"master", g.owned_master()},
        {"exp_avg", OwnedPart(g, optimizer.exp_avg(gi))},
        {"exp_avg_sq", OwnedPart(g, optimizer.exp_avg_sq(gi))},
    };
    for (const auto& [what, span] : parts) {
      GRADSUM_ASSIGN_OR_RETURN(
          TensorView view,
          TensorView::Create(span.empty() ? nullptr : const_cast<float*>(span.data()), DType::kF32,
                             {static_cast<int64_t>(span.size())}));
      GRADSUM_RETURN_IF_ERROR(writer.Add(absl::StrCat(g.name(), "/", what), view));
    }
    *manifest.add_groups() = GroupToProto(g);
  }
  const std::string bytes = writer.Serialize();
  GRADSUM_RETURN_IF_ERROR(WriteFileAtomically(Join(dir, TensorsName(rank)), bytes));
  manifest.set_format(std::string(kFormat));
  manifest.set_version(kVersion);
  manifest.set_rank(rank);
  manifest.set_world(world);
  manifest.set_step(optimizer.step());
  manifest.set_tensors_file(TensorsName(rank));
  manifest.set_tensors_bytes(static_cast<int64_t>(bytes.size()));
  const uint64_t tensors_fp = Fingerprint64(bytes);
  manifest.set_tensors_fingerprint(Hex(tensors_fp));
  GRADSUM_ASSIGN_OR_RETURN(std::string text, ProtoToJson(manifest));
  text += "\n";
  (*fingerprints)[0] = static_cast<int64_t>(Fingerprint64(text));
  (*fingerprints)[1] = static_cast<int64_t>(tensors_fp);
  return WriteFileAtomically(Join(dir, ManifestName(rank)), text);
}

}  // namespace

int RemoveStaleTempFiles(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  int removed = 0;
  while (const struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.find(".tmp.") != std::string::npos && ::unlink(Join(dir, name).c_str()) == 0) {
      ++removed;
    }
  }
  ::closedir(d);
  return removed;
}

absl::Status SaveCheckpoint(const std::string& dir, Communicator& world,
                            const ShardedAdamW& optimizer,
                            const std::map<std::string, std::string>& extra) {
  const int rank = world.rank();
  // Phase 1: directory exists and no stale commit marker can vouch for the new files.
  absl::Status local = CheckIdle(optimizer);
  if (local.ok()) local = MakeDir(dir);
  if (local.ok() && rank == 0) {
    const std::string marker = Join(dir, kMarkerName);
    if (::unlink(marker.c_str()) != 0 && errno != ENOENT) {
      local = ErrnoStatus(errno, absl::StrCat("unlink '", marker, "'"));
    }
    // No rank writes before the agreement below, so every *.tmp.* here is stale.
    if (local.ok()) RemoveStaleTempFiles(dir);
  }
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, local, "checkpoint save (prepare)"));
  // Phase 2: every rank writes its own files.
  std::array<int64_t, 2> fingerprints{};
  GRADSUM_RETURN_IF_ERROR(
      AgreeOnStatus(world, WriteRankFiles(dir, rank, world.size(), optimizer, &fingerprints),
                    "checkpoint save (rank files)"));
  std::vector<int64_t> all_fingerprints(2 * world.size());
  GRADSUM_RETURN_IF_ERROR(
      world.AllGather(fingerprints.data(), all_fingerprints.data(), 2, DType::kI64));
  // Phase 3: commit.
  local = absl::OkStatus();
  if (rank == 0) {
    local = [&]() -> absl::Status {
      cp::CommitMarker marker;
      marker.set_format(std::string(kFormat));
      marker.set_version(kVersion);
      marker.set_world(world.size());
      marker.set_step(optimizer.step());
      for (int r = 0; r < world.size(); ++r) {
        cp::RankFiles* files = marker.add_ranks();
        files->set_manifest(Hex(static_cast<uint64_t>(all_fingerprints[2 * r])));
        files->set_tensors(Hex(static_cast<uint64_t>(all_fingerprints[2 * r + 1])));
      }
      for (const auto& [key, value] : extra) (*marker.mutable_extra())[key] = value;
      GRADSUM_ASSIGN_OR_RETURN(uint64_t fingerprint, MarkerBodyFingerprint(marker));
      marker.set_fingerprint(Hex(fingerprint));
      GRADSUM_ASSIGN_OR_RETURN(std::string text, ProtoToJson(marker));
      return WriteFileAtomically(Join(dir, kMarkerName), text + "\n");
    }();
  }
  return AgreeOnStatus(world, local, "checkpoint save (commit)");
}

absl::StatusOr<CheckpointInfo> LoadCheckpoint(const std::string& dir, Communicator& world,
                                              ShardedAdamW& optimizer) {
  const int rank = world.rank();
  struct Staged {
    std::vector<float> master, exp_avg, exp_avg_sq;  // owned slices
  };
  std::vector<Staged> staged(optimizer.groups().size());
  CheckpointInfo info;
  // Phase 1: read and validate everything locally; nothing is modified yet.
  auto read_all = [&]() -> absl::Status {
    GRADSUM_RETURN_IF_ERROR(CheckIdle(optimizer));
    GRADSUM_ASSIGN_OR_RETURN(MarkerRecord marker, ReadMarker(dir));
    if (marker.world != world.size()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", dir,
                                                        "' was written by world size ", marker.world,
                                                        ", the current world size is ", world.size()));
    }
    GRADSUM_ASSIGN_OR_RETURN(Manifest m, ReadManifest(dir, rank));
    GRADSUM_RETURN_IF_ERROR(CheckAgainstMarker(dir, marker, m));
    const auto& groups = optimizer.groups();
    if (m.groups.size() != groups.size()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", dir, "' has ", m.groups.size(),
                                                        " groups on rank ", rank, ", the optimizer has ",
                                                        groups.size()));
    }
    GRADSUM_ASSIGN_OR_RETURN(SafetensorsFile tensors, ReadRankTensors(dir, m));
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const GroupRecord& rec = m.groups[gi];
      if (rec.name != groups[gi]->name()) {
        return absl::FailedPreconditionError(absl::StrCat("checkpoint group ", gi, " is \"", rec.name,
                                                          "\", the optimizer's is \"",
                                                          groups[gi]->name(), "\""));
      }
      GRADSUM_RETURN_IF_ERROR(CheckLayout(rec, *groups[gi]));
      GRADSUM_ASSIGN_OR_RETURN(staged[gi].master, ReadSlice(tensors, rec, "master"));
      GRADSUM_ASSIGN_OR_RETURN(staged[gi].exp_avg, ReadSlice(tensors, rec, "exp_avg"));
      GRADSUM_ASSIGN_OR_RETURN(staged[gi].exp_avg_sq, ReadSlice(tensors, rec, "exp_avg_sq"));
    }
    info.step = marker.step;
    info.extra = std::move(marker.extra);
    return absl::OkStatus();
  };
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, read_all(), "checkpoint load"));

  // Phase 2: install. Replicated groups rebuild their full copies from every rank's slice.
  absl::Status local = absl::OkStatus();
  for (size_t gi = 0; gi < optimizer.groups().size() && local.ok(); ++gi) {
    FlatParam& g = *optimizer.groups()[gi];
    const std::pair<std::vector<float>*, absl::Span<float>> parts[] = {
        {&staged[gi].master, g.master()},
        {&staged[gi].exp_avg, optimizer.exp_avg(gi)},
        {&staged[gi].exp_avg_sq, optimizer.exp_avg_sq(gi)},
    };
    for (const auto& [slice, dest] : parts) {
      if (g.options().mode == ShardingMode::kSharded) {
        std::copy(slice->begin(), slice->end(), dest.begin());
        continue;
      }
      std::vector<float> send(g.shard_numel(), 0.0f);
      std::copy(slice->begin(), slice->end(), send.begin());
      std::vector<float> full(g.padded_numel());
      local = g.group()->AllGather(send.data(), full.data(), g.shard_numel(), DType::kF32);
      if (!local.ok()) break;
      std::copy(full.begin(), full.begin() + g.numel(), dest.begin());
    }
    if (local.ok()) local = g.MasterUpdated();
    if (local.ok()) local = g.ZeroGrad();
  }
  if (local.ok()) local = optimizer.set_step(info.step);
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, local, "checkpoint load (install)"));
  return info;
}

absl::Status ExportConsolidated(const std::string& dir, const std::string& out_path, DType dtype) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("export dtype must be f32 or bf16, got ", DTypeName(dtype)));
  }
  GRADSUM_ASSIGN_OR_RETURN(MarkerRecord marker, ReadMarker(dir));
  struct Assembled {
    GroupRecord layout;
    std::vector<bool> have_rank;
    std::vector<float> full;
  };
  std::map<std::string, Assembled> groups;
  for (int64_t r = 0; r < marker.world; ++r) {
    GRADSUM_ASSIGN_OR_RETURN(Manifest m, ReadManifest(dir, r));
    GRADSUM_RETURN_IF_ERROR(CheckAgainstMarker(dir, marker, m));
    GRADSUM_ASSIGN_OR_RETURN(SafetensorsFile tensors, ReadRankTensors(dir, m));
    for (const GroupRecord& rec : m.groups) {
      GRADSUM_ASSIGN_OR_RETURN(std::vector<float> slice, ReadSlice(tensors, rec, "master"));
      auto [it, inserted] = groups.try_emplace(rec.name);
      Assembled& a = it->second;
      if (inserted) {
        a.layout = rec;
        a.have_rank.assign(rec.group_size, false);
        a.full.assign(rec.numel, 0.0f);
      } else {
        bool same = a.layout.group_size == rec.group_size && a.layout.numel == rec.numel &&
                    a.layout.params.size() == rec.params.size();
        for (size_t i = 0; same && i < rec.params.size(); ++i) {
          same = a.layout.params[i].name == rec.params[i].name &&
                 a.layout.params[i].shape == rec.params[i].shape;
        }
        if (!same) {
          return absl::FailedPreconditionError(absl::StrCat(
              "checkpoint '", dir, "': group \"", rec.name, "\" on rank ", r,
              " has another layout than elsewhere; groups holding different parameters need "
              "different names (e.g. one per EP slot)"));
        }
      }
      if (a.have_rank[rec.group_rank]) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint '", dir, "': group \"", rec.name, "\" has two shards for group rank ",
            rec.group_rank, " (second on world rank ", r, "); give each EP slot's group its own name"));
      }
      a.have_rank[rec.group_rank] = true;
      std::copy(slice.begin(), slice.end(), a.full.begin() + rec.shard_offset);
    }
  }
  SafetensorsWriter writer;
  std::vector<std::vector<BF16>> bf16_copies;
  bf16_copies.reserve(groups.size());
  for (auto& [name, a] : groups) {
    for (size_t q = 0; q < a.have_rank.size(); ++q) {
      if (!a.have_rank[q]) {
        return absl::FailedPreconditionError(absl::StrCat("checkpoint '", dir, "': group \"", name,
                                                          "\" lacks the shard of group rank ", q));
      }
    }
    void* base = a.full.data();
    if (dtype == DType::kBF16) {
      bf16_copies.emplace_back(a.full.size());
      for (size_t i = 0; i < a.full.size(); ++i) bf16_copies.back()[i] = BF16::FromFloat(a.full[i]);
      base = bf16_copies.back().data();
    }
    for (const FlatParamEntry& e : a.layout.params) {
      char* p = static_cast<char*>(base) + e.offset * static_cast<int64_t>(DTypeSize(dtype));
      GRADSUM_ASSIGN_OR_RETURN(TensorView view,
                               TensorView::Create(e.numel > 0 ? p : nullptr, dtype, e.shape));
      absl::Status s = writer.Add(e.name, view);
      if (!s.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint '", dir, "': parameter \"", e.name, "\" of group \"", name,
            "\" cannot be exported: ", s.message()));
      }
    }
  }
  GRADSUM_RETURN_IF_ERROR(writer.AddMetadata("format", "pt"));
  GRADSUM_RETURN_IF_ERROR(writer.AddMetadata("step", absl::StrCat(marker.step)));
  return writer.WriteFile(out_path);
}

}  // namespace gradsum
