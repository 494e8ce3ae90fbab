#include "train/rank_main.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/status.h"
#include "data/markov.h"
#include "train/config.h"
#include "train/fault_injection.h"
#include "train/moe_lm.h"

namespace gradsum::train {

absl::StatusOr<int> ResolveShardGroup(Communicator& world, const ParallelismConfig& parallelism) {
  int n = parallelism.shard_group();
  if (n == 0) {
    // The ranks of this rank's host: Open MPI says how many; the thread backend is one host.
    n = world.size();
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    int v = 0;
    if (world.backend() == "mpi" && local != nullptr && absl::SimpleAtoi(local, &v) && v > 0) {
      n = v;
    }
    int64_t mine[2] = {n, -int64_t{n}}, all[2] = {0, 0};
    GRADSUM_RETURN_IF_ERROR(world.AllReduce(mine, all, 2, DType::kI64, ReduceOp::kMax));
    if (all[0] != -all[1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parallelism.shard_group=0 (the ranks of one host): hosts run between ", -all[1], " and ",
          all[0], " ranks; give parallelism.shard_group (--shard_group) explicitly"));
    }
  }
  if (n < 1 || world.size() % n != 0 || n % parallelism.ep() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallelism.shard_group=", parallelism.shard_group(),
                     " gives shard groups of ", n, " ranks: must divide the world's ", world.size(),
                     " ranks and be a multiple of "
                     "parallelism.ep=",
                     parallelism.ep()));
  }
  return n;
}

MeshShape MeshShapeOf(const ParallelismConfig& parallelism, int shard_group) {
  return MeshShape{.ep = parallelism.ep(),
                   .sp = parallelism.sp(),
                   .cp = parallelism.cp(),
                   .shard_group = shard_group};
}

MeshSplitFn TimedMeshSplit(TimedCommunicator* timed) {
  return [timed](Communicator& world, MeshAxis axis, int color,
                 int key) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    if (&world != timed || (axis != MeshAxis::kSp && axis != MeshAxis::kCp)) {
      return world.Split(color, key);
    }
    if (axis == MeshAxis::kSp) return timed->SplitAs(color, key, CommKind::kSpAllToAll);
    // The test-only fault hook may stop a rank inside the ring's exchange (mode ringstop).
    absl::StatusOr<std::unique_ptr<Communicator>> cp =
        timed->SplitAs(color, key, CommKind::kCpRing);
    if (!cp.ok()) return cp;
    return WithRingFault(std::move(*cp));
  };
}

absl::StatusOr<RankMesh> MakeRankMesh(Communicator* world, const ParallelismConfig& parallelism) {
  if (world == nullptr) return absl::InvalidArgumentError("null world communicator");
  if (world->size() != parallelism.world()) {
    return absl::InvalidArgumentError(absl::StrCat("parallelism.world=", parallelism.world(),
                                                   ": the backend has ", world->size(), " ranks"));
  }
  RankMesh mesh;
  mesh.timer = std::make_shared<CommTimer>();
  mesh.world = std::make_unique<TimedCommunicator>(world, mesh.timer);
  int shard_group = 0;
  if (parallelism.sharding() == TrainConfig::hsdp) {
    GRADSUM_ASSIGN_OR_RETURN(shard_group, ResolveShardGroup(*world, parallelism));
  }
  GRADSUM_ASSIGN_OR_RETURN(mesh.mesh,
                           Mesh::Create(mesh.world.get(), MeshShapeOf(parallelism, shard_group),
                                        TimedMeshSplit(mesh.world.get())));
  return mesh;
}

absl::Status RunRank(const TrainConfig& config, Communicator* world, std::ostream* log,
                     const ParityCheckFn& parity_check) {
  GRADSUM_ASSIGN_OR_RETURN(RankMesh mesh, MakeRankMesh(world, config.parallelism()));
  if (log != nullptr && mesh.mesh->shard_size() > 0) {
    // shard_group 0 is resolved from the hosts: say what it became.
    const int n = mesh.mesh->shard_size();
    *log << absl::StrFormat("hsdp: shard groups of %d consecutive ranks, replicated %d times\n", n,
                            mesh.mesh->world_size() / n);
  }
  RankComms comms = mesh.comms();
  comms.parity_check = parity_check;
  GRADSUM_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(config, comms));
  return trainer->Run(log).status();
}

void PrintBanner(const TrainConfig& config, std::ostream& out) {
  const ModelConfig& m = config.model();
  int64_t params = 0;
  for (const auto& [name, shape] : MoeLmParamShapes(m)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    params += n;
  }
  const ParallelismConfig& p = config.parallelism();
  out << absl::StrFormat(
      "moe_lm: %d steps; AdamW lr %g (warmup %d), clip %g; compute %s, reduce %s; "
      "CE weights %s; alpha_b %g, alpha_z %g; seed %d\n",
      config.optim().steps(), config.optim().lr(), config.optim().warmup_steps(),
      config.optim().grad_clip(), TrainConfig::FloatDType_Name(config.precision().compute_dtype()),
      TrainConfig::FloatDType_Name(config.precision().reduce_dtype()),
      TrainConfig::CeMode_Name(config.loss().ce_mode()), config.loss().alpha_b(),
      config.loss().alpha_z(), m.seed());
  const OptimConfig& optim = config.optim();
  if (optim.lr_decay() != OptimConfig::constant) {
    out << absl::StrFormat("moe_lm: learning rate %s decay to %g at step %d\n",
                           OptimConfig::LrDecay_Name(optim.lr_decay()), optim.min_lr(),
                           optim.decay_steps() > 0 ? optim.decay_steps() : optim.steps());
  }
  if (optim.weight_decay() > 0) {
    out << absl::StrFormat("moe_lm: weight decay %g on %s\n", optim.weight_decay(),
                           optim.decay_norms() ? "every parameter"
                                               : "the matrices and the embedding (not the norm "
                                                 "gains)");
  }
  if (config.log().eval_every() > 0) {
    out << absl::StrFormat(
        "moe_lm: held-out CE every %d steps and after the last: %d micro-batch(es) per data "
        "rank of %s\n",
        config.log().eval_every(), config.log().eval_micro_batches(),
        !config.data().data_path().empty()
            ? absl::StrCat("the validation part (--split=", config.data().split(),
                           ") of --data_path")
        : config.data().path().empty() ? std::string("the embedded corpus's held-out documents")
                                       : absl::StrCat("--eval_data=", config.data().eval_path()));
  }
  const LossConfig& loss = config.loss();
  if (loss.label_smoothing() != 0 || loss.logit_softcap() != 0 || loss.alpha_lse() != 0) {
    // Only when on, so that the default banner is unchanged.
    out << absl::StrFormat(
        "CE options (SEMANTICS.md §3.2): label_smoothing %g, logit_softcap %g, "
        "alpha_lse %g\n",
        loss.label_smoothing(), loss.logit_softcap(), loss.alpha_lse());
  }
  if (loss.expert_bias_speed() != 0 || m.router_score() != ModelConfig::softmax) {
    // Only when on, so that the default banner is unchanged.
    out << absl::StrFormat("routing (SEMANTICS.md §5.1): %s scores, expert bias speed %g\n",
                           ModelConfig::RouterScore_Name(m.router_score()),
                           loss.expert_bias_speed());
  }
  const std::string attention =
      m.attention() == ModelConfig::none
          ? std::string()
          : absl::StrFormat(", attention %d heads (%d kv)", m.heads(), m.kv_heads());
  const std::string sp = absl::StrCat(p.sp() > 1 ? absl::StrFormat(", SP=%d", p.sp()) : "",
                                      p.cp() > 1 ? absl::StrFormat(", CP=%d", p.cp()) : "");
  const std::string recompute =
      p.recompute() == ParallelismConfig::none
          ? std::string()
          : absl::StrCat(", recompute ", ParallelismConfig::Recompute_Name(p.recompute()));
  out << absl::StrFormat(
      "model: V=%d D=%d L=%d E=%d K=%d H=%d%s, %d parameters; mesh F=%d x P=%d%s, G=%d, %s%s, "
      "backend %s\n",
      m.vocab(), m.dim(), m.layers(), m.experts(), m.top_k(), m.expert_dim(), attention, params,
      p.world() / p.ep(), p.ep(), sp, p.grad_acc(), TrainConfig::Sharding_Name(p.sharding()),
      recompute, TrainConfig::Backend_Name(config.comm().backend()));
  out << absl::StrFormat(
      "data: %d x %d tokens per rank and micro-batch, global batch B=%d sequences per "
      "step, %s\n",
      config.data().micro_batch(), config.data().seq_len(), GlobalBatch(config),
      !config.data().data_path().empty()
          ? absl::StrCat("--data_path=", config.data().data_path(), " (train part of --split=",
                         config.data().split(), ", shuffled each epoch)")
      : config.data().path().empty()
          ? (config.data().corpus() == DataConfig::markov1 ? "embedded Markov corpus"
                                                           : "embedded order-2 Markov corpus")
          : config.data().path());
  if (!ReadsDataFiles(config.data()) && config.data().corpus() == DataConfig::markov1) {
    data::MarkovCorpus corpus(config.data());
    out << absl::StrFormat(
        "entropy floor: %.4f nats/token (the Markov chain's conditional entropy; "
        "the best CE this per-token model can reach)\n",
        corpus.EntropyFloorNats());
  } else if (!ReadsDataFiles(config.data())) {
    data::SecondOrderMarkovCorpus corpus(config.data());
    out << absl::StrFormat(
        "entropy floor: %.4f nats/token (the best CE of a per-token model); context floor "
        "%.4f (the best of any model)\n",
        corpus.EntropyFloorNats(), corpus.ContextFloorNats());
  }
  // Generated from config.proto's (flag) options: every setting away from its default, as
  // the flags that give it, so the banner names each option without a line of its own.
  const std::string flags = NonDefaultFlags(config);
  out << "settings: " << (flags.empty() ? "all defaults" : flags) << "\n";
  out << std::flush;
}

absl::Status CatchExceptions(const std::function<absl::Status()>& f) {
  try {
    return f();
  } catch (const std::bad_alloc& e) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "out of memory (", e.what(), "): the run needs more memory than it could allocate"));
  } catch (const std::system_error& e) {
    if (e.code() == std::errc::resource_unavailable_try_again) {
      return absl::ResourceExhaustedError(
          absl::StrCat("could not start a thread (", e.what(), "); ", ThreadLimits(0)));
    }
    return absl::InternalError(absl::StrCat("uncaught exception: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("uncaught exception: ", e.what()));
  } catch (...) {
    return absl::InternalError("uncaught exception of unknown type");
  }
}

int64_t ThreadBackendThreads(const TrainConfig& config) {
  const int communicators = 3 + (config.parallelism().sp() > 1 ? 1 : 0) +
                            (config.parallelism().cp() > 1 ? 1 : 0) +
                            (config.parallelism().sharding() == TrainConfig::hsdp ? 4 : 0);
  return int64_t{config.parallelism().world()} * (1 + communicators);
}

absl::Status CheckThreadsCanStart(int64_t count, absl::string_view what) {
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(std::max<int64_t>(count, 0)));
  absl::Status status = absl::OkStatus();
  for (int64_t i = 0; i < count; ++i) {
    try {
      threads.emplace_back([&] {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return release; });
      });
    } catch (const std::system_error& e) {
      status = absl::ResourceExhaustedError(
          absl::StrCat("could not start ", what, ": the system refused thread ", i + 1, " of ",
                       count, " (", e.what(), "); ", ThreadLimits(count - i)));
      break;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  for (std::thread& t : threads) t.join();
  return status;
}

namespace {

// The first line of `path` as an integer, or -1 ("max", missing, unreadable).
int64_t ReadCount(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  int64_t v;
  if (!std::getline(in, text) || !absl::SimpleAtoi(text, &v)) return -1;
  return v;
}

// Threads of the processes whose real uid is `uid` (/proc/PID/status), what RLIMIT_NPROC
// counts.
int64_t ThreadsOfUser(uid_t uid) {
  int64_t threads = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    int64_t pid;  // processes only: not "self" or "thread-self", which repeat one
    if (!absl::SimpleAtoi(e.path().filename().string(), &pid)) continue;
    std::ifstream in(e.path() / "status");
    std::string line;
    bool mine = false;
    while (std::getline(in, line)) {
      int64_t v;
      if (absl::StartsWith(line, "Uid:")) {
        std::vector<std::string> f = absl::StrSplit(line.substr(4), '\t', absl::SkipWhitespace());
        mine = !f.empty() && absl::SimpleAtoi(f[0], &v) && v == uid;
      } else if (mine && absl::StartsWith(line, "Threads:") &&
                 absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(8)), &v)) {
        threads += v;
      }
    }
  }
  return threads;
}

// The pids cgroup of this process: its directory under /sys/fs/cgroup, or "".
std::string PidsCgroupDir() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  std::string v2;
  while (std::getline(in, line)) {
    const std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[1] == "pids") return absl::StrCat("/sys/fs/cgroup/pids", f[2]);  // v1
    if (f[0] == "0" && f[1].empty()) v2 = absl::StrCat("/sys/fs/cgroup", f[2]);
  }
  return v2;
}

}  // namespace

std::string ThreadLimits(int64_t more) {
  struct Limit {
    std::string text;
    bool reached;
  };
  std::vector<Limit> limits;
  auto add = [&](const std::string& name, int64_t limit, int64_t used, const std::string& what) {
    if (limit < 0) return;
    const bool reached = used >= 0 && used + more >= limit;
    limits.push_back({absl::StrCat(name, " is ", limit,
                                   used >= 0 ? absl::StrCat(" (", used, " ", what, ")") : "",
                                   reached ? ", reached" : ""),
                      reached});
  };
  struct rlimit nproc;
  if (::getrlimit(RLIMIT_NPROC, &nproc) == 0 && nproc.rlim_cur != RLIM_INFINITY &&
      ::getuid() != 0) {  // root is not bound by it
    add("RLIMIT_NPROC (ulimit -u)", static_cast<int64_t>(nproc.rlim_cur), ThreadsOfUser(::getuid()),
        absl::StrCat("processes and threads of uid ", ::getuid()));
  }
  int64_t system_threads = -1;
  {
    std::ifstream in("/proc/loadavg");  // "0.5 0.4 0.3 2/345 6789": 345 threads now
    std::string a, b, c, running;
    if (in >> a >> b >> c >> running) {
      const size_t slash = running.find('/');
      if (slash == std::string::npos ||
          !absl::SimpleAtoi(running.substr(slash + 1), &system_threads)) {
        system_threads = -1;
      }
    }
  }
  add("kernel.threads-max", ReadCount("/proc/sys/kernel/threads-max"), system_threads,
      "threads on the system");
  add("kernel.pid_max", ReadCount("/proc/sys/kernel/pid_max"), system_threads,
      "threads on the system");
  const std::string cgroup = PidsCgroupDir();
  if (!cgroup.empty()) {
    add(absl::StrCat("pids.max of cgroup ", cgroup), ReadCount(cgroup + "/pids.max"),
        ReadCount(cgroup + "/pids.current"), "in use");
  }
  std::stable_partition(limits.begin(), limits.end(), [](const Limit& l) { return l.reached; });
  std::vector<std::string> texts;
  for (const Limit& l : limits) texts.push_back(l.text);
  const bool any_reached = !limits.empty() && limits.front().reached;
  return absl::StrCat(
      "limits on threads: ", texts.empty() ? "none found" : absl::StrJoin(texts, "; "),
      any_reached ? ""
                  : " (none reached by this count; thread stacks' memory or "
                    "vm.max_map_count may be what refused)");
}

absl::StatusOr<ResourceEstimate> EstimateResources(const TrainConfig& config) {
  using LD = long double;
  const ModelConfig& m = config.model();
  const LD V = m.vocab(), D = m.dim(), L = m.layers(), E = m.experts(), K = m.top_k(),
           H = m.expert_dim(), P = config.parallelism().ep();
  // Tokens a rank holds per micro-batch: its share of each sequence under SP (§12).
  const LD T = LD{1} * config.data().micro_batch() * config.data().seq_len() /
               std::max(1, config.parallelism().sp()) / std::max(1, config.parallelism().cp());
  const LD G = config.parallelism().grad_acc();
  if (T > 2147483647.0L) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "data.micro_batch=%d x data.seq_len=%d = %.0Lf tokens per micro-batch: more than "
        "2^31 - 1",
        config.data().micro_batch(), config.data().seq_len(), T));
  }
  // MoeLmParamShapes, counted without building the list (which has L * E * 3 entries).
  const bool attention = m.attention() != ModelConfig::none;
  const LD kv_dim = attention && m.heads() > 0 ? LD{1} * m.kv_heads() * (m.dim() / m.heads()) : 0;
  const LD attention_params = attention ? D + 2 * D * D + 2 * D * kv_dim : 0;
  const LD dense = 2 * V * D + L * (D + D * E + attention_params) + D;
  const LD experts = L * E * 3 * D * H;
  ResourceEstimate r;
  r.params = dense + experts;
  if (r.params > 4611686018427387904.0L) {  // 2^62
    return absl::InvalidArgumentError(absl::StrFormat(
        "model.vocab=%d, model.dim=%d, model.layers=%d, model.experts=%d, model.expert_dim=%d "
        "give %.3Le parameters: more than 2^62",
        m.vocab(), m.dim(), m.layers(), m.experts(), m.expert_dim(), r.params));
  }
  const LD rank_params = dense + experts / P;
  const ParallelismConfig& p = config.parallelism();
  // hsdp shards dense units N ways and experts N / P ways: counted as N / P, an upper
  // estimate (shard_group 0, the ranks of a host: the world on the thread backend's one
  // host, else unknown here and counted as 1).
  const int hsdp_n = p.shard_group() > 0                              ? p.shard_group()
                     : config.comm().backend() == TrainConfig::thread ? p.world()
                                                                      : 1;
  const LD shard_ways = p.sharding() == TrainConfig::fsdp ? p.world()
                        : p.sharding() == TrainConfig::hsdp
                            ? std::max(1, hsdp_n / std::max(1, p.ep()))
                            : 1;
  // initial copy + compute copy + gradients, and master, exp_avg, exp_avg_sq slices (f32).
  r.parameter_bytes = 4 * rank_params * (3 + 3 / shard_ways);
  // Per token and layer: residual, norm, router logits and probabilities, each routed copy's
  // input, gate, up, activation and output; then the logits and their gradient.
  // With attention, per token and layer: its input, norm, q, k, v, output and the
  // residual after it, plus the softmax statistics per head (model/moe_lm.h).
  const LD attention_acts = attention ? 8 * D + m.heads() : 0;
  r.activation_bytes = 4 * T * (L * (4 * D + 2 * E + K * (2 * D + 3 * H) + attention_acts) + 3 * V);
  // tokens, labels, mask (i32) and sample ids (i64), twice (loader and model copies).
  r.batch_bytes = 2 * G * T * (3 * 4 + 8);
  const LD per_rank = r.parameter_bytes + r.activation_bytes + r.batch_bytes;
  const bool threads = config.comm().backend() == TrainConfig::thread;
  r.process_bytes = per_rank * (threads ? p.world() : 1);
  return r;
}

absl::Status CheckResourceBounds(const TrainConfig& config, uint64_t memory_bytes) {
  GRADSUM_ASSIGN_OR_RETURN(ResourceEstimate r, EstimateResources(config));
  if (r.process_bytes <= static_cast<long double>(memory_bytes)) return absl::OkStatus();
  const ModelConfig& m = config.model();
  const ParallelismConfig& p = config.parallelism();
  constexpr long double kGiB = 1024.0L * 1024 * 1024;
  return absl::ResourceExhaustedError(absl::StrFormat(
      "the run needs an estimated %.1Lf GiB per process, more than this machine's %.1Lf GiB: "
      "parameters %.1Lf GiB (%.3Le parameters from model.vocab=%d, model.dim=%d, "
      "model.layers=%d, model.experts=%d, model.expert_dim=%d, parallelism.ep=%d), activations "
      "%.1Lf GiB (data.micro_batch=%d x data.seq_len=%d tokens, model.top_k=%d), batch %.1Lf "
      "GiB (parallelism.grad_acc=%d)%s",
      r.process_bytes / kGiB, memory_bytes / kGiB, r.parameter_bytes / kGiB, r.params, m.vocab(),
      m.dim(), m.layers(), m.experts(), m.expert_dim(), p.ep(), r.activation_bytes / kGiB,
      config.data().micro_batch(), config.data().seq_len(), m.top_k(), r.batch_bytes / kGiB,
      p.grad_acc(),
      config.comm().backend() == TrainConfig::thread
          ? absl::StrCat(", per rank x parallelism.world=", p.world(), " thread ranks")
          : ""));
}

uint64_t MachineMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return UINT64_MAX;  // unknown: no bound
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

}  // namespace gradsum::train
