#include "parallel/pipeline/schedules.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"

namespace mt::pipeline {

void validate_schedule_config(const ScheduleConfig& c) {
  MT_REQUIRE(c.pp >= 1, "pipeline parallel size pp must be >= 1, got {}", c.pp);
  MT_REQUIRE(c.num_microbatches >= 1, "number of micro-batches must be >= 1, got {}", c.num_microbatches);
  MT_REQUIRE(c.vpp >= 0, "virtual pipeline stages per rank vpp must be >= 0, got {}", c.vpp);
  MT_REQUIRE(c.microbatch_group_size >= 0,
             "--microbatch-group-size-per-virtual-pipeline-stage must be >= 0 (0 = pp), got {}",
             c.microbatch_group_size);
  MT_REQUIRE(c.vpp <= 1 || c.pp > 1, "the interleaved schedule (vpp = {}) needs pp > 1, got pp = {}", c.vpp, c.pp);
  if (c.num_chunks() > 1) {
    const int G = c.group_size(), m = c.num_microbatches;
    MT_REQUIRE(G >= c.pp && G <= m,
               "interleaved schedule: micro-batch group size per virtual stage ({}) must be in [pp ({}), number of "
               "micro-batches ({})]",
               G, c.pp, m);
    const int rem = m % G;
    MT_REQUIRE(rem == 0 || rem >= c.pp,
               "interleaved schedule: number of micro-batches ({}) mod group size ({}) = {} must be 0 or >= pp ({}); "
               "with the default group size (= pp) the number of micro-batches must be a multiple of pp",
               m, G, rem, c.pp);
  }
}

void validate_schedule_for_layout(const ScheduleConfig& c, const PipelineLayout& layout) {
  validate_schedule_config(c);
  MT_REQUIRE(layout.pp == c.pp, "layer layout pp ({}) differs from schedule pp ({})", layout.pp, c.pp);
  MT_REQUIRE(layout.num_chunks() == c.num_chunks(), "layer layout has {} chunks per rank, schedule {}",
             layout.num_chunks(), c.num_chunks());
  validate_pipeline_layout(layout);
}

ScheduleKind schedule_kind(const ScheduleConfig& c) {
  if (c.pp == 1) return ScheduleKind::kNoPipelining;
  return c.num_chunks() > 1 ? ScheduleKind::kInterleaved1F1B : ScheduleKind::k1F1B;
}

std::vector<std::pair<int, int>> get_schedule_table(int m, int V, int G) {
  MT_REQUIRE(m >= 1 && V >= 1 && G >= 1, "get_schedule_table: micro-batches {}, chunks {}, group size {} must be >= 1",
             m, V, G);
  std::vector<std::pair<int, int>> table;
  table.reserve(static_cast<size_t>(m) * V);
  for (int lo = 0; lo < m; lo += G) {
    const int hi = lo + G >= m ? m : lo + G;  // the last group takes the remainder
    for (int c = 0; c < V; ++c)
      for (int mb = lo; mb < hi; ++mb) table.emplace_back(mb, c);
  }
  return table;
}

int num_warmup_microbatches(const ScheduleConfig& c, int r) {
  validate_schedule_config(c);
  MT_REQUIRE(r >= 0 && r < c.pp, "pp_rank {} outside [0, pp = {})", r, c.pp);
  const int total = c.num_microbatches * c.num_chunks();
  if (c.forward_only) return total;
  switch (schedule_kind(c)) {
    case ScheduleKind::kNoPipelining: return 0;
    case ScheduleKind::k1F1B: return std::min(c.pp - r - 1, total);
    case ScheduleKind::kInterleaved1F1B:
      return std::min((c.pp - r - 1) * 2 + (c.num_chunks() - 1) * c.group_size(), total);
  }
  return 0;
}

std::vector<int> convert_schedule_table_to_order(int num_warmup, int V, const std::vector<std::pair<int, int>>& table) {
  const int total = static_cast<int>(table.size());
  MT_REQUIRE(num_warmup >= 0 && num_warmup <= total, "num_warmup {} outside [0, {}]", num_warmup, total);
  std::vector<int> order;
  order.reserve(2 * table.size());
  auto fwd = [&](int i) { return table[i].second + 1; };
  auto bwd = [&](int i) { return table[i].second - V; };  // chunk c backward is chunk V-1-c: -(V-c)
  for (int i = 0; i < num_warmup; ++i) order.push_back(fwd(i));
  for (int i = num_warmup; i < total; ++i) {
    order.push_back(fwd(i));
    order.push_back(bwd(i - num_warmup));
  }
  for (int i = total - num_warmup; i < total; ++i) order.push_back(bwd(i));
  return order;
}

std::vector<ComputeStep> compute_order(const ScheduleConfig& c, int r) {
  const int W = num_warmup_microbatches(c, r);  // validates
  const int V = c.num_chunks(), m = c.num_microbatches;
  // Forward sequence (shared by all ranks) and backward sequence (chunks reversed).
  std::vector<ComputeStep> fwd, bwd;
  if (V > 1) {
    for (auto [mb, ch] : get_schedule_table(m, V, c.group_size())) {
      fwd.push_back({true, mb, ch});
      bwd.push_back({false, mb, V - 1 - ch});
    }
  } else {
    for (int mb = 0; mb < m; ++mb) {
      fwd.push_back({true, mb, 0});
      bwd.push_back({false, mb, 0});
    }
  }
  std::vector<ComputeStep> order;
  if (c.forward_only) return fwd;
  const int total = static_cast<int>(fwd.size());
  for (int i = 0; i < W; ++i) order.push_back(fwd[i]);
  for (int i = W; i < total; ++i) {
    order.push_back(fwd[i]);
    order.push_back(bwd[i - W]);
  }
  for (int i = total - W; i < total; ++i) order.push_back(bwd[i]);
  return order;
}

std::vector<int> signed_chunk_order(const ScheduleConfig& c, int r) {
  std::vector<int> out;
  for (const ComputeStep& s : compute_order(c, r)) out.push_back(s.forward ? s.chunk + 1 : -(s.chunk + 1));
  return out;
}

const char* action_kind_name(ActionKind k) {
  switch (k) {
    case ActionKind::kForward: return "F";
    case ActionKind::kBackward: return "B";
    case ActionKind::kSendForward: return "sendF";
    case ActionKind::kRecvForward: return "recvF";
    case ActionKind::kSendBackward: return "sendB";
    case ActionKind::kRecvBackward: return "recvB";
    case ActionKind::kGradSync: return "gradsync";
  }
  return "?";
}

std::string to_string(const Action& a) {
  switch (a.kind) {
    case ActionKind::kForward:
      return fmt::format("F({},c{}){}", a.microbatch, a.chunk, a.first_in_chunk ? " first" : "");
    case ActionKind::kBackward:
      return fmt::format("B({},c{}){}", a.microbatch, a.chunk, a.last_in_chunk ? " last" : "");
    case ActionKind::kSendForward:
    case ActionKind::kSendBackward:
      return fmt::format("{}({},c{})->{} #{}", action_kind_name(a.kind), a.microbatch, a.chunk, a.peer, a.batch);
    case ActionKind::kRecvForward:
    case ActionKind::kRecvBackward:
      return fmt::format("{}({},c{})<-{} #{}", action_kind_name(a.kind), a.microbatch, a.chunk, a.peer, a.batch);
    case ActionKind::kGradSync: return fmt::format("gradsync(c{})", a.chunk);
  }
  return "?";
}

namespace {

// A message produced by a compute step; exchanged in the first round at which both ends are
// between two computes.
struct Message {
  bool forward;  // activation (true) or gradient (false)
  int microbatch;
  int src_rank, src_chunk;
  int dst_rank, dst_chunk;
  int64_t ready;  // round at which the producing compute ends
  int64_t seq;    // production order (global counter)
};

// Canonical order inside a batch: direction (activations first), peer, then production order.
// For one directed rank pair this orders the sender's sends and the receiver's receives
// identically and in production order, which matching in issue order (NCCL / MPI) needs, in
// batches and on channels alike.
struct BatchEntry {
  Action action;
  int64_t seq;
};
bool batch_order(const BatchEntry& x, const BatchEntry& y) {
  auto dir = [](ActionKind k) { return k == ActionKind::kSendForward || k == ActionKind::kRecvForward ? 0 : 1; };
  if (dir(x.action.kind) != dir(y.action.kind)) return dir(x.action.kind) < dir(y.action.kind);
  if (x.action.peer != y.action.peer) return x.action.peer < y.action.peer;
  return x.seq < y.seq;
}

// Per-rank state of the construction.
struct RankState {
  std::vector<ComputeStep> order;
  size_t pos = 0;
  int64_t busy_until = 0;  // the rank is between computes at round t iff busy_until <= t
  // Indexed [mb * V + chunk]: input / output gradient received, forward done.
  std::vector<char> have_input, have_grad, fwd_done;
  std::vector<int> first_fwd, last_bwd;  // per chunk: micro-batch of the first forward / last backward
  int pending_in = 0, pending_grad = 0, pending_send = 0, live = 0;
};

// The timed construction of build_schedule (see schedules.h).
class ScheduleBuilder {
 public:
  explicit ScheduleBuilder(const ScheduleConfig& c)
      : config_(c), pp_size_(c.pp), num_chunks_(c.num_chunks()), num_stages_(c.pp * c.num_chunks()), rank_state_(c.pp), batch_(c.pp) {
    out_.config = c;
    out_.kind = schedule_kind(c);
    out_.ranks.resize(pp_size_);
    const size_t n = static_cast<size_t>(c.num_microbatches) * num_chunks_;
    for (int r = 0; r < pp_size_; ++r) {
      out_.ranks[r].pp_rank = r;
      out_.ranks[r].num_warmup = num_warmup_microbatches(c, r);
      RankState& x = rank_state_[r];
      x.order = compute_order(c, r);
      x.have_input.assign(n, 0);
      x.have_grad.assign(n, 0);
      x.fwd_done.assign(n, 0);
      x.first_fwd.assign(num_chunks_, -1);
      x.last_bwd.assign(num_chunks_, -1);
      for (const ComputeStep& s : x.order) {
        if (s.forward && x.first_fwd[s.chunk] < 0) x.first_fwd[s.chunk] = s.microbatch;
        if (!s.forward) x.last_bwd[s.chunk] = s.microbatch;
      }
    }
  }

  PipelineSchedule run() {
    for (int64_t round = 0;; ++round) {
      const bool exchanged = exchange(round);
      bool started = false;
      for (int r = 0; r < pp_size_; ++r) started = try_start(r, round) || started;
      if (finished()) break;
      bool waiting = false;  // something will change by itself in a later round
      for (const RankState& x : rank_state_) waiting |= x.busy_until > round;
      for (const Message& msg : queue_) waiting |= msg.ready > round;
      if (!exchanged && !started && !waiting) fail(round);
    }
    for (const RankState& x : rank_state_) out_.construction_time = std::max(out_.construction_time, x.busy_until);
    return std::move(out_);
  }

 private:
  size_t idx(int mb, int chunk) const { return static_cast<size_t>(mb) * num_chunks_ + chunk; }

  // Phase 1 of a round: exchange every produced message whose two ends are between computes.
  // Messages of one sender become ready in production order, so FIFO order per rank pair holds.
  bool exchange(int64_t round) {
    for (auto& b : batch_) b.clear();
    std::vector<Message> keep;
    for (const Message& msg : queue_) {
      if (msg.ready > round || rank_state_[msg.src_rank].busy_until > round || rank_state_[msg.dst_rank].busy_until > round) {
        keep.push_back(msg);
        continue;
      }
      Action send, recv;
      send.kind = msg.forward ? ActionKind::kSendForward : ActionKind::kSendBackward;
      recv.kind = msg.forward ? ActionKind::kRecvForward : ActionKind::kRecvBackward;
      send.microbatch = recv.microbatch = msg.microbatch;
      send.chunk = msg.src_chunk;
      send.peer = msg.dst_rank;
      recv.chunk = msg.dst_chunk;
      recv.peer = msg.src_rank;
      batch_[msg.src_rank].push_back({send, msg.seq});
      batch_[msg.dst_rank].push_back({recv, msg.seq});
      RankState& dst = rank_state_[msg.dst_rank];
      (msg.forward ? dst.have_input : dst.have_grad)[idx(msg.microbatch, msg.dst_chunk)] = 1;
      ++(msg.forward ? dst.pending_in : dst.pending_grad);
      --rank_state_[msg.src_rank].pending_send;
    }
    queue_.swap(keep);
    bool any = false;
    for (int r = 0; r < pp_size_; ++r) {
      if (batch_[r].empty()) continue;
      any = true;
      RankSchedule& rs = out_.ranks[r];
      std::stable_sort(batch_[r].begin(), batch_[r].end(), batch_order);
      for (BatchEntry& e : batch_[r]) {
        e.action.batch = rs.num_batches;
        rs.actions.push_back(e.action);
      }
      ++rs.num_batches;
      rs.max_pending_recv_forward = std::max(rs.max_pending_recv_forward, rank_state_[r].pending_in);
      rs.max_pending_recv_backward = std::max(rs.max_pending_recv_backward, rank_state_[r].pending_grad);
    }
    return any;
  }

  // Phase 2: rank r, if between computes, starts its next step when its input is there.
  bool try_start(int r, int64_t round) {
    RankState& x = rank_state_[r];
    if (x.busy_until > round || x.pos == x.order.size()) return false;
    const ComputeStep& s = x.order[x.pos];
    const int stage = s.chunk * pp_size_ + r;
    const size_t k = idx(s.microbatch, s.chunk);
    RankSchedule& rs = out_.ranks[r];
    Action a;
    a.microbatch = s.microbatch;
    a.chunk = s.chunk;
    if (s.forward) {
      if (stage > 0 && !x.have_input[k]) return false;
      if (stage > 0) --x.pending_in;
      x.fwd_done[k] = 1;
      a.kind = ActionKind::kForward;
      a.first_in_chunk = x.first_fwd[s.chunk] == s.microbatch;
      rs.actions.push_back(a);
      if (!config_.forward_only) rs.max_live_activations = std::max(rs.max_live_activations, ++x.live);
      x.busy_until = round + config_.forward_cost;
      if (stage < num_stages_ - 1) produce(r, true, s, (r + 1) % pp_size_, r == pp_size_ - 1 ? s.chunk + 1 : s.chunk);
    } else {
      MT_CHECK(x.fwd_done[k], "backward ({}, c{}) before its forward on rank {}", s.microbatch, s.chunk, r);
      if (stage < num_stages_ - 1 && !x.have_grad[k]) return false;
      if (stage < num_stages_ - 1) --x.pending_grad;
      --x.live;
      a.kind = ActionKind::kBackward;
      a.last_in_chunk = x.last_bwd[s.chunk] == s.microbatch;
      rs.actions.push_back(a);
      if (a.last_in_chunk) {
        Action g;
        g.kind = ActionKind::kGradSync;
        g.chunk = s.chunk;
        rs.actions.push_back(g);
      }
      x.busy_until = round + config_.backward_cost;
      if (stage > 0) produce(r, false, s, (r + pp_size_ - 1) % pp_size_, r == 0 ? s.chunk - 1 : s.chunk);
    }
    ++x.pos;
    return true;
  }

  void produce(int r, bool forward, const ComputeStep& s, int dst_rank, int dst_chunk) {
    queue_.push_back({forward, s.microbatch, r, s.chunk, dst_rank, dst_chunk, rank_state_[r].busy_until, seq_++});
    out_.ranks[r].max_pending_send = std::max(out_.ranks[r].max_pending_send, ++rank_state_[r].pending_send);
  }

  bool finished() const {
    if (!queue_.empty()) return false;
    for (const RankState& x : rank_state_)
      if (x.pos < x.order.size()) return false;
    return true;
  }

  [[noreturn]] void fail(int64_t round) const {
    std::string where;
    for (int r = 0; r < pp_size_; ++r) {
      if (rank_state_[r].pos == rank_state_[r].order.size()) continue;
      const ComputeStep& s = rank_state_[r].order[rank_state_[r].pos];
      where += fmt::format(" rank {} waits at {}({},c{});", r, s.forward ? "F" : "B", s.microbatch, s.chunk);
    }
    MT_FAIL("pipeline schedule construction stalled in round {} (pp {}, vpp {}, m {}, group {}):{}", round, pp_size_, config_.vpp,
            config_.num_microbatches, config_.group_size(), where);
  }

  const ScheduleConfig config_;
  const int pp_size_, num_chunks_, num_stages_;
  PipelineSchedule out_;
  std::vector<RankState> rank_state_;
  std::vector<Message> queue_;  // produced, not yet exchanged; in production order
  std::vector<std::vector<BatchEntry>> batch_;
  int64_t seq_ = 0;
};

}  // namespace

PipelineSchedule build_schedule(const ScheduleConfig& c) {
  validate_schedule_config(c);
  MT_REQUIRE(c.forward_cost >= 1 && c.backward_cost >= 1,
             "schedule construction costs must be >= 1: forward {}, backward {}", c.forward_cost, c.backward_cost);
  return ScheduleBuilder(c).run();
}

std::vector<Action> rank_actions(const ScheduleConfig& c, int pp_rank) {
  MT_REQUIRE(pp_rank >= 0 && pp_rank < c.pp, "pp_rank {} outside [0, pp = {})", pp_rank, c.pp);
  return build_schedule(c).ranks[pp_rank].actions;
}

double bubble_fraction(int pp, int vpp, int num_microbatches) {
  MT_REQUIRE(pp >= 1 && vpp >= 0 && num_microbatches >= 1, "bubble_fraction: pp {}, vpp {}, m {} out of range", pp,
             vpp, num_microbatches);
  const int V = vpp > 1 ? vpp : 1;
  return static_cast<double>(pp - 1) / (static_cast<double>(num_microbatches) * V);
}

}  // namespace mt::pipeline
