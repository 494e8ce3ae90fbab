#include "train/config_flags.h"

#include <cstdint>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

// Value flags are optional: unset (std::nullopt) unless given, so the defaults live only
// in config.proto and a flag never overrides a config file's value by its own default.
// --resume, --overwrite_checkpoints, --parity_check, --nccl_skip_agreement and --reproducible are
// switches: given, they set the field to true.
ABSL_FLAG(std::string, config, "", "textproto TrainConfig file (train/config.proto)");
ABSL_FLAG(std::optional<int32_t>, world, std::nullopt, "ranks (threads for --backend=thread)");
ABSL_FLAG(std::optional<int32_t>, ep, std::nullopt, "expert-parallel group size P");
ABSL_FLAG(std::optional<int32_t>, grad_acc, std::nullopt, "micro-batches per step G");
ABSL_FLAG(std::optional<int32_t>, steps, std::nullopt, "optimizer steps");
ABSL_FLAG(std::optional<std::string>, backend, std::nullopt, "thread | mpi | nccl");
ABSL_FLAG(std::optional<std::string>, sharding, std::nullopt, "fsdp | replicated | hsdp");
ABSL_FLAG(std::optional<int32_t>, shard_group, std::nullopt,
          "hsdp: ranks per shard group (consecutive; a multiple of --ep dividing --world); "
          "0: the ranks of one host");
ABSL_FLAG(std::optional<std::string>, ce_mode, std::nullopt,
          "cross-entropy token weights (SEMANTICS.md §3): token | sample | square");
ABSL_FLAG(std::optional<std::string>, reduce_dtype, std::nullopt,
          "gradient reduction dtype: f32 | bf16");
ABSL_FLAG(std::optional<std::string>, compute_dtype, std::nullopt,
          "parameter dtype forward reads: f32 | bf16");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt, "parameter initialisation seed");
ABSL_FLAG(std::optional<std::string>, data, std::nullopt,
          "byte-level text file, one document per line "
          "(default: the embedded Markov corpus)");
ABSL_FLAG(std::optional<std::string>, corpus, std::nullopt,
          "embedded corpus without --data: markov2 (default; second order: the previous "
          "token matters) | markov1 (first-order chain, the corpus before attention)");
ABSL_FLAG(std::optional<int32_t>, seq_len, std::nullopt, "tokens per packed sequence");
ABSL_FLAG(std::optional<int32_t>, max_doc_len, std::nullopt,
          "longest document of the embedded corpus (<= --seq_len)");
ABSL_FLAG(std::optional<int32_t>, micro_batch, std::nullopt, "sequences per rank per micro-batch");
ABSL_FLAG(std::optional<std::string>, dump_dir, std::nullopt,
          "write step-1 weights, batches, grads, losses here");
ABSL_FLAG(std::optional<std::string>, metrics, std::nullopt, "JSONL file, one line per step");
ABSL_FLAG(std::optional<int32_t>, eval_every, std::nullopt,
          "every N steps and after the last, the held-out CE (forward only; 0, the default: "
          "none)");
ABSL_FLAG(std::optional<int32_t>, eval_micro_batches, std::nullopt,
          "held-out micro-batches per data rank and evaluation (default 1)");
ABSL_FLAG(std::optional<std::string>, eval_data, std::nullopt,
          "held-out documents (a text file) for --eval_every with --data");
ABSL_FLAG(std::optional<int32_t>, log_every, std::nullopt,
          "print the log line of step 1, every N-th step and the last (default 1: every step)");
ABSL_FLAG(std::optional<std::string>, checkpoint_dir, std::nullopt, "sharded checkpoints");
ABSL_FLAG(std::optional<int32_t>, checkpoint_every, std::nullopt,
          "steps between checkpoints (0: at the end only)");
ABSL_FLAG(bool, save_on_signal, false,
          "on SIGTERM or SIGUSR1 finish the step, save a checkpoint in --checkpoint_dir and "
          "exit (every rank; a preemption notice)");
ABSL_FLAG(std::optional<int32_t>, keep_checkpoints, std::nullopt,
          "keep only the newest N complete checkpoints in --checkpoint_dir (0, the default: all)");
ABSL_FLAG(bool, resume, false,
          "continue from the latest checkpoint in --checkpoint_dir (written on any mesh with "
          "the same model and global batch world x grad_acc x micro_batch)");
ABSL_FLAG(bool, overwrite_checkpoints, false,
          "a fresh run into a --checkpoint_dir that holds another run's checkpoints removes "
          "them at start-up (without it the run is refused; --resume continues that run)");
ABSL_FLAG(std::optional<std::string>, export, std::nullopt,
          "at the end of training, write the full fp32 parameters to this safetensors file");
ABSL_FLAG(std::optional<std::string>, init_from, std::nullopt,
          "start from the parameters of a --export file, with fresh optimizer state");
ABSL_FLAG(bool, nccl_skip_agreement, false,
          "backend=nccl: no per-collective agreement check (faster; mismatched ranks then fail "
          "inside NCCL or hang until the timeout instead of naming the mismatch)");
ABSL_FLAG(bool, parity_check, false,
          "compare step 1's gradients with the single-process reference; fail above 1e-5");
ABSL_FLAG(bool, reproducible, false,
          "bitwise-reproducible training: the same bits at every mesh with the same global "
          "batch (docs/REPRODUCIBILITY.md); thread and mpi backends");
ABSL_FLAG(std::optional<double>, alpha_b, std::nullopt,
          "load-balancing loss weight (SEMANTICS.md §5)");
ABSL_FLAG(std::optional<double>, alpha_z, std::nullopt, "router z-loss weight (SEMANTICS.md §4)");
ABSL_FLAG(
    std::optional<double>, label_smoothing, std::nullopt,
    "CE label smoothing eps in [0, 1) over the whole vocabulary (SEMANTICS.md §3.2; 0 = off)");
ABSL_FLAG(std::optional<double>, logit_softcap, std::nullopt,
          "CE logit softcap c: the loss sees c tanh(z / c) (SEMANTICS.md §3.2; 0 = off)");
ABSL_FLAG(std::optional<double>, alpha_lse, std::nullopt,
          "output z-loss weight: alpha_lse * logsumexp(logits)^2 per token (SEMANTICS.md §3.2; "
          "0 = off)");
ABSL_FLAG(std::optional<double>, expert_bias_speed, std::nullopt,
          "aux-loss-free balancing (SEMANTICS.md §5.1): each step, every layer's expert bias "
          "moves by this much towards balance (b_e += u sign(mean c - c_e)); the bias moves "
          "the top-K selection only; 0 = off, the default");
ABSL_FLAG(std::optional<int>, mtp_depth, std::nullopt,
          "multi-token prediction depths k (SEMANTICS.md §15.1, DeepSeek-V3): depth j predicts "
          "the token j + 1 ahead through its own block and the shared head; 0 = off, the "
          "default; CPU ops only");
ABSL_FLAG(std::optional<double>, mtp_scale, std::nullopt,
          "MTP loss weight: L_mtp = mtp_scale / k * sum_j L_j, in (0, k] (SEMANTICS.md §15; "
          "default 0.1)");
ABSL_FLAG(std::optional<std::string>, router_score, std::nullopt,
          "softmax (default) | sigmoid: the router's scores (SEMANTICS.md §5.1; sigmoid needs "
          "--alpha_b=0)");
ABSL_FLAG(std::optional<double>, lr, std::nullopt, "AdamW learning rate");
ABSL_FLAG(std::optional<int32_t>, warmup_steps, std::nullopt, "linear learning-rate warmup steps");
ABSL_FLAG(std::optional<std::string>, lr_decay, std::nullopt,
          "constant (default) | cosine | linear: the learning rate after the warmup, decayed "
          "to --min_lr at step --decay_steps (train/lr_schedule.h)");
ABSL_FLAG(std::optional<double>, min_lr, std::nullopt,
          "the learning rate the decay ends at, in [0, --lr] (default 0)");
ABSL_FLAG(std::optional<int32_t>, decay_steps, std::nullopt,
          "the step the decay reaches --min_lr (0, the default: --steps)");
ABSL_FLAG(std::optional<double>, weight_decay, std::nullopt,
          "AdamW decoupled weight decay (matrices and the embedding; see --decay_norms)");
ABSL_FLAG(std::optional<bool>, decay_norms, std::nullopt,
          "apply --weight_decay to the RMSNorm gains too (default false: they are exempt)");
ABSL_FLAG(std::optional<double>, grad_clip, std::nullopt, "max global gradient norm (0 disables)");
ABSL_FLAG(std::optional<int32_t>, vocab, std::nullopt, "V");
ABSL_FLAG(std::optional<int32_t>, dim, std::nullopt, "D");
ABSL_FLAG(std::optional<int32_t>, layers, std::nullopt, "L");
ABSL_FLAG(std::optional<int32_t>, experts, std::nullopt, "E");
ABSL_FLAG(std::optional<int32_t>, top_k, std::nullopt, "K");
ABSL_FLAG(std::optional<int32_t>, expert_dim, std::nullopt, "H");
ABSL_FLAG(std::optional<bool>, norm_topk_prob, std::nullopt,
          "renormalise the top-k router weights");
ABSL_FLAG(std::optional<double>, router_scale, std::nullopt, "router weight scale");
ABSL_FLAG(
    std::optional<std::string>, attention, std::nullopt,
    "causal (default) | none: each layer's document-causal attention block (SEMANTICS.md §10), or "
    "the per-token model");
ABSL_FLAG(std::optional<int32_t>, heads, std::nullopt, "attention query heads");
ABSL_FLAG(std::optional<int32_t>, kv_heads, std::nullopt, "attention key/value heads (GQA)");
ABSL_FLAG(std::optional<double>, rope_theta, std::nullopt, "RoPE base");
ABSL_FLAG(std::optional<int32_t>, sp, std::nullopt,
          "sequence-parallel group size S (Ulysses, SEMANTICS.md §12)");
ABSL_FLAG(std::optional<int32_t>, cp, std::nullopt,
          "context-parallel group size C (ring attention over zigzag chunks, SEMANTICS.md §16)");
ABSL_FLAG(std::optional<int32_t>, repro_block, std::nullopt,
          "--reproducible: tokens per contribution block (0: a rank's share of a sequence); "
          "the same bits at every --sp whose seq_len / sp it divides");
ABSL_FLAG(std::optional<double>, timeout_s, std::nullopt,
          "seconds a rank waits for the others in a collective before the run fails "
          "(DeadlineExceeded); a failure then ends every rank");
ABSL_FLAG(std::optional<int32_t>, layers_per_unit, std::nullopt,
          "wrap policy: layers per FlatParam unit");
ABSL_FLAG(std::optional<bool>, reshard_after_forward, std::nullopt,
          "fsdp: free each unit after its forward, re-gather it for backward");
ABSL_FLAG(std::optional<std::string>, recompute, std::nullopt,
          "none (default) | selective | full: activation recomputation per layer (full keeps "
          "only each layer's input and re-runs its forward in backward; selective re-runs the "
          "norms); the same bits, less activation memory");
ABSL_FLAG(std::optional<bool>, reduce_every_micro_batch, std::nullopt,
          "fsdp: reduce-scatter every micro-batch (false: only the last one)");
ABSL_FLAG(std::optional<double>, bucket_cap_mb, std::nullopt, "replicated: gradient bucket cap");
ABSL_FLAG(std::optional<double>, first_bucket_mb, std::nullopt,
          "replicated: cap of the first gradient bucket");

namespace gradsum::train {

const std::vector<FlagField>& OverridableFlags() {
  static const auto* flags = new std::vector<FlagField>{
      {"world", "parallelism.world"},
      {"ep", "parallelism.ep"},
      {"grad_acc", "parallelism.grad_acc"},
      {"steps", "optim.steps"},
      {"backend", "comm.backend"},
      {"sharding", "parallelism.sharding"},
      {"shard_group", "parallelism.shard_group"},
      {"ce_mode", "loss.ce_mode"},
      {"reduce_dtype", "precision.reduce_dtype"},
      {"compute_dtype", "precision.compute_dtype"},
      {"seed", "model.seed"},
      {"data", "data.path"},
      {"corpus", "data.corpus"},
      {"seq_len", "data.seq_len"},
      {"micro_batch", "data.micro_batch"},
      {"max_doc_len", "data.max_doc_len"},
      {"dump_dir", "debug.dump_dir"},
      {"metrics", "log.metrics"},
      {"log_every", "log.every"},
      {"eval_every", "log.eval_every"},
      {"eval_micro_batches", "log.eval_micro_batches"},
      {"eval_data", "data.eval_path"},
      {"checkpoint_dir", "checkpoint.dir"},
      {"checkpoint_every", "checkpoint.every"},
      {"keep_checkpoints", "checkpoint.keep"},
      {"save_on_signal", "checkpoint.save_on_signal"},
      {"resume", "checkpoint.resume"},
      {"overwrite_checkpoints", "checkpoint.overwrite"},
      {"export", "checkpoint.export_path"},
      {"init_from", "checkpoint.init_from"},
      {"parity_check", "debug.parity_check"},
      {"nccl_skip_agreement", "comm.nccl_skip_agreement"},
      {"reproducible", "precision.reproducible"},
      {"alpha_b", "loss.alpha_b"},
      {"alpha_z", "loss.alpha_z"},
      {"label_smoothing", "loss.label_smoothing"},
      {"logit_softcap", "loss.logit_softcap"},
      {"alpha_lse", "loss.alpha_lse"},
      {"expert_bias_speed", "loss.expert_bias_speed"},
      {"router_score", "model.router_score"},
      {"mtp_depth", "model.mtp_depth"},
      {"mtp_scale", "loss.mtp_scale"},
      {"lr", "optim.lr"},
      {"warmup_steps", "optim.warmup_steps"},
      {"lr_decay", "optim.lr_decay"},
      {"min_lr", "optim.min_lr"},
      {"decay_steps", "optim.decay_steps"},
      {"weight_decay", "optim.weight_decay"},
      {"decay_norms", "optim.decay_norms"},
      {"grad_clip", "optim.grad_clip"},
      {"vocab", "model.vocab"},
      {"dim", "model.dim"},
      {"layers", "model.layers"},
      {"experts", "model.experts"},
      {"top_k", "model.top_k"},
      {"expert_dim", "model.expert_dim"},
      {"norm_topk_prob", "model.norm_topk_prob"},
      {"router_scale", "model.router_scale"},
      {"attention", "model.attention"},
      {"heads", "model.heads"},
      {"kv_heads", "model.kv_heads"},
      {"rope_theta", "model.rope_theta"},
      {"sp", "parallelism.sp"},
      {"cp", "parallelism.cp"},
      {"repro_block", "precision.repro_block"},
      {"timeout_s", "comm.timeout_s"},
      {"layers_per_unit", "parallelism.layers_per_unit"},
      {"reshard_after_forward", "parallelism.reshard_after_forward"},
      {"reduce_every_micro_batch", "parallelism.reduce_every_micro_batch"},
      {"recompute", "parallelism.recompute"},
      {"bucket_cap_mb", "comm.bucket_cap_mb"},
      {"first_bucket_mb", "comm.first_bucket_mb"},
  };
  return *flags;
}

absl::StatusOr<TrainConfig> ConfigFromFlags() {
  TrainConfig config;
  const std::string path = absl::GetFlag(FLAGS_config);
  if (!path.empty()) {
    GRADSUM_ASSIGN_OR_RETURN(config, LoadConfigFile(path));
  }
  std::vector<FieldOverride> overrides;
  for (const FlagField& ff : OverridableFlags()) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(ff.flag);
    if (flag == nullptr) {
      return absl::InternalError(absl::StrCat("flag --", ff.flag, " is not defined"));
    }
    // An unset optional flag prints as ""; a switch that was not given prints "false".
    const std::string value = flag->CurrentValue();
    const bool is_switch = flag->IsOfType<bool>();
    if (is_switch ? value == "true" : !value.empty()) {
      overrides.push_back({ff.field_path, value});
    }
  }
  GRADSUM_RETURN_IF_ERROR(ApplyOverrides(overrides, &config));
  GRADSUM_RETURN_IF_ERROR(ValidateConfig(config));
  return ResolvedConfig(config);
}

}  // namespace gradsum::train
