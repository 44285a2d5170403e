// Pipeline schedules as pure functions: each pipeline rank's ordered list of actions (compute,
// point-to-point communication, gradient-sync points) for one training step. One executor runs
// every schedule. Compute orders follow Megatron-Core
// (megatron/core/pipeline_parallel/schedules.py: forward_backward_no_pipelining,
// forward_backward_pipelining_without_interleaving, forward_backward_pipelining_with_interleaving,
// get_schedule_table, get_pp_rank_microbatches; transformer/cuda_graphs.py:
// convert_schedule_table_to_order). See docs/parallelism.md for the worked example.
//
// Terms: pp pipeline ranks, V = max(vpp, 1) model chunks per rank, m micro-batches per step.
// Chunk c of rank r is virtual stage s = c·pp + r (layer_split.h); the activation of stage s goes
// to stage s+1 on rank (r+1) mod pp, its gradient comes back from there. "Forward (mb, c)" runs
// micro-batch mb through chunk c.
//
// Executor contract. The same list can be run two ways; both are deadlock-free (the tests in
// tests/parallel/schedules_test.cpp simulate both, under rendezvous semantics: a send completes
// only when its receive is posted, and sends/receives between two ranks match in issue order).
//  (a) Batched (simple; Megatron's default batched p2p):
//      * Compute actions (kForward, kBackward) run in list order on the rank's compute stream.
//      * P2P actions carry a batch id. A maximal run of consecutive p2p actions with the same
//        batch id is ONE batch: issue all of its sends and receives between
//        Communicator::group_start() and group_end() (NCCL group / MPI non-blocking + wait-all),
//        in list order; the batch is complete when all of its operations are; only then may a
//        later action use received data or reuse a sent buffer. Batches run in list order.
//      * Every batch pairs only with batches that the construction placed in the same round
//        (see build_schedule). Inside a batch the operations with one peer are listed in
//        production order on both sides (activations before gradients), so issue-order matching
//        pairs them correctly.
//      * Cost: a batch is a rendezvous with its peers. When the construction costs
//        (ScheduleConfig::forward_cost:backward_cost, default 1:2) match the real ratio of a
//        chunk's forward and backward time, ranks meet without waiting and the makespan is the
//        dependency bound, (m + (pp − 1)/V)·(tf + tb) for the standard configurations; at other
//        ratios interleaved schedules lose time (1:2 construction at 1:1 or 1:3: up to 21% / 6%;
//        a matched 1:3 construction: up to 7%). Non-interleaved schedules always reach the bound.
//  (b) Overlapped batches (--overlap-p2p-communication; what train/pipeline.h runs when
//      ScheduleConfig::overlap_p2p_comm is set; Megatron's overlap_p2p_comm: batched isend/irecv
//      whose wait handles are waited on right before the data is used):
//      * The batches of (a), in list order, are issued on a communication stream of their own
//        (one 2-rank-or-more communicator split from the pipeline group, used only there); the
//        compute stream never runs a transfer.
//      * A batch starts once the computes listed before it have run (an event recorded on the
//        compute stream at the batch's position): its sends read finished tensors and its
//        receives overwrite buffers nothing reads any more.
//      * A compute waits (stream event) only for the last batch that received into or sent from a
//        buffer it uses (its input, activation slot, gradient buffer); batches complete in list
//        order on the one stream, so that covers the earlier ones. The run ends with the compute
//        stream waiting for the last batch (nothing is in flight after the step; CUDA graphs need
//        the join).
//      * Every ordering edge of this execution is also one of (a) (there, each batch also waits
//        for everything before it and everything waits for each batch), so it is deadlock-free
//        whenever (a) is, and never slower than (a) with the same transfers; what it gains is
//        every compute that does not read a batch's data running while the batch is in flight
//        (in (a) each batch is a rendezvous the compute stream waits at). Buffer lifetimes are
//        those of (a): no extra buffers.
//      * Batch ids (the order of the batches on the stream) must pair across ranks as in (a):
//        the same issue order on every rank, as NCCL requires of one communicator.
//  (c) Channels (a bound, simulated by the tests only; the limit of --overlap-p2p-communication):
//      * Four channels per rank: activations to (rank+1) mod pp (kSendForward), activations
//        from (rank−1) mod pp (kRecvForward), gradients to (rank−1) mod pp (kSendBackward),
//        gradients from (rank+1) mod pp (kRecvBackward). Each directed link and direction needs
//        its own communicator and stream (NCCL forbids using one communicator from several
//        streams at once): 2-rank communicators per (link, direction).
//      * Each send is issued on its channel right after the compute that produced its tensor
//        (behind an event on the compute stream); each receive is issued on its channel at its
//        list position (or earlier, buffers permitting). The list order of the sends of one
//        channel is their production order, and the receiver lists the matching receives in the
//        same order (checked by the tests), so matching in issue order is correct. Batch ids are
//        ignored. A compute waits (stream event) only for the receive of its own input / output
//        gradient; a sent buffer is kept until its send completes.
//      * Compute then waits only on data: with free communication the makespan is the
//        dependency bound for any durations. Buffers: RankSchedule::max_pending_recv_*.
//      * Not executed: a rank would drive four NCCL communicators concurrently, each from its
//        own stream, in an order that differs from rank to rank, which NCCL documents as unsafe
//        (operations on different communicators must be issued in the same order everywhere or
//        not overlap); (b) keeps one communicator with a rank-consistent order. The tests compare
//        (b)'s makespan with this bound (docs/parallelism.md).
// Meaning of the actions:
//  * kSendForward (mb, c): the output activation of forward (mb, c) of this rank, to `peer`
//    = (rank+1) mod pp, where it is the input of chunk c (or c+1 when this is the last rank).
//    kRecvForward (mb, c): the input activation of forward (mb, c) of this rank, from `peer`
//    = (rank−1) mod pp. kSendBackward (mb, c): the gradient w.r.t. the input of chunk c produced
//    by backward (mb, c), to (rank−1) mod pp. kRecvBackward (mb, c): the gradient w.r.t. the
//    output of chunk c, for backward (mb, c), from (rank+1) mod pp.
//    Stage 0 has no input to receive (the embedding reads the batch) and the last stage none to
//    send; the last stage's backward starts from the loss, stage 0's sends nothing.
//  * kGradSync (c): the backward of chunk c has run for every micro-batch; its weight gradients
//    are final for this step and their data-parallel reduction may start (Megatron: grad sync
//    enabled for the chunk's last micro-batch, --overlap-grad-reduce). Placed right after that
//    backward. (kForward with first_in_chunk marks where an --overlap-param-gather all-gather of
//    the chunk must have completed.)
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "parallel/pipeline/layer_split.h"

namespace mt::pipeline {

enum class ScheduleKind {
  kNoPipelining,     ///< pp == 1: forward and backward of each micro-batch in turn
  k1F1B,             ///< pp > 1, V == 1: warm-up, one-forward-one-backward, cool-down
  kInterleaved1F1B,  ///< pp > 1, V > 1: Megatron's interleaved schedule (arXiv:2104.04473 §2.2)
};

struct ScheduleConfig {
  int pp = 1;                     ///< pipeline ranks
  int vpp = 0;                    ///< model chunks per rank; 0 or 1 = no interleaving
  int num_microbatches = 1;       ///< m: global batch / (micro batch · dp)
  int microbatch_group_size = 0;  ///< --microbatch-group-size-per-virtual-pipeline-stage; 0 = pp
  bool forward_only = false;      ///< evaluation: forwards only (no backward, no grad sync)
  /// --overlap-p2p-communication: the executor runs the list as overlapped batches (mode (b)
  /// above) instead of blocking batches (a). Changes how the list is run, never the list.
  bool overlap_p2p_comm = false;
  /// Relative durations of one chunk's forward and backward that the placement of the p2p
  /// batches assumes (build_schedule). They change only where batches go, never the compute
  /// order. 1:2 fits training without recompute, 1:3 full recompute.
  int forward_cost = 1;
  int backward_cost = 2;

  int num_chunks() const { return vpp > 1 ? vpp : 1; }
  int group_size() const { return microbatch_group_size > 0 ? microbatch_group_size : pp; }
};

/// Throws mt::Error (naming the values) before any communication when:
///  pp < 1; m < 1; vpp < 0; microbatch_group_size < 0; vpp > 1 with pp == 1;
///  interleaved (Megatron's current rule, schedules.py): group size G (default pp) outside
///  [pp, m], or m mod G in (0, pp) — with the default G = pp this is "m must be a multiple of pp".
void validate_schedule_config(const ScheduleConfig& cfg);
/// Also checks that the layer layout has the same pp and chunks and is valid (layer_split.h).
void validate_schedule_for_layout(const ScheduleConfig& cfg, const PipelineLayout& layout);
ScheduleKind schedule_kind(const ScheduleConfig& cfg);

/// Megatron's get_schedule_table: the forward order of (microbatch, chunk) pairs shared by all
/// ranks: groups of `group_size` micro-batches (the last group takes the remainder), each group
/// run through chunk 0, then chunk 1, ... Example m=5, V=2, G=3:
/// (0,0)(1,0)(2,0)(0,1)(1,1)(2,1)(3,0)(4,0)(3,1)(4,1).
std::vector<std::pair<int, int>> get_schedule_table(int num_microbatches, int num_chunks, int group_size);
/// Forward steps before the first backward on `pp_rank` (Megatron's get_pp_rank_microbatches):
/// no pipelining 0; 1F1B min(pp − rank − 1, m); interleaved
/// min((pp − rank − 1)·2 + (V − 1)·G, m·V); forward_only: all forward steps.
int num_warmup_microbatches(const ScheduleConfig& cfg, int pp_rank);
/// Megatron's convert_schedule_table_to_order: forwards as +(chunk+1), backwards as −(chunk+1);
/// `num_warmup` forwards, then forward/backward pairs, then the remaining backwards.
std::vector<int> convert_schedule_table_to_order(int num_warmup, int num_chunks,
                                                 const std::vector<std::pair<int, int>>& table);

struct ComputeStep {
  bool forward = true;
  int microbatch = 0;
  int chunk = 0;
  bool operator==(const ComputeStep&) const = default;
};
/// The compute order of `pp_rank` (validates cfg).
std::vector<ComputeStep> compute_order(const ScheduleConfig& cfg, int pp_rank);
/// compute_order as signed 1-based chunk ids (+c forward, −c backward).
std::vector<int> signed_chunk_order(const ScheduleConfig& cfg, int pp_rank);

enum class ActionKind : uint8_t {
  kForward,
  kBackward,
  kSendForward,
  kRecvForward,
  kSendBackward,
  kRecvBackward,
  kGradSync,
};
const char* action_kind_name(ActionKind kind);
inline bool is_p2p(ActionKind k) {
  return k == ActionKind::kSendForward || k == ActionKind::kRecvForward || k == ActionKind::kSendBackward ||
         k == ActionKind::kRecvBackward;
}

struct Action {
  ActionKind kind = ActionKind::kForward;
  int microbatch = -1;          ///< -1 for kGradSync
  int chunk = 0;                ///< model chunk on this rank (0-based)
  int peer = -1;                ///< pipeline-group rank of the peer (p2p only)
  int batch = -1;               ///< p2p batch id on this rank (p2p only), increasing along the list
  bool first_in_chunk = false;  ///< kForward: the chunk's first forward in this step
  bool last_in_chunk = false;   ///< kBackward: the chunk's last backward in this step
  bool operator==(const Action&) const = default;
};
/// "F(3,c1)", "B(3,c0) last", "sendF(3,c1)->2 #5", "recvB(0,c0)<-1 #7", "gradsync(c1)".
std::string to_string(const Action& a);

struct RankSchedule {
  int pp_rank = 0;
  std::vector<Action> actions;
  int num_warmup = 0;                 ///< num_warmup_microbatches(cfg, pp_rank)
  int num_batches = 0;                ///< p2p batches in `actions`
  int max_live_activations = 0;       ///< max (mb, chunk) forwarded, not yet backwarded (0 forward-only)
  int max_pending_recv_forward = 0;   ///< max received inputs not yet consumed (receive buffers)
  int max_pending_recv_backward = 0;  ///< max received output gradients not yet consumed
  int max_pending_send = 0;           ///< max produced tensors not yet sent (batched mode: kept by the sender)
};

struct PipelineSchedule {
  ScheduleConfig config;
  ScheduleKind kind = ScheduleKind::kNoPipelining;
  std::vector<RankSchedule> ranks;  ///< indexed by pipeline rank
  int64_t construction_time = 0;    ///< makespan of the construction, in cost units
};

/// Builds every rank's action list. Compute orders are Megatron's (compute_order); the p2p
/// batches are placed by a timed construction on a clock of integer rounds: a chunk's forward
/// takes cfg.forward_cost rounds, its backward cfg.backward_cost. In each round, first every
/// produced message whose sender and receiver are both between computes is exchanged — all of a
/// rank's exchanges of that round form one batch — then every rank between computes starts its
/// next step if its input has arrived. Consequences: each batch pairs only with batches of the
/// same round (deadlock-free, any real durations); when the real forward:backward ratio matches
/// 1:1 or 1:2 costs, ranks meet at their batches without waiting, so batched execution reaches
/// the dependency bound (within 7% for 1:3; tests, docs/parallelism.md). Validates cfg; throws
/// mt::Error if the construction stalls (cannot happen for valid configs).
PipelineSchedule build_schedule(const ScheduleConfig& cfg);
/// build_schedule(cfg).ranks[pp_rank].actions.
std::vector<Action> rank_actions(const ScheduleConfig& cfg, int pp_rank);

/// The theoretical pipeline bubble fraction (pp − 1) / (m · V) of the 1F1B schedules
/// (Narayanan et al. 2021, arXiv:2104.04473 §2.2); 0 when pp == 1. vpp 0 counts as 1.
double bubble_fraction(int pp, int vpp, int num_microbatches);

}  // namespace mt::pipeline
