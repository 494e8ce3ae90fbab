#include "checkpoint/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <initializer_list>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint.pb.h"
#include "collectives/status_agreement.h"
#include "core/half.h"
#include "core/status.h"
#include "core/tensor.h"
#include "io/atomic_file.h"
#include "io/fingerprint.h"
#include "io/proto_json.h"
#include "io/safetensors.h"
#include "parallel/flat_param.h"

namespace gradsum {
namespace {

namespace cp = ::gradsum::checkpoint;  // checkpoint/checkpoint.proto
namespace pb = ::google::protobuf;

constexpr absl::string_view kFormat = "gradsum.sharded_checkpoint";
// 2: the marker records every rank's file fingerprints. 3: the files are the proto3 JSON of
// checkpoint/checkpoint.proto (int64 values as strings).
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
  // The owned slice's layout: the group's split, or for HSDP the split over shard group x
  // replicas, so every mode's files read as a sharded run's (SEMANTICS.md §7).
  o.set_group_size(g.owned_group_size());
  o.set_group_rank(g.owned_group_rank());
  o.set_numel(g.numel());
  o.set_padded_numel(g.padded_numel());
  o.set_shard_offset(g.owned_offset());
  o.set_local_numel(g.owned_numel());
  for (const FlatParamEntry& e : g.entries()) {
    cp::ParamRecord* p = o.add_params();
    p->set_name(e.name);
    for (int64_t d : e.shape) p->add_shape(d);
    p->set_offset(e.offset);
  }
  return o;
}

// DataLoss naming the first of `fields` (name, value) that is negative, after `where`.
absl::Status CheckNotNegative(const std::string& file, absl::string_view where,
                              std::initializer_list<std::pair<const char*, int64_t>> fields) {
  for (const auto& [field, value] : fields) {
    if (value < 0) {
      return Loss(file, absl::StrCat(where, "field \"", field, "\" is negative: ", value));
    }
  }
  return absl::OkStatus();
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
  GRADSUM_RETURN_IF_ERROR(CheckNotNegative(file, where,
                                           {{"group_size", g.group_size},
                                            {"group_rank", g.group_rank},
                                            {"numel", g.numel},
                                            {"padded_numel", g.padded_numel},
                                            {"shard_offset", g.shard_offset},
                                            {"local_numel", g.local_numel}}));
  // The layout must be the one FlatParam computes; anything else is corruption.
  if (g.group_size < 1 || g.group_rank >= g.group_size || g.numel > (int64_t{1} << 60)) {
    return Loss(file, absl::StrCat(where, "group_rank ", g.group_rank, " / group_size ",
                                   g.group_size, " / numel ", g.numel, " are inconsistent"));
  }
  const ShardLayout layout = ComputeShardLayout(g.numel, g.group_size, g.group_rank);
  if (g.padded_numel != layout.padded_numel || g.shard_offset != layout.shard_offset ||
      g.local_numel != layout.local_numel) {
    return Loss(
        file, absl::StrCat(where, "padded_numel ", g.padded_numel, ", shard_offset ",
                           g.shard_offset, ", local_numel ", g.local_numel, " do not match numel ",
                           g.numel, " over ", g.group_size, " ranks"));
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
      if (d < 0)
        return Loss(file, absl::StrCat(where, "parameter \"", e.name, "\" has a bad shape"));
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
  GRADSUM_RETURN_IF_ERROR(CheckNotNegative(path, "",
                                           {{"rank", m.rank},
                                            {"world", m.world},
                                            {"step", m.step},
                                            {"tensors_bytes", m.tensors_bytes}}));
  GRADSUM_ASSIGN_OR_RETURN(m.tensors_fingerprint,
                           FromHex(path, "tensors_fingerprint", v.tensors_fingerprint()));
  if (m.rank != rank) return Loss(path, absl::StrCat("records rank ", m.rank, ", expected ", rank));
  if (m.tensors_file != TensorsName(rank)) {
    return Loss(path,
                absl::StrCat("tensors_file \"", m.tensors_file, "\" is not ", TensorsName(rank)));
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
    return absl::NotFoundError(
        absl::StrCat("'", dir, "' has no ", kMarkerName, ": no checkpoint, or an incomplete one"));
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
  GRADSUM_RETURN_IF_ERROR(CheckNotNegative(path, "", {{"step", m.step}}));
  if (v.ranks_size() != m.world) {
    return Loss(
        path, absl::StrCat("records the files of ", v.ranks_size(), " ranks, world is ", m.world));
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
    return absl::DataLossError(
        absl::StrCat("checkpoint '", dir, "': rank ", m.rank, "'s ", ManifestName(m.rank),
                     " records world ", m.world, " step ", m.step, ", the commit marker world ",
                     marker.world, " step ", marker.step, " (files from different saves)"));
  }
  const auto& [manifest_fp, tensors_fp] = marker.rank_files[m.rank];
  if (m.file_fingerprint != manifest_fp || m.tensors_fingerprint != tensors_fp) {
    const bool manifest = m.file_fingerprint != manifest_fp;
    return absl::DataLossError(absl::StrCat(
        "checkpoint '", dir, "': rank ", m.rank, "'s ",
        manifest ? ManifestName(m.rank) : TensorsName(m.rank),
        " is not the file this save's commit marker recorded (fingerprint ",
        Hex(manifest ? m.file_fingerprint : m.tensors_fingerprint), ", recorded ",
        Hex(manifest ? manifest_fp : tensors_fp), "): it comes from another run or another save"));
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

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

// A saved checkpoint as an index of its parameters, for loading onto any layout: where each
// parameter lives (its unit and offset), which world rank holds each (unit, group rank)
// shard, and the rank tensor files, opened on first use by their header only and read by
// the byte ranges a loader needs (docs/CHECKPOINTS.md, "Resharding").
class SavedLayout {
 public:
  // Reads every rank's manifest and checks it against the marker. Parameters must have one
  // unit, offset and shape across the manifests, and each (unit, group rank) one holder.
  static absl::StatusOr<SavedLayout> Read(const std::string& dir, const MarkerRecord& marker) {
    SavedLayout s;
    s.dir_ = dir;
    for (int64_t r = 0; r < marker.world; ++r) {
      // ReadManifest checks that the manifest records rank r.
      GRADSUM_ASSIGN_OR_RETURN(Manifest m, ReadManifest(dir, r));
      GRADSUM_RETURN_IF_ERROR(CheckAgainstMarker(dir, marker, m));
      s.manifests_.push_back(std::move(m));
    }
    for (const Manifest& m : s.manifests_) {
      for (const GroupRecord& g : m.groups) {
        auto [holder, fresh] = s.holders_.try_emplace({g.name, g.group_rank}, m.rank);
        if (!fresh) {
          return absl::FailedPreconditionError(absl::StrCat(
              "checkpoint '", dir, "': unit \"", g.name, "\" has two shards for group rank ",
              g.group_rank, " (world ranks ", holder->second, " and ", m.rank, ")"));
        }
        for (const FlatParamEntry& e : g.params) {
          auto [it, inserted] = s.params_.try_emplace(e.name, Param{&g, &e});
          const Param& p = it->second;
          if (!inserted && (p.unit->name != g.name || p.unit->numel != g.numel ||
                            p.unit->group_size != g.group_size || p.entry->offset != e.offset ||
                            p.entry->shape != e.shape)) {
            return absl::DataLossError(absl::StrCat(
                "checkpoint '", dir, "': parameter \"", e.name, "\" is at offset ", p.entry->offset,
                " of unit \"", p.unit->name, "\" on one rank and at offset ", e.offset,
                " of unit \"", g.name, "\" on rank ", m.rank, " (inconsistent manifests)"));
          }
        }
      }
    }
    return s;
  }

  struct Param {
    const GroupRecord* unit;
    const FlatParamEntry* entry;
  };
  // The saved parameters by name.
  const std::map<std::string, Param>& params() const { return params_; }

  // Saved elements [begin, end) of unit `unit`'s flat `what` (master, exp_avg or
  // exp_avg_sq) into `out`, from the shards holding them.
  absl::Status ReadUnitRange(const GroupRecord& unit, absl::string_view what, int64_t begin,
                             int64_t end, float* out) {
    const int64_t shard = unit.padded_numel / unit.group_size;
    for (int64_t q = begin / shard; begin < end; ++q) {
      const int64_t hi = std::min(end, (q + 1) * shard);
      auto holder = holders_.find({unit.name, q});
      if (holder == holders_.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint '", dir_, "': unit \"", unit.name, "\" lacks the shard of group rank ", q));
      }
      GRADSUM_ASSIGN_OR_RETURN(const SafetensorsHeader* file, File(holder->second));
      const std::string name = absl::StrCat(unit.name, "/", what);
      GRADSUM_ASSIGN_OR_RETURN(const SafetensorsTensorRange* t, file->Find(name));
      const int64_t local = ComputeShardLayout(unit.numel, unit.group_size, q).local_numel;
      if (t->dtype != DType::kF32 || t->shape != std::vector<int64_t>{local}) {
        return absl::DataLossError(absl::StrCat("checkpoint file '", file->path(), "': \"", name,
                                                "\" is ", DTypeName(t->dtype), ShapeText(t->shape),
                                                ", expected f32[", local, "]"));
      }
      GRADSUM_RETURN_IF_ERROR(file->ReadTensorBytes(name, (begin - q * shard) * sizeof(float),
                                                    (hi - begin) * sizeof(float), out));
      out += hi - begin;
      begin = hi;
    }
    return absl::OkStatus();
  }

 private:
  // Rank r's tensor file, checked once against its manifest's size and fingerprint (hashed
  // streaming, never held whole), then opened by its header.
  absl::StatusOr<const SafetensorsHeader*> File(int64_t r) {
    auto it = files_.find(r);
    if (it != files_.end()) return &it->second;
    const Manifest& m = manifests_[r];
    const std::string path = Join(dir_, m.tensors_file);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      return ErrnoStatus(errno, absl::StrCat("stat '", path, "'"));
    }
    if (st.st_size != m.tensors_bytes) {
      return absl::DataLossError(absl::StrCat("checkpoint file '", path, "' has ", st.st_size,
                                              " bytes, the manifest says ", m.tensors_bytes,
                                              " (truncated or replaced)"));
    }
    GRADSUM_ASSIGN_OR_RETURN(uint64_t fingerprint, FingerprintFile(path, m.tensors_bytes));
    if (fingerprint != m.tensors_fingerprint) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint file '", path, "' does not match its manifest fingerprint (corrupt)"));
    }
    GRADSUM_ASSIGN_OR_RETURN(SafetensorsHeader h, SafetensorsHeader::Read(path));
    return &files_.emplace(r, std::move(h)).first->second;
  }

  std::string dir_;
  std::vector<Manifest> manifests_;  // by world rank; params_ points into them
  std::map<std::string, Param> params_;
  std::map<std::pair<std::string, int64_t>, int64_t> holders_;
  std::map<int64_t, SafetensorsHeader> files_;
};

// The owned slice of a vector stored beside master() (m or v).
absl::Span<const float> OwnedPart(const FlatParam& g, absl::Span<const float> beside_master) {
  return absl::MakeConstSpan(beside_master.data() + (g.owned_offset() - g.master_offset()),
                             g.owned_numel());
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

absl::StatusOr<CheckpointInfo> ReadCheckpointInfo(const std::string& dir) {
  GRADSUM_ASSIGN_OR_RETURN(MarkerRecord marker, ReadMarker(dir));
  CheckpointInfo info;
  info.step = marker.step;
  info.world = marker.world;
  info.extra = std::move(marker.extra);
  return info;
}

absl::StatusOr<CheckpointInfo> LoadCheckpoint(const std::string& dir, Communicator& world,
                                              ShardedAdamW& optimizer) {
  struct Staged {
    std::vector<float> master, exp_avg, exp_avg_sq;  // owned slices
  };
  std::vector<Staged> staged(optimizer.groups().size());
  CheckpointInfo info;
  std::vector<std::string> used_names;
  // Phase 1: read and validate everything locally; nothing is modified yet. Each live
  // group's owned slice is gathered parameter by parameter from wherever the saved layout
  // put it (any world size, EP size, unit grouping or sharding mode).
  std::vector<int64_t> used;  // per saved parameter (by name): found in a live group here
  auto read_all = [&]() -> absl::Status {
    GRADSUM_RETURN_IF_ERROR(CheckIdle(optimizer));
    GRADSUM_ASSIGN_OR_RETURN(MarkerRecord marker, ReadMarker(dir));
    info.step = marker.step;
    info.world = marker.world;
    GRADSUM_ASSIGN_OR_RETURN(SavedLayout saved, SavedLayout::Read(dir, marker));
    info.extra = std::move(marker.extra);
    std::set<std::string> live;
    for (size_t gi = 0; gi < optimizer.groups().size(); ++gi) {
      const FlatParam& g = *optimizer.groups()[gi];
      const int64_t begin = g.owned_offset(), end = begin + g.owned_numel();
      Staged& st = staged[gi];
      for (std::vector<float>* v : {&st.master, &st.exp_avg, &st.exp_avg_sq}) {
        v->resize(end - begin);
      }
      for (const FlatParamEntry& e : g.entries()) {
        live.insert(e.name);
        auto it = saved.params().find(e.name);
        if (it == saved.params().end()) {
          return absl::FailedPreconditionError(absl::StrCat("checkpoint '", dir,
                                                            "' has no parameter \"", e.name,
                                                            "\" (of unit \"", g.name(), "\")"));
        }
        const SavedLayout::Param& p = it->second;
        if (p.entry->shape != e.shape) {
          return absl::FailedPreconditionError(absl::StrCat(
              "checkpoint parameter \"", e.name, "\": shape is ", ShapeText(p.entry->shape),
              " in the checkpoint but ", ShapeText(e.shape), " now"));
        }
        const int64_t lo = std::max(begin, e.offset), hi = std::min(end, e.offset + e.numel);
        if (lo >= hi) continue;
        const int64_t from = p.entry->offset + (lo - e.offset);
        const std::pair<const char*, std::vector<float>*> parts[] = {
            {"master", &st.master}, {"exp_avg", &st.exp_avg}, {"exp_avg_sq", &st.exp_avg_sq}};
        for (const auto& [what, dest] : parts) {
          GRADSUM_RETURN_IF_ERROR(saved.ReadUnitRange(*p.unit, what, from, from + (hi - lo),
                                                      dest->data() + (lo - begin)));
        }
      }
    }
    for (const auto& [name, p] : saved.params()) {
      used.push_back(live.count(name));
      used_names.push_back(name);
    }
    return absl::OkStatus();
  };
  GRADSUM_RETURN_IF_ERROR(AgreeOnStatus(world, read_all(), "checkpoint load"));
  // A saved parameter that no rank's model has: the checkpoint is of another model.
  std::vector<int64_t> used_anywhere(used.size());
  if (!used.empty()) {
    GRADSUM_RETURN_IF_ERROR(
        world.AllReduce(used.data(), used_anywhere.data(), used.size(), DType::kI64));
  }
  for (size_t i = 0; i < used_anywhere.size(); ++i) {
    if (used_anywhere[i] == 0) {
      return MarkAgreed(absl::FailedPreconditionError(
          absl::StrCat("checkpoint '", dir, "' has parameter \"", used_names[i],
                       "\", which this model does not have")));
    }
  }

  // Phase 2: install. Replicated groups rebuild their full copies from every rank's slice,
  // HSDP groups their shard from its replicas' slices.
  absl::Status local = absl::OkStatus();
  for (size_t gi = 0; gi < optimizer.groups().size() && local.ok(); ++gi) {
    FlatParam& g = *optimizer.groups()[gi];
    const std::pair<std::vector<float>*, absl::Span<float>> parts[] = {
        {&staged[gi].master, g.master()},
        {&staged[gi].exp_avg, optimizer.exp_avg(gi)},
        {&staged[gi].exp_avg_sq, optimizer.exp_avg_sq(gi)},
    };
    for (const auto& [slice, dest] : parts) {
      const bool sharded = g.options().mode == ShardingMode::kSharded;
      Communicator* over = sharded ? g.replica_group() : g.group();
      if (over == nullptr || over->size() == 1) {
        std::copy(slice->begin(), slice->end(), dest.begin());
        continue;
      }
      const int64_t piece = g.padded_numel() / g.owned_group_size();
      std::vector<float> send(piece, 0.0f);
      std::copy(slice->begin(), slice->end(), send.begin());
      std::vector<float> gathered(piece * over->size());
      local = over->AllGather(send.data(), gathered.data(), piece, DType::kF32);
      if (!local.ok()) break;
      std::copy(gathered.begin(), gathered.begin() + dest.size(), dest.begin());
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
  const int64_t step = marker.step;
  GRADSUM_ASSIGN_OR_RETURN(SavedLayout saved, SavedLayout::Read(dir, marker));
  // Each parameter read from the shards that hold it (the resharding rule with one rank).
  std::vector<std::vector<float>> values;
  std::vector<std::vector<BF16>> halves;
  SafetensorsWriter writer;
  for (const auto& [name, p] : saved.params()) {
    const FlatParamEntry& e = *p.entry;
    values.emplace_back(e.numel);
    GRADSUM_RETURN_IF_ERROR(
        saved.ReadUnitRange(*p.unit, "master", e.offset, e.offset + e.numel, values.back().data()));
    void* base = values.back().data();
    if (dtype == DType::kBF16) {
      halves.emplace_back(e.numel);
      for (int64_t i = 0; i < e.numel; ++i) halves.back()[i] = BF16::FromFloat(values.back()[i]);
      base = halves.back().data();
    }
    GRADSUM_ASSIGN_OR_RETURN(TensorView view,
                             TensorView::Create(e.numel > 0 ? base : nullptr, dtype, e.shape));
    absl::Status s = writer.Add(e.name, view);
    if (!s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", dir, "': parameter \"",
                                                        e.name, "\" of group \"", p.unit->name,
                                                        "\" cannot be exported: ", s.message()));
    }
  }
  GRADSUM_RETURN_IF_ERROR(writer.AddMetadata("format", "pt"));
  GRADSUM_RETURN_IF_ERROR(writer.AddMetadata("step", absl::StrCat(step)));
  return writer.WriteFile(out_path);
}

}  // namespace gradsum
