// Tests of parallel/pipeline/schedules.h: the worked example of docs/parallelism.md, Megatron's
// documented tables and orders, and, for many (pp, vpp, micro-batches, group size), a
// discrete-event simulation of all ranks' action lists that executes compute and p2p batches
// with the executor's semantics (schedules.h): a batch is posted as a whole and completes when
// every one of its operations has met its peer's operation; sends and receives between two ranks
// are matched in issue order (NCCL / MPI), and the simulation checks that every matched pair
// carries the same tensor (direction, micro-batch, producing stage). It detects deadlock,
// use of data not yet received, duplicate or missing compute, wrong peers, and measures the
// activation memory and the makespan against the theoretical bubble.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "testing/testing.h"
#include "core/check.h"
#include "parallel/pipeline/schedules.h"
#include "train/pipeline.h"

namespace mt::pipeline {
namespace {

using ::mt::testing::expect_error;

ScheduleConfig cfg(int pp, int vpp, int m, int group = 0, bool forward_only = false) {
  ScheduleConfig c;
  c.pp = pp;
  c.vpp = vpp;
  c.num_microbatches = m;
  c.microbatch_group_size = group;
  c.forward_only = forward_only;
  return c;
}

std::vector<int> compute_signed(const std::vector<Action>& actions) {
  std::vector<int> out;
  for (const Action& a : actions) {
    if (a.kind == ActionKind::kForward) out.push_back(a.chunk + 1);
    if (a.kind == ActionKind::kBackward) out.push_back(-(a.chunk + 1));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Worked examples

TEST(Schedules, WorkedExamplePp4Vpp2Mb8Group4) {
  const ScheduleConfig c = cfg(4, 2, 8, 4);
  const std::vector<int> expected = {1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, -2, 1, -2, 2, -2, 2, -2, 2, -1, 2, -1,
                                     -1, -1, -2, -2, -2, -2, -1, -1, -1, -1};
  EXPECT_EQ(signed_chunk_order(c, 0), expected);
  EXPECT_EQ(num_warmup_microbatches(c, 0), 10);  // (4 - 0 - 1)·2 + (2 - 1)·4
  EXPECT_EQ(num_warmup_microbatches(c, 3), 4);
  EXPECT_EQ(convert_schedule_table_to_order(10, 2, get_schedule_table(8, 2, 4)), expected);
  const PipelineSchedule s = build_schedule(c);
  EXPECT_EQ(s.kind, ScheduleKind::kInterleaved1F1B);
  EXPECT_EQ(compute_signed(s.ranks[0].actions), expected);
  EXPECT_EQ(s.ranks[0].num_warmup, 10);
  EXPECT_EQ(s.ranks[0].max_live_activations, 11);
  EXPECT_DOUBLE_EQ(bubble_fraction(4, 2, 8), 3.0 / 16.0);
}

TEST(Schedules, MegatronDocumentedTables) {
  // get_schedule_table / convert_schedule_table_to_order docstrings: PP2 N3M5 VP2.
  const auto table = get_schedule_table(5, 2, 3);
  const std::vector<std::pair<int, int>> expected_table = {{0, 0}, {1, 0}, {2, 0}, {0, 1}, {1, 1},
                                                           {2, 1}, {3, 0}, {4, 0}, {3, 1}, {4, 1}};
  EXPECT_EQ(table, expected_table);
  EXPECT_EQ(convert_schedule_table_to_order(5, 2, table),
            (std::vector<int>{1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1}));
  // model_parallel_config.py: PP2 VP2 group 2, m 4: micro-batches 0 1 0 1 2 3 2 3.
  std::vector<int> mbs;
  for (auto [mb, ch] : get_schedule_table(4, 2, 2)) mbs.push_back(mb);
  EXPECT_EQ(mbs, (std::vector<int>{0, 1, 0, 1, 2, 3, 2, 3}));
  // ... group 3, m 5: 0 1 2 0 1 2 3 4 3 4.
  mbs.clear();
  for (auto [mb, ch] : get_schedule_table(5, 2, 3)) mbs.push_back(mb);
  EXPECT_EQ(mbs, (std::vector<int>{0, 1, 2, 0, 1, 2, 3, 4, 3, 4}));
  // The same config through build_schedule: PP2 m5 group 3 is valid (5 mod 3 = 2 >= pp).
  EXPECT_EQ(signed_chunk_order(cfg(2, 2, 5, 3), 0),
            convert_schedule_table_to_order(num_warmup_microbatches(cfg(2, 2, 5, 3), 0), 2, table));
}

TEST(Schedules, OneFOneBAndNoPipelining) {
  // 1F1B, pp 4, m 6: rank r warms up with pp - r - 1 forwards.
  const ScheduleConfig c = cfg(4, 0, 6);
  std::vector<ComputeStep> r0 = compute_order(c, 0);
  std::vector<ComputeStep> expect0 = {{true, 0, 0},  {true, 1, 0},  {true, 2, 0},  {true, 3, 0},
                                      {false, 0, 0}, {true, 4, 0},  {false, 1, 0}, {true, 5, 0},
                                      {false, 2, 0}, {false, 3, 0}, {false, 4, 0}, {false, 5, 0}};
  EXPECT_EQ(r0, expect0);
  EXPECT_EQ(signed_chunk_order(c, 3), (std::vector<int>{1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1}));
  EXPECT_EQ(num_warmup_microbatches(c, 1), 2);
  EXPECT_EQ(num_warmup_microbatches(cfg(4, 0, 2), 0), 2);  // capped at m
  EXPECT_EQ(schedule_kind(c), ScheduleKind::k1F1B);
  // No pipelining: F B F B ..., the gradient-sync point after the last backward, no p2p.
  const PipelineSchedule s = build_schedule(cfg(1, 0, 3));
  EXPECT_EQ(s.kind, ScheduleKind::kNoPipelining);
  std::vector<std::string> got;
  for (const Action& a : s.ranks[0].actions) got.push_back(to_string(a));
  EXPECT_EQ(got, (std::vector<std::string>{"F(0,c0) first", "B(0,c0)", "F(1,c0)", "B(1,c0)", "F(2,c0)",
                                           "B(2,c0) last", "gradsync(c0)"}));
  EXPECT_EQ(s.ranks[0].max_live_activations, 1);
  EXPECT_DOUBLE_EQ(bubble_fraction(1, 0, 3), 0.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(4, 0, 6), 0.5);
}

TEST(Schedules, OneFOneBActionListPp2) {
  // pp 2, m 2: the full action lists (batch ids after '#').
  const PipelineSchedule s = build_schedule(cfg(2, 0, 2));
  auto strs = [](const std::vector<Action>& v) {
    std::vector<std::string> o;
    for (const Action& a : v) o.push_back(to_string(a));
    return o;
  };
  EXPECT_EQ(strs(s.ranks[0].actions),
            (std::vector<std::string>{"F(0,c0) first", "sendF(0,c0)->1 #0", "F(1,c0)", "sendF(1,c0)->1 #1",
                                      "recvB(0,c0)<-1 #2", "B(0,c0)", "recvB(1,c0)<-1 #3", "B(1,c0) last",
                                      "gradsync(c0)"}));
  EXPECT_EQ(strs(s.ranks[1].actions),
            (std::vector<std::string>{"recvF(0,c0)<-0 #0", "F(0,c0) first", "recvF(1,c0)<-0 #1", "B(0,c0)",
                                      "sendB(0,c0)->0 #2", "F(1,c0)", "B(1,c0) last", "gradsync(c0)",
                                      "sendB(1,c0)->0 #3"}));
}

// ---------------------------------------------------------------------------------------------
// Discrete-event simulator

// kOverlapped: the executor's --overlap-p2p-communication (schedules.h mode (b)): batches posted
// in list order on one communication queue per rank, each behind the computes listed before it
// and behind the previous batch; a compute waits for the batch its plan names
// (PipelinePlan::wait_batch, train/pipeline.h), which must cover the data it reads.
enum class Mode { kBatched, kChannels, kOverlapped };

struct Sim {
  struct PostedOp {
    int rank;
    Action a;
    double post_time;
    bool matched = false;
    double done_time = 0;
  };

  const PipelineSchedule& s;
  Mode mode;
  int P, V, S, m;
  double tf, tb;  // full-model forward / backward time of one micro-batch (a chunk takes 1/V)
  std::mt19937_64 rng;
  std::vector<size_t> pc;
  std::vector<double> clock;
  std::vector<std::vector<int>> batch_ops;  // batched mode: posted op ids of the rank's open batch
  std::vector<int> next_batch;
  std::vector<PostedOp> ops;
  // Matching queues. Batched mode: one FIFO per directed rank pair (all p2p between two ranks
  // match in issue order). Channel mode: one FIFO per directed pair and direction.
  std::map<std::tuple<int, int, int>, std::deque<int>> sends, recvs;
  // Per rank, [mb * V + chunk].
  std::vector<std::vector<char>> fwd, bwd, sent_f, sent_b;
  std::vector<std::vector<int>> input_op, grad_op;  // posted receive op ids, -1 = none
  std::vector<int> live, max_live;
  std::vector<std::string> errors;
  double tc = 0;  // transfer time of one tensor (a matched pair completes tc after both are posted)
  // Overlapped mode: per rank its plan (wait_batch), the batches the host has passed but not yet
  // posted (action indices, time of the computes before them), and the posted ops per batch id.
  struct Queued {
    std::vector<size_t> acts;
    double gate;
  };
  std::vector<PipelinePlan> plans;
  std::vector<std::deque<Queued>> queued;
  std::vector<std::vector<std::vector<int>>> batch_posted;

  Sim(const PipelineSchedule& sched, Mode mode_, double tf_ = 1, double tb_ = 2, uint64_t seed = 1, double tc_ = 0)
      : s(sched), mode(mode_), P(sched.config.pp), V(sched.config.num_chunks()), S(P * V),
        m(sched.config.num_microbatches), tf(tf_), tb(tb_), rng(seed), tc(tc_) {
    if (mode == Mode::kOverlapped) {
      PipelineLayout layout;  // one layer per virtual stage: the chunks' embedding / loss flags
      layout.num_layers = S;
      layout.pp = P;
      layout.vpp = sched.config.vpp;
      queued.resize(P);
      batch_posted.resize(P);
      for (int r = 0; r < P; ++r) {
        plans.push_back(plan_pipeline(sched.config, r, layers_of(r, layout)));
        EXPECT_EQ(plans[r].actions, sched.ranks[r].actions);
        batch_posted[r].assign(plans[r].num_batches, {});
      }
    }
    pc.assign(P, 0);
    clock.assign(P, 0);
    batch_ops.assign(P, {});
    next_batch.assign(P, 0);
    for (auto* v : {&fwd, &bwd, &sent_f, &sent_b}) v->assign(P, std::vector<char>(m * V, 0));
    input_op.assign(P, std::vector<int>(m * V, -1));
    grad_op.assign(P, std::vector<int>(m * V, -1));
    live.assign(P, 0);
    max_live.assign(P, 0);
  }

  void err(int r, const std::string& what) {
    errors.push_back("rank " + std::to_string(r) + " at action " + std::to_string(pc[r]) + ": " + what);
  }
  int stage(int r, int chunk) const { return chunk * P + r; }
  size_t k(const Action& a) const { return static_cast<size_t>(a.microbatch) * V + a.chunk; }
  static bool is_send(ActionKind kd) { return kd == ActionKind::kSendForward || kd == ActionKind::kSendBackward; }
  static bool is_fwd_dir(ActionKind kd) { return kd == ActionKind::kSendForward || kd == ActionKind::kRecvForward; }

  // The tensor a p2p op carries: (forward?, micro-batch, producing stage).
  std::tuple<bool, int, int> tag(const PostedOp& op) const {
    const Action& a = op.a;
    const int st = stage(op.rank, a.chunk);
    switch (a.kind) {
      case ActionKind::kSendForward: return {true, a.microbatch, st};
      case ActionKind::kRecvForward: return {true, a.microbatch, st - 1};
      case ActionKind::kSendBackward: return {false, a.microbatch, st};
      case ActionKind::kRecvBackward: return {false, a.microbatch, st + 1};
      default: return {false, -1, -1};
    }
  }

  void match() {
    for (auto& [key, q] : sends) {
      auto& rq = recvs[key];
      while (!q.empty() && !rq.empty()) {
        PostedOp& snd = ops[q.front()];
        PostedOp& rcv = ops[rq.front()];
        q.pop_front();
        rq.pop_front();
        if (tag(snd) != tag(rcv))
          errors.push_back("mismatched pair " + std::to_string(std::get<0>(key)) + "->" +
                           std::to_string(std::get<1>(key)) + ": " + to_string(snd.a) + " vs " + to_string(rcv.a));
        snd.matched = rcv.matched = true;
        snd.done_time = rcv.done_time = std::max(snd.post_time, rcv.post_time) + tc;
      }
    }
  }

  // Posts one p2p action of rank r (checks peers and that a send has something to send).
  int post(int r, const Action& o, double time = -1) {
    const int st = stage(r, o.chunk);
    const bool to_next = o.kind == ActionKind::kSendForward || o.kind == ActionKind::kRecvBackward;
    const int want_peer = to_next ? (r + 1) % P : (r + P - 1) % P;
    if (o.peer != want_peer) err(r, to_string(o) + ": wrong peer");
    if (o.microbatch < 0 || o.microbatch >= m || o.chunk < 0 || o.chunk >= V) {
      err(r, to_string(o) + ": out of range");
      return -1;
    }
    const int id = static_cast<int>(ops.size());
    if (o.kind == ActionKind::kSendForward) {
      if (!fwd[r][k(o)] || st == S - 1 || sent_f[r][k(o)]) err(r, to_string(o) + ": nothing to send");
      sent_f[r][k(o)] = 1;
    }
    if (o.kind == ActionKind::kSendBackward) {
      if (!bwd[r][k(o)] || st == 0 || sent_b[r][k(o)]) err(r, to_string(o) + ": nothing to send");
      sent_b[r][k(o)] = 1;
    }
    if (o.kind == ActionKind::kRecvForward) {
      if (st == 0 || input_op[r][k(o)] >= 0) err(r, to_string(o) + ": bad receive");
      input_op[r][k(o)] = id;
    }
    if (o.kind == ActionKind::kRecvBackward) {
      if (st == S - 1 || grad_op[r][k(o)] >= 0) err(r, to_string(o) + ": bad receive");
      grad_op[r][k(o)] = id;
    }
    ops.push_back({r, o, time < 0 ? clock[r] : time});
    const int dir = mode == Mode::kChannels ? (is_fwd_dir(o.kind) ? 1 : 2) : 0;
    if (is_send(o.kind))
      sends[{r, o.peer, dir}].push_back(id);
    else
      recvs[{o.peer, r, dir}].push_back(id);
    return id;
  }

  // Channel mode: the send of the tensor just computed is issued at once (its list position
  // only records its order on the channel).
  void post_send_of(int r, ActionKind kind, const Action& compute) {
    const auto& acts = s.ranks[r].actions;
    for (size_t j = pc[r] + 1; j < acts.size(); ++j)
      if (acts[j].kind == kind && acts[j].microbatch == compute.microbatch && acts[j].chunk == compute.chunk) {
        post(r, acts[j]);
        match();
        return;
      }
  }

  // Time at which the received tensor of op `id` may be used, or -1 if not yet. Batched mode:
  // the batch holding the receive must have completed (the rank passed it).
  double ready_time(int id) const {
    if (id < 0) return -1;
    const PostedOp& op = ops[id];
    if (!op.matched) return -1;
    return op.done_time;
  }

  // Overlapped mode: completion time of rank r's batch b, -1 while not posted or not matched.
  double batch_time(int r, int b) const {
    const auto& ids = batch_posted[r][static_cast<size_t>(b)];
    if (ids.empty()) return -1;
    double t = 0;
    for (int id : ids) {
      if (!ops[id].matched) return -1;
      t = std::max(t, ops[id].done_time);
    }
    return t;
  }
  // Overlapped mode: posts rank r's queued batches while the previous one has completed.
  bool post_queued(int r) {
    bool moved = false;
    while (!queued[r].empty() && errors.empty()) {
      int b = 0;
      while (b < static_cast<int>(batch_posted[r].size()) && !batch_posted[r][b].empty()) ++b;
      const double prev = b == 0 ? 0.0 : batch_time(r, b - 1);
      if (prev < 0) break;
      const Queued q = queued[r].front();
      queued[r].pop_front();
      for (size_t j : q.acts) batch_posted[r][b].push_back(post(r, s.ranks[r].actions[j], std::max(q.gate, prev)));
      match();
      moved = true;
    }
    return moved;
  }

  // Runs rank r as far as it can; returns whether it moved.
  bool step(int r) {
    const auto& acts = s.ranks[r].actions;
    bool moved = mode == Mode::kOverlapped && post_queued(r);
    while (pc[r] < acts.size() && errors.empty()) {
      if (!batch_ops[r].empty()) {  // batched mode: an open batch is done when every op met its peer
        double t = clock[r];
        for (int id : batch_ops[r]) {
          if (!ops[id].matched) return moved;
          t = std::max(t, ops[id].done_time);
        }
        clock[r] = t;
        pc[r] += batch_ops[r].size();
        batch_ops[r].clear();
        moved = true;
        continue;
      }
      const Action& a = acts[pc[r]];
      if (is_p2p(a.kind)) {
        if (a.batch != next_batch[r]) err(r, "batch id " + std::to_string(a.batch) + " out of sequence");
        if (mode == Mode::kOverlapped) {  // the host passes the batch; it is posted when its turn comes
          ++next_batch[r];
          Queued q{{}, clock[r]};
          for (; pc[r] < acts.size() && is_p2p(acts[pc[r]].kind) && acts[pc[r]].batch == a.batch; ++pc[r])
            q.acts.push_back(pc[r]);
          queued[r].push_back(q);
          post_queued(r);
        } else if (mode == Mode::kChannels) {
          if (pc[r] + 1 == acts.size() || !is_p2p(acts[pc[r] + 1].kind) || acts[pc[r] + 1].batch != a.batch)
            ++next_batch[r];
          if (!is_send(a.kind)) post(r, a);  // sends were posted right after their compute
          match();
          ++pc[r];
        } else {
          ++next_batch[r];
          for (size_t j = pc[r]; j < acts.size() && is_p2p(acts[j].kind) && acts[j].batch == a.batch; ++j)
            batch_ops[r].push_back(post(r, acts[j]));
          match();
        }
        moved = true;
        continue;
      }
      // Compute and sync points.
      const int st = stage(r, a.chunk);
      double waited = 0;  // overlapped mode: when the batch the plan waits for completed
      if (mode == Mode::kOverlapped && plans[r].wait_batch[pc[r]] >= 0) {
        waited = batch_time(r, plans[r].wait_batch[pc[r]]);
        if (waited < 0) return moved;
      }
      // In overlapped mode the data must be there once the plan's wait is done.
      auto not_covered = [&](int id) {
        if (mode == Mode::kOverlapped && ready_time(id) < 0) {
          err(r, to_string(a) + ": its wait_batch does not cover the data it reads");
          return true;
        }
        return false;
      };
      if (a.kind == ActionKind::kForward) {
        if (fwd[r][k(a)]) err(r, "forward twice");
        double start = std::max(clock[r], waited);
        if (st > 0) {
          if (input_op[r][k(a)] < 0 || not_covered(input_op[r][k(a)])) {
            err(r, to_string(a) + " before its input was received");
            return moved;
          }
          const double t = ready_time(input_op[r][k(a)]);
          if (t < 0) return moved;  // channel mode: wait for the data
          start = std::max(start, t);
        }
        fwd[r][k(a)] = 1;
        max_live[r] = std::max(max_live[r], ++live[r]);
        clock[r] = start + tf / V;
        if (mode == Mode::kChannels) post_send_of(r, ActionKind::kSendForward, a);
      } else if (a.kind == ActionKind::kBackward) {
        if (!fwd[r][k(a)] || bwd[r][k(a)]) err(r, to_string(a) + " without forward or twice");
        double start = std::max(clock[r], waited);
        if (st < S - 1) {
          if (grad_op[r][k(a)] < 0 || not_covered(grad_op[r][k(a)])) {
            err(r, to_string(a) + " before its output gradient was received");
            return moved;
          }
          const double t = ready_time(grad_op[r][k(a)]);
          if (t < 0) return moved;
          start = std::max(start, t);
        }
        bwd[r][k(a)] = 1;
        --live[r];
        clock[r] = start + tb / V;
        if (mode == Mode::kChannels) post_send_of(r, ActionKind::kSendBackward, a);
      } else if (a.kind == ActionKind::kGradSync) {
        for (int mb = 0; mb < m; ++mb)
          if (!bwd[r][static_cast<size_t>(mb) * V + a.chunk]) err(r, "grad sync before all backwards of the chunk");
        if (pc[r] == 0 || acts[pc[r] - 1].kind != ActionKind::kBackward || !acts[pc[r] - 1].last_in_chunk ||
            acts[pc[r] - 1].chunk != a.chunk)
          err(r, "grad sync not right after the chunk's last backward");
      }
      ++pc[r];
      moved = true;
    }
    return moved;
  }

  // Returns "" on success, else the deadlock / error description.
  std::string run() {
    std::vector<int> order(P);
    for (int r = 0; r < P; ++r) order[r] = r;
    for (bool progress = true; progress && errors.empty();) {
      progress = false;
      std::shuffle(order.begin(), order.end(), rng);
      for (int r : order) progress = step(r) || progress;
    }
    if (!errors.empty()) return errors.front();
    std::string stuck;
    for (int r = 0; r < P; ++r) {
      if (pc[r] < s.ranks[r].actions.size())
        stuck += " rank " + std::to_string(r) + " stuck at " + to_string(s.ranks[r].actions[pc[r]]) + ";";
      if (mode != Mode::kOverlapped) continue;
      if (!queued[r].empty()) stuck += " rank " + std::to_string(r) + " has batches never posted;";
      // The run ends with the compute stream waiting for the last batch.
      for (int b = 0; b < static_cast<int>(batch_posted[r].size()); ++b) clock[r] = std::max(clock[r], batch_time(r, b));
    }
    if (!stuck.empty()) return "deadlock:" + stuck;
    for (auto& [key, q] : sends)
      if (!q.empty()) return "unmatched send";
    for (auto& [key, q] : recvs)
      if (!q.empty()) return "unmatched receive";
    for (int r = 0; r < P; ++r)
      for (int i = 0; i < m * V; ++i) {
        if (!fwd[r][i]) return "missing forward on rank " + std::to_string(r);
        if (!s.config.forward_only && !bwd[r][i]) return "missing backward on rank " + std::to_string(r);
        if (s.config.forward_only && bwd[r][i]) return "backward in a forward-only schedule";
      }
    return "";
  }
  double makespan() const { return *std::max_element(clock.begin(), clock.end()); }
};

// Max number of received inputs (or output gradients) not yet consumed, from the list alone.
int pending_from_list(const std::vector<Action>& acts, ActionKind recv, ActionKind use) {
  int cur = 0, best = 0;
  for (const Action& a : acts) {
    if (a.kind == recv) best = std::max(best, ++cur);
    if (a.kind == use) {
      for (const Action& b : acts)
        if (b.kind == recv && b.microbatch == a.microbatch && b.chunk == a.chunk) {
          --cur;
          break;
        }
    }
  }
  return best;
}

// Makespan when every compute waits only for its data (no communication cost, no rendezvous):
// the lower bound for the compute orders, independent of the action lists.
double dependency_makespan(const ScheduleConfig& c, double tf, double tb) {
  const int P = c.pp, V = c.num_chunks(), S = P * V;
  std::vector<std::vector<ComputeStep>> order(P);
  for (int r = 0; r < P; ++r) order[r] = compute_order(c, r);
  std::map<std::tuple<bool, int, int>, double> finish;  // (forward, mb, stage) -> time
  std::vector<size_t> pos(P, 0);
  std::vector<double> clock(P, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r)
      while (pos[r] < order[r].size()) {
        const ComputeStep& st = order[r][pos[r]];
        const int stage = st.chunk * P + r;
        double start = clock[r];
        const bool needs = st.forward ? stage > 0 : stage < S - 1;
        if (needs) {
          auto it = finish.find({st.forward, st.microbatch, st.forward ? stage - 1 : stage + 1});
          if (it == finish.end()) break;
          start = std::max(start, it->second);
        }
        clock[r] = start + (st.forward ? tf : tb) / V;
        finish[{st.forward, st.microbatch, stage}] = clock[r];
        ++pos[r];
        progress = true;
      }
  }
  for (int r = 0; r < P; ++r) EXPECT_EQ(pos[r], order[r].size()) << "dependency deadlock";
  return *std::max_element(clock.begin(), clock.end());
}

void check_schedule(const ScheduleConfig& c, uint64_t seed) {
  SCOPED_TRACE("pp " + std::to_string(c.pp) + " vpp " + std::to_string(c.vpp) + " m " +
               std::to_string(c.num_microbatches) + " group " + std::to_string(c.microbatch_group_size) +
               (c.forward_only ? " forward-only" : ""));
  const PipelineSchedule s = build_schedule(c);
  const int V = c.num_chunks(), m = c.num_microbatches, total = m * V;
  ASSERT_EQ(static_cast<int>(s.ranks.size()), c.pp);
  for (int r = 0; r < c.pp; ++r) {
    const RankSchedule& rs = s.ranks[r];
    ASSERT_EQ(compute_signed(rs.actions), signed_chunk_order(c, r));
    // Flags: first forward / last backward of each chunk; one grad-sync point per chunk.
    std::vector<int> firsts(V, 0), lasts(V, 0), syncs(V, 0);
    std::vector<char> seen_f(V, 0);
    for (size_t i = 0; i < rs.actions.size(); ++i) {
      const Action& a = rs.actions[i];
      if (a.kind == ActionKind::kForward) {
        ASSERT_EQ(a.first_in_chunk, !seen_f[a.chunk]) << to_string(a);
        seen_f[a.chunk] = 1;
        firsts[a.chunk] += a.first_in_chunk;
      }
      if (a.kind == ActionKind::kBackward) {
        bool later = false;
        for (size_t j = i + 1; j < rs.actions.size(); ++j)
          later |= rs.actions[j].kind == ActionKind::kBackward && rs.actions[j].chunk == a.chunk;
        ASSERT_EQ(a.last_in_chunk, !later) << to_string(a);
        lasts[a.chunk] += a.last_in_chunk;
      }
      if (a.kind == ActionKind::kGradSync) ++syncs[a.chunk];
    }
    for (int ch = 0; ch < V; ++ch) {
      EXPECT_EQ(firsts[ch], 1);
      EXPECT_EQ(lasts[ch], c.forward_only ? 0 : 1);
      EXPECT_EQ(syncs[ch], c.forward_only ? 0 : 1);
    }
    EXPECT_EQ(rs.max_pending_recv_forward, pending_from_list(rs.actions, ActionKind::kRecvForward, ActionKind::kForward));
    EXPECT_EQ(rs.max_pending_recv_backward,
              pending_from_list(rs.actions, ActionKind::kRecvBackward, ActionKind::kBackward));
  }
  // Simulated with the durations the construction assumed: both modes reach the dependency
  // bound. With other durations they must still run (deadlock-freedom does not depend on
  // timing) and channel mode still reaches the bound.
  const double tf = c.forward_cost, tb = c.backward_cost;
  const double bound = dependency_makespan(c, tf, tb);
  Sim channels(s, Mode::kChannels, tf, tb, seed + 1);
  ASSERT_EQ(channels.run(), "") << "channel mode";
  EXPECT_NEAR(channels.makespan(), bound, 1e-9);
  Sim sim(s, Mode::kBatched, tf, tb, seed);
  ASSERT_EQ(sim.run(), "") << "batched mode";
  EXPECT_NEAR(sim.makespan(), static_cast<double>(s.construction_time) / c.num_chunks(), 1e-9);
  // Batched execution realises the construction's timeline; it reaches the dependency bound
  // for costs 1:1 and 1:2, and stays within 6% of it for 1:3 (rendezvous conflicts).
  if (c.backward_cost <= 2 || c.forward_only)
    EXPECT_NEAR(sim.makespan(), bound, 1e-9);
  else
    EXPECT_LE(sim.makespan(), 1.06 * bound);
  Sim other(s, Mode::kBatched, 1.0, 1.0 + (c.backward_cost % 3), seed + 2);
  ASSERT_EQ(other.run(), "") << "batched mode, other durations";
  Sim other_ch(s, Mode::kChannels, 1.0, 1.0 + (c.backward_cost % 3), seed + 3);
  ASSERT_EQ(other_ch.run(), "") << "channel mode, other durations";
  EXPECT_NEAR(other_ch.makespan(), dependency_makespan(c, 1.0, 1.0 + (c.backward_cost % 3)), 1e-9);
  // Overlapped batches (--overlap-p2p-communication) with the executor's plans: every ordering
  // edge is one of the batched execution's, so they run wherever batched execution does (any
  // durations), never take longer, and the plans' waits cover every received tensor (checked in
  // the simulation).
  Sim over(s, Mode::kOverlapped, tf, tb, seed + 4);
  ASSERT_EQ(over.run(), "") << "overlapped mode";
  EXPECT_LE(over.makespan(), sim.makespan() + 1e-9);
  EXPECT_GE(over.makespan(), bound - 1e-9);
  Sim over_other(s, Mode::kOverlapped, 1.0, 1.0 + (c.backward_cost % 3), seed + 5);
  ASSERT_EQ(over_other.run(), "") << "overlapped mode, other durations";
  EXPECT_LE(over_other.makespan(), other.makespan() + 1e-9);
  for (int r = 0; r < c.pp; ++r) {
    // Activation memory: Megatron's bound min(warm-up + 1, m·V) (1F1B: min(pp − rank, m)),
    // attained exactly.
    if (c.forward_only) continue;
    const int W = num_warmup_microbatches(c, r);
    int bound = std::min(W + 1, total);
    if (schedule_kind(c) == ScheduleKind::k1F1B) EXPECT_EQ(bound, std::min(c.pp - r, m));
    if (schedule_kind(c) == ScheduleKind::kNoPipelining) EXPECT_EQ(bound, 1);
    EXPECT_EQ(sim.max_live[r], bound) << "rank " << r;
    EXPECT_EQ(s.ranks[r].max_live_activations, bound);
  }
}

TEST(Schedules, SimulatedManyConfigurations) {
  uint64_t seed = 12345;
  int configs = 0;
  for (int pp = 1; pp <= 6; ++pp)
    for (int vpp : {0, 2, 3, 4})
      for (int m = 1; m <= 14; ++m)
        for (int group : {0, 1, 2, 3, 4, 5, 7})
          for (int variant = 0; variant < 3; ++variant) {
            const bool fo = variant == 1;
            ScheduleConfig c = cfg(pp, vpp, m, group, fo);
            if (variant == 2) c.backward_cost = (pp + m) % 2 == 0 ? 1 : 3;  // other construction costs
            if (vpp == 0 && group != 0) continue;  // group size only matters when interleaving
            try {
              validate_schedule_config(c);
            } catch (const Error&) {
              continue;
            }
            check_schedule(c, seed++);
            ++configs;
            if (::testing::Test::HasFatalFailure()) return;
          }
  std::printf("simulated %d configurations\n", configs);
  EXPECT_GT(configs, 300);
}

TEST(Schedules, SimulatedLargerConfigurations) {
  uint64_t seed = 777;
  for (auto [pp, vpp, m, group] : std::vector<std::tuple<int, int, int, int>>{
           {8, 0, 64, 0}, {8, 2, 64, 0}, {8, 4, 32, 8}, {16, 2, 32, 16}, {4, 8, 16, 4}, {8, 3, 24, 12}, {12, 2, 36, 12}}) {
    check_schedule(cfg(pp, vpp, m, group), seed++);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// With free communication the schedules finish in (m + (pp − 1)/V)·(tf + tb): the ideal time
// plus the theoretical bubble fraction (pp − 1)/(m·V). Channel execution reaches it for any
// durations; batched execution when the construction costs (1:1 or 1:2) match the real
// forward:backward ratio, within 7% for a matching 1:3; a 1:2 construction run at 1:1 or 1:3
// stays within 21% (1:1 at 1:3: 35%). The printed table is in docs/parallelism.md.
TEST(Schedules, MakespanMatchesTheoreticalBubble) {
  for (auto [pp, vpp, m] : std::vector<std::tuple<int, int, int>>{{1, 0, 4},  {2, 0, 4},  {4, 0, 8}, {4, 0, 3},
                                                                  {8, 0, 16}, {4, 2, 8},  {4, 4, 8}, {8, 2, 16},
                                                                  {2, 2, 4},  {4, 2, 12}, {8, 4, 32}}) {
    for (int cost_b : {1, 2, 3}) {
      ScheduleConfig c = cfg(pp, vpp, m);
      c.backward_cost = cost_b;
      const PipelineSchedule s = build_schedule(c);
      for (double tb : {1.0, 2.0, 3.0}) {
        const double tf = 1.0;
        const double expected = m * (tf + tb) * (1.0 + bubble_fraction(pp, vpp, m));
        Sim channels(s, Mode::kChannels, tf, tb);
        ASSERT_EQ(channels.run(), "");
        EXPECT_NEAR(channels.makespan(), expected, 1e-9)
            << "pp " << pp << " vpp " << vpp << " m " << m << " cost 1:" << cost_b << " tb " << tb;
        Sim batched(s, Mode::kBatched, tf, tb);
        ASSERT_EQ(batched.run(), "");
        std::printf("pp %d vpp %d m %2d cost 1:%d real 1:%.0f: channels %.2f batched %.2f (x%.3f)\n", pp, vpp, m,
                    cost_b, tb, channels.makespan(), batched.makespan(), batched.makespan() / expected);
        const std::string what = "batched pp " + std::to_string(pp) + " vpp " + std::to_string(vpp) + " m " +
                                 std::to_string(m) + " cost 1:" + std::to_string(cost_b) + " real 1:" +
                                 std::to_string(static_cast<int>(tb));
        if ((tb == cost_b && cost_b <= 2) || vpp <= 1) {
          EXPECT_NEAR(batched.makespan(), expected, 1e-9) << what;
        } else if (cost_b <= 2) {
          EXPECT_LE(batched.makespan(), (cost_b == 2 ? 1.21 : 1.35) * expected) << what;
        } else if (tb == cost_b) {
          EXPECT_LE(batched.makespan(), 1.07 * expected) << what;
        }  // a 1:3 construction run at other ratios: measured only (up to 1.6x; use 1:2)
      }
    }
  }
}

// With a transfer time per tensor, batched execution pays every batch's transfer on the compute
// stream (a batch is a rendezvous the computes wait at); overlapped batches pay only the
// transfers whose data the next compute reads, never more. The printed table is in
// docs/parallelism.md ("Overlapped p2p").
TEST(Schedules, OverlappedP2pHidesTransfers) {
  for (auto [pp, vpp, m] : std::vector<std::tuple<int, int, int>>{
           {2, 0, 8}, {2, 0, 32}, {4, 0, 16}, {2, 2, 8}, {4, 2, 16}, {8, 0, 32}, {8, 2, 32}}) {
    const ScheduleConfig c = cfg(pp, vpp, m);
    const PipelineSchedule s = build_schedule(c);
    for (double tc : {0.01, 0.05}) {  // of a whole-model forward (tf = 1, tb = 2)
      const double expected = m * 3.0 * (1.0 + bubble_fraction(pp, vpp, m));
      Sim batched(s, Mode::kBatched, 1.0, 2.0, 1, tc), over(s, Mode::kOverlapped, 1.0, 2.0, 2, tc),
          channels(s, Mode::kChannels, 1.0, 2.0, 3, tc);
      ASSERT_EQ(batched.run(), "");
      ASSERT_EQ(over.run(), "");
      ASSERT_EQ(channels.run(), "");
      std::printf("pp %d vpp %d m %2d transfer %.2f: no-transfer bound %.2f, batched %.2f (+%.1f%%), overlapped "
                  "%.2f (+%.1f%%), channels %.2f (+%.1f%%)\n",
                  pp, vpp, m, tc, expected, batched.makespan(), 100 * (batched.makespan() / expected - 1),
                  over.makespan(), 100 * (over.makespan() / expected - 1), channels.makespan(),
                  100 * (channels.makespan() / expected - 1));
      EXPECT_LT(over.makespan(), batched.makespan()) << "pp " << pp << " vpp " << vpp << " m " << m << " tc " << tc;
    }
  }
}

// The executor's plans (train/pipeline.h) under --overlap-p2p-communication: transfers run on a
// communication stream, in list order, each batch behind every compute listed before it; a compute
// runs after the batches up to the largest wait_batch so far. So a transfer listed AFTER a compute
// is ordered after it, and a transfer listed BEFORE a compute is ordered before it only if that
// compute (or an earlier one) waited for its batch. Every buffer a compute uses (its input, slot,
// head slot, gradient buffer; read or written) that an earlier transfer received into or sent from
// must be covered, or a receive could land under a running compute or a compute overwrite a
// tensor still being sent.
TEST(Schedules, OverlappedPlanWaitsOrderEveryBufferReuse) {
  int plans = 0;
  for (int pp = 1; pp <= 5; ++pp)
    for (int vpp : {0, 2, 3})
      for (int m = 1; m <= 10; ++m)
        for (const bool fo : {false, true}) {
          ScheduleConfig c = cfg(pp, vpp, m, 0, fo);
          c.overlap_p2p_comm = true;
          try {
            validate_schedule_config(c);
          } catch (const Error&) {
            continue;
          }
          PipelineLayout layout;
          layout.num_layers = pp * c.num_chunks();
          layout.pp = pp;
          layout.vpp = vpp;
          for (int r = 0; r < pp; ++r) {
            const PipelinePlan p = plan_pipeline(c, r, layers_of(r, layout));
            ++plans;
            // Physical buffer -> batch of the last transfer that used it: (kind, chunk, index),
            // kind 0 slot, 1 input (per chunk), 2 gradient buffer.
            std::map<std::tuple<int, int, int>, int> last;
            int waited = -1, batches = 0;
            for (size_t i = 0; i < p.actions.size(); ++i) {
              const Action& a = p.actions[i];
              const ChunkBuffers& b = p.buffers[i];
              const std::string where = fmt::format("pp {} vpp {} m {}{} rank {} action {} {}", pp, vpp, m,
                                                    fo ? " forward-only" : "", r, i, to_string(a));
              switch (a.kind) {
                case ActionKind::kRecvForward: last[{1, a.chunk, b.input}] = a.batch; break;
                case ActionKind::kSendForward:
                  last[{0, 0, b.slot}] = a.batch;
                  last[{1, a.chunk, b.input}] = a.batch;
                  break;
                case ActionKind::kRecvBackward:
                case ActionKind::kSendBackward:
                  ASSERT_GE(p.grad_buffer[i], 0) << where;
                  last[{2, 0, p.grad_buffer[i]}] = a.batch;
                  break;
                case ActionKind::kForward:
                case ActionKind::kBackward: {
                  waited = std::max(waited, p.wait_batch[i]);
                  std::vector<std::tuple<int, int, int>> used = {{0, 0, b.slot}, {1, a.chunk, b.input}};
                  if (p.grad_buffer[i] >= 0) used.push_back({2, 0, p.grad_buffer[i]});
                  for (const auto& key : used) {
                    auto it = last.find(key);
                    if (it != last.end())
                      ASSERT_GE(waited, it->second) << where << ": buffer (" << std::get<0>(key) << ", "
                                                    << std::get<1>(key) << ", " << std::get<2>(key)
                                                    << ") was used by batch " << it->second;
                  }
                  break;
                }
                case ActionKind::kGradSync: EXPECT_EQ(p.wait_batch[i], -1); break;
              }
              if (is_p2p(a.kind)) batches = std::max(batches, a.batch + 1);
            }
            EXPECT_EQ(p.num_batches, batches);
          }
        }
  std::printf("checked %d plans\n", plans);
  EXPECT_GT(plans, 300);
}

TEST(Schedules, ActionListsDeterministicAndRankActions) {
  const ScheduleConfig c = cfg(4, 2, 8);
  const PipelineSchedule a = build_schedule(c), b = build_schedule(c);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(a.ranks[r].actions, b.ranks[r].actions);
    EXPECT_EQ(rank_actions(c, r), a.ranks[r].actions);
  }
}

// ---------------------------------------------------------------------------------------------
// Errors

TEST(Schedules, Errors) {
  expect_error([] { build_schedule(cfg(0, 0, 4)); }, "pp must be >= 1, got 0");
  expect_error([] { build_schedule(cfg(2, 0, 0)); }, "number of micro-batches must be >= 1, got 0");
  expect_error([] { build_schedule(cfg(2, -1, 4)); }, "vpp must be >= 0, got -1");
  expect_error([] { build_schedule(cfg(2, 2, 4, -1)); }, "must be >= 0 (0 = pp), got -1");
  expect_error([] { build_schedule(cfg(1, 2, 4)); }, "the interleaved schedule (vpp = 2) needs pp > 1, got pp = 1");
  // Megatron's current rule: group size in [pp, m]; m mod group 0 or >= pp.
  expect_error([] { build_schedule(cfg(4, 2, 6)); },
               "number of micro-batches (6) mod group size (4) = 2 must be 0 or >= pp (4)");
  expect_error([] { build_schedule(cfg(4, 2, 3)); },
               "micro-batch group size per virtual stage (4) must be in [pp (4), number of micro-batches (3)]");
  expect_error([] { build_schedule(cfg(4, 2, 8, 3)); }, "(3) must be in [pp (4)");
  expect_error([] { build_schedule(cfg(4, 2, 8, 9)); }, "(9) must be in [pp (4), number of micro-batches (8)]");
  expect_error([] { build_schedule(cfg(4, 2, 11, 5)); }, "(11) mod group size (5) = 1 must be 0 or >= pp (4)");
  build_schedule(cfg(4, 2, 9, 5));     // 9 mod 5 = 4 >= pp: allowed
  build_schedule(cfg(4, 0, 7));        // 1F1B: any m
  expect_error([] { num_warmup_microbatches(cfg(4, 0, 8), 4); }, "pp_rank 4 outside [0, pp = 4)");
  expect_error([] { rank_actions(cfg(4, 0, 8), -1); }, "pp_rank -1 outside");
  expect_error([] { get_schedule_table(0, 2, 2); }, "must be >= 1");
  expect_error([] { convert_schedule_table_to_order(5, 2, get_schedule_table(2, 2, 2)); }, "num_warmup 5 outside [0, 4]");
  expect_error([] { bubble_fraction(0, 0, 1); }, "out of range");
  ScheduleConfig zero = cfg(2, 0, 4);
  zero.backward_cost = 0;
  expect_error([&] { build_schedule(zero); }, "construction costs must be >= 1: forward 1, backward 0");
  // Layout mismatches are caught before any communication.
  PipelineLayout layout;
  layout.num_layers = 32;
  layout.pp = 4;
  layout.vpp = 2;
  validate_schedule_for_layout(cfg(4, 2, 8), layout);
  expect_error([&] { validate_schedule_for_layout(cfg(2, 2, 8), layout); }, "layer layout pp (4) differs from schedule pp (2)");
  expect_error([&] { validate_schedule_for_layout(cfg(4, 0, 8), layout); }, "layer layout has 2 chunks per rank, schedule 1");
  layout.num_layers = 30;
  expect_error([&] { validate_schedule_for_layout(cfg(4, 2, 8), layout); }, "num_layers (30) = 30 is not divisible by pp (4)");
}

}  // namespace
}  // namespace mt::pipeline
