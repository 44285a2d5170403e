// The Muon optimizer (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural
// networks"; Megatron-LM's --optimizer muon over NVIDIA's emerging_optimizers TensorParallelMuon):
// momentum orthogonalised by a Newton-Schulz iteration, for the 2-D weight matrices of the
// transformer layers, AdamW for the rest (optim/optimizer.h owns both; docs/optimizer.md).
//
// Per Muon matrix W [r, c] with gradient G (unscaled and clipped as AdamW's):
//   M = beta M + (1 - beta) G;  U = nesterov ? (1 - beta) G + beta M : M       (ops/muon.h)
//   O = NS(U) · scale(r, c) · extra_scale_factor
//   W = W - lr (O + wd W)                                        (decoupled weight decay)
// NS(U) ≈ the orthogonal polar factor of U: X = U / max(|U|_F, 1e-7), then per step i with
// the coefficient set's (a, b, c)_i: A = X X^T, B = b A + c A A, X = a X + B X (the Gram matrix
// of the shorter side: X^T X and X = a X + X B for a tall X). fp32 on the CPU, bf16 GEMMs with
// fp32 accumulation on CUDA (Megatron's --muon-fp32-matmul-prec medium).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "core/stream.h"
#include "model/params.h"

namespace mt {

class GradSync;

/// --muon-scale-mode: the update scale of a [rows, cols] matrix (muon_scale_factor).
enum class MuonScaleMode : uint8_t { kSpectral, kUnitRmsNorm, kShapeScaling };
/// --muon-coefficient-type: the Newton-Schulz coefficient set (ns_coefficients).
enum class MuonCoefficientType : uint8_t { kSimple, kQuintic, kPolarExpress, kAol };
/// --muon-tp-mode: how a tensor-parallel shard is orthogonalised (MuonStep).
enum class MuonTpMode : uint8_t { kDuplicated, kBlockwise, kDistributed };

/// Parse a flag value (Megatron's spelling, e.g. "unit_rms_norm", "polar_express", "distributed").
/// Errors: mt::Error naming the flag, the bad value and the accepted ones.
MuonScaleMode parse_muon_scale_mode(const std::string& s);
MuonCoefficientType parse_muon_coefficient_type(const std::string& s);
MuonTpMode parse_muon_tp_mode(const std::string& s);
/// The flag spelling of a value (inverse of the parse_* functions).
const char* muon_scale_mode_name(MuonScaleMode m);
const char* muon_coefficient_type_name(MuonCoefficientType t);
const char* muon_tp_mode_name(MuonTpMode m);

/// Megatron-LM's --muon-* options (megatron/training/arguments.py, OptimizerConfig).
struct MuonConfig {
  float momentum = 0.9f;                        ///< --muon-momentum (Megatron's flag default)
  bool nesterov = false;                        ///< --muon-nesterov (alias --muon-use-nesterov)
  int num_ns_steps = 5;                         ///< --muon-num-ns-steps
  MuonScaleMode scale_mode = MuonScaleMode::kSpectral;  ///< --muon-scale-mode spectral|unit_rms_norm|shape_scaling
  float extra_scale_factor = 1.f;               ///< --muon-extra-scale-factor
  /// --muon-coefficient-type simple|quintic|polar_express|aol
  MuonCoefficientType coefficient_type = MuonCoefficientType::kQuintic;
  MuonTpMode tp_mode = MuonTpMode::kDuplicated;  ///< --muon-tp-mode duplicated|blockwise|distributed
  bool split_qkv = true;                        ///< false with --muon-no-split-qkv
  /// Rows of one query group's Q, K and V in the fused linear_qkv weight (heads per group · head
  /// dim, head dim, head dim; Megatron's _get_qkv_split_shapes), set from the model configuration.
  /// 0 = unknown: linear_qkv is orthogonalised whole.
  int64_t qkv_q_rows = 0, qkv_kv_rows = 0;
};

/// Errors (mt::Error naming the flag and value): momentum outside [0, 1), num_ns_steps < 1 or a
/// step count the coefficient set does not allow (ns_coefficients), a negative extra scale factor.
void validate_muon_config(const MuonConfig& c);

/// One Newton-Schulz step's quintic coefficients: X = a X + (b A + c A²) X with A = X X^T.
struct NsCoeff {
  float a, b, c;
};

/// The per-step coefficients of `type` for `steps` steps (emerging_optimizers' sets):
///   simple: (3.4445, -4.7750, 2.0315) every step (Jordan's classic quintic, modded-nanogpt);
///   quintic: 5 tuned steps (Cesista's optimisation, modded-nanogpt's medium run), steps % 5 == 0;
///   polar_express: the 8 steps of Amsel et al. 2025 (arXiv:2505.16932), steps >= 8, the last
///     repeated beyond 8;
///   aol: 4 steps, steps % 4 == 0.
/// Errors: mt::Error for a step count the set does not allow.
std::vector<NsCoeff> ns_coefficients(MuonCoefficientType type, int steps);

/// The update scale of a [rows, cols] matrix (emerging_optimizers get_muon_scale_factor):
/// spectral sqrt(max(rows, cols)); unit_rms_norm sqrt(rows / cols); shape_scaling
/// sqrt(max(1, rows / cols)).
double muon_scale_factor(MuonScaleMode mode, int64_t rows, int64_t cols);

/// Muon takes the 2-D weight matrices of the transformer layers: every 2-D parameter except the
/// embeddings (word and position), the output layer, its tied copy and the MoE router (Megatron
/// also excludes embeddings, the output layer and 1-D parameters; it would give the router to
/// Muon, megatron.cpp keeps it on AdamW as the issue asks).
bool is_muon_parameter(const ParamInfo& p);

/// Workspace of the Newton-Schulz iteration, planned once for the largest matrix and Gram
/// matrix (no allocation in a step). Compute dtype: fp32 on the CPU, bf16 on CUDA.
class NewtonSchulz {
 public:
  NewtonSchulz(Device device, DType compute, int64_t max_elements, int64_t max_gram, const Stream& stream);
  /// out = NS(g): g, out fp32 [rows·cols] (row-major [rows, cols]; out may be g). With `group`
  /// (the distributed TP mode) g is this rank's shard of a matrix split along `split_dim` (0 rows,
  /// 1 columns) over the group: the sum of squares and the Gram matrix (over the unsplit side)
  /// are all-reduced, every rank computing its shard of the result. Errors: mt::Error when the
  /// matrix or its Gram matrix exceeds the workspace, or split_dim is not 0/1 with a group.
  void run(const Tensor& out, const Tensor& g, int64_t rows, int64_t cols, const std::vector<NsCoeff>& coeffs,
           const Stream& stream, Communicator* group = nullptr, int split_dim = -1);
  /// run() over several matrices of one shape at once (strided-batched GEMMs; ops/matmul.h):
  /// outs[i] = NS(gs[i]), each normalised by its own norm. A group allows one matrix only. Errors:
  /// as run(), and when the batch exceeds the workspace.
  void run_batch(const std::vector<Tensor>& outs, const std::vector<Tensor>& gs, int64_t rows, int64_t cols,
                 const std::vector<NsCoeff>& coeffs, const Stream& stream, Communicator* group = nullptr,
                 int split_dim = -1);
  DType compute_dtype() const { return compute_; }

 private:
  DType compute_;
  int64_t max_elements_, max_gram_;
  Buffer x_, xn_, a_, b_, norm_;
};

/// Elements of the Newton-Schulz workspace: the matrix (compute dtype, two copies), the Gram
/// matrix (two), and fp32 staging of a QKV component, the TP gather and the rearranged gather.
struct MuonWorkspace {
  int64_t ns = 0, gram = 0, stage = 0, gather = 0, full = 0;
  size_t bytes(DType compute) const;
};

/// Muon's memory on one rank beyond AdamW's, for the memory estimate (train/memory_estimate.h):
/// the elements of the Muon matrices (dense, expert; their exp_avg_sq is not allocated: one
/// momentum buffer instead of two moments) and the Newton-Schulz workspace when the rank
/// orthogonalises every matrix (an upper bound with the distributed optimizer). specs: the rank's
/// parameters; tp, etp: the tensor-parallel sizes of the dense and expert parameters.
/// Also the Newton-Schulz FLOPs of one optimizer step on this rank when it orthogonalises every
/// matrix (dense, expert; `megatron plan` divides them over the DP / EDP ranks with the
/// distributed optimizer): per matrix num_ns_steps x (4 k^2 n + 2 k^3), k the Gram side and n the
/// other of the matrix the rank iterates (MuonStep::plan_units: duplicated the global matrix,
/// distributed the shard with the Gram matrix of the unsplit side, blockwise the shard).
struct MuonMemory {
  int64_t dense_elements = 0, expert_elements = 0;
  size_t workspace_bytes = 0;
  double dense_ns_flops = 0, expert_ns_flops = 0;
};
MuonMemory muon_memory(const std::vector<ParamSpec>& specs, const MuonConfig& config, int tp, int etp, Device device);

/// A run of owned elements of a Muon parameter: flat [begin, begin + n), state index `state`
/// (where its momentum lives in the optimizer's exp_avg).
struct MuonPiece {
  int64_t begin, n, state;
};

/// The Muon part of an optimizer step: the momentum of the owned elements, the orthogonalised,
/// scaled updates written over the gradients of the Muon parameters (then applied by the
/// owning AdamWOptimizer with AdamWHyper::precomputed_update). Tensor parallel shards follow
/// --muon-tp-mode; with the distributed optimizer each whole Muon matrix is orthogonalised by one
/// data-parallel rank (greedy balance of the NS FLOPs) after the momentum of the owned slices
/// is all-gathered, and broadcast from it. Statically planned at construction.
///
/// Pipelining (distributed optimizer; docs/optimizer.md "Pipelining Muon's traffic"): the
/// all-gathers of U and the broadcasts run on GradSync's communication stream beside the
/// Newton-Schulz batches on the compute stream, in a program planned once (program()):
///   1. the communication stream waits for the momentum (an event on the compute stream), then
///      all-gathers the Muon buckets in the order the batches read them (ascending parameters:
///      descending bucket index), an event after each;
///   2. the batches run in that order too (plan_batches' batches stably sorted by the last
///      bucket they read; each matrix's iteration is independent, so no value changes), each
///      after the compute stream waited for the all-gather of the last bucket it reads;
///   3. the broadcasts are issued in one order on every rank (by the estimated finish time of
///      the matrix on its owner: the cumulated NS FLOPs of the owner's batches, computed from
///      global shapes; then expert, owner, parameter), one NCCL group per run of matrices of one
///      owner finishing together, each after an event of the batch that completed its matrices
///      on the owner, as soon as the host has issued that batch;
///   4. the compute stream waits for the communication stream before step() returns (the
///      update reads the broadcast gradients; start_param_sync follows on either stream).
/// The order of the collectives on every communicator is therefore the same on every rank (a
/// total order of all ranks' collectives: no deadlock, also on CPU ranks where collectives
/// block). Without the distributed optimizer everything runs on the compute stream in
/// plan_batches' order.
class MuonStep {
 public:
  /// tp, etp: the tensor-parallel groups of the dense and the expert parameters (nullptr = size
  /// 1). pieces: the owned runs of every Muon parameter (ascending). Errors: validate_muon_config's.
  MuonStep(ParamStore& params, GradSync& sync, const MuonConfig& config, std::shared_ptr<Communicator> tp,
           std::shared_ptr<Communicator> etp, std::vector<MuonPiece> pieces, const Stream& stream);
  ~MuonStep();
  /// grads: fp32 [total] (the reduced gradients; Muon ranges overwritten with the updates);
  /// momentum: the optimizer's exp_avg, fp32 [owned elements]; scalars: OptimizerScalars bytes
  /// after optimizer_prepare.
  void step(const Tensor& grads, const Tensor& momentum, const Tensor& scalars, const Stream& stream);
  /// Parameters (ParamStore indices) whose matrices this rank orthogonalises.
  const std::vector<size_t>& owned_matrices() const { return mine_; }
  /// The data-parallel rank that orthogonalises parameter i (0 without the distributed optimizer).
  int owner_of(size_t i) const;

  struct Unit;  // one matrix to orthogonalise (a whole parameter or a QKV component)
  /// Appends the units of parameter `index` (spec p, TP size tp_size of its group) and grows `ws`
  /// to hold them.
  /// The FLOPs of one Newton-Schulz step of unit u on its rank (X X^T, b A + c A A, a X + B X:
  /// 4 k^2 n + 2 k^3 with k the Gram side, n the other side of the matrix iterated).
  static double ns_step_flops(const Unit& u, const MuonConfig& config, int tp_size);
  static void plan_units(const ParamSpec& p, size_t index, const MuonConfig& config, int tp_size,
                         std::vector<Unit>& units, MuonWorkspace& ws);
  /// Groups the units without a TP collective by shape (in order) into batches the workspace
  /// holds (growing the Gram workspace to at most half the matrix one), the others alone; grows
  /// ws's staging for the batches' QKV components.
  static std::vector<std::vector<size_t>> plan_batches(const std::vector<Unit>& units, MuonWorkspace& ws);

  /// One instruction of the step's program (see "Pipelining" above), in host issue order.
  struct Op {
    enum Kind : uint8_t {
      kAllGather,           ///< communication stream: all-gather of U over bucket `index`, then an event
      kComputeWaitsGather,  ///< compute stream waits for the all-gather of bucket `index`
      kBatch,               ///< compute stream: Newton-Schulz batch `index` (batches()), then an event
      kCommWaitsBatch,      ///< communication stream waits for batch `index`
      kBroadcast,           ///< communication stream: broadcast group `index` (broadcasts())
    };
    Kind kind;
    size_t index;
  };
  /// Matrices broadcast together (one NCCL group) from data-parallel rank `root` of the group of
  /// their buckets (GradSync::group: the expert-data-parallel group when `expert`).
  struct Broadcast {
    bool expert = false;
    int root = 0;
    std::vector<size_t> params;  ///< ParamStore indices
  };
  /// The program step() runs after the momentum (tests; planned at construction).
  const std::vector<Op>& program() const { return program_; }
  const std::vector<Broadcast>& broadcasts() const { return bcasts_; }
  /// Parameters whose matrices (or QKV components) Newton-Schulz batch k computes, in run order.
  std::vector<size_t> batch_params(size_t k) const;

 private:
  void orthogonalise(const Unit& u, const Tensor& grads, const Stream& stream);
  void orthogonalise_batch(const std::vector<size_t>& batch, const Tensor& grads, const Stream& stream);
  // Orders the batches, plans the broadcasts and the program (distributed optimizer; else the
  // batches alone); my_dense / my_expert: this rank in the DP / EDP group.
  void plan_pipeline(int my_dense, int my_expert);
  // The batches in run order: stably sorted by the all-gather position (param_pos, per
  // parameter; -1 not gathered) of the last bucket each reads.
  static std::vector<std::vector<size_t>> order_batches(std::vector<std::vector<size_t>> batches,
                                                        const std::vector<Unit>& units,
                                                        const std::vector<int>& param_pos);
  static int last_gather(const std::vector<size_t>& batch, const std::vector<Unit>& units,
                         const std::vector<int>& param_pos);

  ParamStore& params_;
  GradSync& sync_;
  MuonConfig config_;
  std::shared_ptr<Communicator> tp_, etp_;
  std::vector<MuonPiece> pieces_;
  std::vector<NsCoeff> coeffs_;
  std::vector<Unit> units_;                 // of the matrices this rank orthogonalises
  std::vector<std::vector<size_t>> batches_;  // units_ indices orthogonalised together (equal shapes)
  std::vector<size_t> muon_params_, mine_;  // every Muon parameter; those this rank orthogonalises
  std::vector<int> owner_;                  // per ParamStore index: owning DP rank, -1 = not Muon
  std::vector<size_t> gather_buckets_;      // buckets holding Muon parameters over 2+ ranks, in all-gather order
  std::vector<int> gather_pos_;             // per bucket: its position in gather_buckets_, -1 none
  std::vector<Op> program_;
  std::vector<Broadcast> bcasts_;
  std::vector<std::unique_ptr<Event>> gathered_, batch_done_;  // per gather position; per batch (or null)
  std::unique_ptr<Event> start_, end_;      // momentum done (compute); broadcasts done (communication)
  std::unique_ptr<NewtonSchulz> ns_;
  Buffer stage_, gather_, full_;
};

}  // namespace mt
