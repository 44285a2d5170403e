#include "comm/nccl/nccl_watchdog.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

namespace mt::nccl_detail {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

struct Watchdog::State {
  struct CommInfo {
    std::string desc;
    double timeout_s;
    int device;
  };
  struct Entry {
    ncclComm_t comm;
    cudaEvent_t event;
    int device;
    const char* op;
    Clock::time_point enqueued;
  };
  struct HostCall {
    std::string what;  // or, when desc is set, "NCCL <op> on <*desc>"
    double timeout_s;
    Clock::time_point start;
    const char* op = nullptr;
    const std::string* desc = nullptr;
  };

  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::thread thread;
  std::unordered_map<ncclComm_t, CommInfo> comms;
  std::deque<Entry> entries;
  std::unordered_map<int, std::vector<cudaEvent_t>> free_events;  // by device
  std::map<uint64_t, HostCall> host_calls;
  uint64_t next_id = 1;
  double period_s = 1.0;
  int first_device = -1;

  void loop();
  void update_period(double timeout_s);
  [[noreturn]] void die(std::unique_lock<std::mutex>& lk, const std::string& msg);
};

Watchdog& Watchdog::instance() {
  static Watchdog w;
  return w;
}

Watchdog::State* Watchdog::state() {
  if (!state_) state_ = new State();  // owned; deleted in ~Watchdog
  return state_;
}

Watchdog::~Watchdog() {
  if (!state_) return;
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  if (state_->thread.joinable()) state_->thread.join();
  // Events are not destroyed: at process exit the CUDA runtime may already be unloading.
  delete state_;
}

void Watchdog::State::update_period(double timeout_s) {
  if (timeout_s > 0) period_s = std::min(period_s, std::max(0.01, timeout_s / 20.0));
}

void Watchdog::add_comm(ncclComm_t comm, const std::string& desc, double timeout_s, int device) {
  State* s = state();
  std::lock_guard<std::mutex> lk(s->mu);
  s->comms[comm] = {desc, timeout_s, device};
  s->update_period(timeout_s);
  if (s->first_device < 0) s->first_device = device;
  if (!s->thread.joinable()) s->thread = std::thread([s] { s->loop(); });
}

void Watchdog::remove_comm(ncclComm_t comm) {
  State* s = state();
  std::lock_guard<std::mutex> lk(s->mu);
  s->comms.erase(comm);
  for (auto it = s->entries.begin(); it != s->entries.end();) {
    if (it->comm == comm) {
      s->free_events[it->device].push_back(it->event);
      it = s->entries.erase(it);
    } else {
      ++it;
    }
  }
}

void Watchdog::enqueued(ncclComm_t comm, cudaStream_t stream, const char* op) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  if (cs != cudaStreamCaptureStatusNone) return;  // captured into a CUDA graph: not watched
  State* s = state();
  std::lock_guard<std::mutex> lk(s->mu);
  auto ci = s->comms.find(comm);
  if (ci == s->comms.end()) return;
  const int device = ci->second.device;
  cudaEvent_t ev = nullptr;
  auto& pool = s->free_events[device];
  if (!pool.empty()) {
    ev = pool.back();
    pool.pop_back();
  } else if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
    cudaGetLastError();
    return;  // out of resources: this operation is not watched (the main thread sees the error)
  }
  if (cudaEventRecord(ev, stream) != cudaSuccess) {
    cudaGetLastError();
    pool.push_back(ev);
    return;
  }
  s->entries.push_back({comm, ev, device, op, Clock::now()});
}

uint64_t Watchdog::host_begin(const std::string& what, double timeout_s) {
  if (timeout_s <= 0) return 0;
  State* s = state();
  std::lock_guard<std::mutex> lk(s->mu);
  const uint64_t id = s->next_id++;
  s->host_calls[id] = {what, timeout_s, Clock::now()};
  s->update_period(timeout_s);
  if (!s->thread.joinable()) s->thread = std::thread([s] { s->loop(); });
  return id;
}

uint64_t Watchdog::host_begin(const char* op, const std::string* desc, double timeout_s) {
  if (timeout_s <= 0) return 0;
  State* s = state();
  std::lock_guard<std::mutex> lk(s->mu);
  const uint64_t id = s->next_id++;
  s->host_calls[id] = {std::string(), timeout_s, Clock::now(), op, desc};
  s->update_period(timeout_s);
  if (!s->thread.joinable()) s->thread = std::thread([s] { s->loop(); });
  return id;
}

void Watchdog::host_end(uint64_t id) {
  if (id == 0) return;
  State* s = state();
  std::lock_guard<std::mutex> lk(s->mu);
  s->host_calls.erase(id);
}

void Watchdog::State::loop() {
  // No CUDA call before a communicator names the device: the thread can start for a host call (the
  // NCCL bootstrap's) before any communicator exists, and a CUDA call on a new thread goes to device
  // 0 and makes a context there (seen on 2 x H200: 518 MiB of every other rank on GPU 0).
  bool cuda_ready = false;
  std::unique_lock<std::mutex> lk(mu);
  while (!stop) {
    cv.wait_for(lk, std::chrono::duration<double>(period_s));
    if (stop) break;
    if (!cuda_ready && first_device >= 0) {
      if (cudaSetDevice(first_device) == cudaSuccess) {
        // Event queries from this thread must never invalidate a graph capture on another thread.
        cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
        cudaThreadExchangeStreamCaptureMode(&mode);
        cuda_ready = true;
      } else {
        cudaGetLastError();  // tried again at the next wake-up; no event is queried until then
      }
    }
    for (const auto& [id, hc] : host_calls) {
      const double t = seconds_since(hc.start);
      if (t > hc.timeout_s) {
        const std::string what = hc.desc ? fmt::format("NCCL {} on {}", hc.op, *hc.desc) : hc.what;
        die(lk, fmt::format("{} did not return within {:.1f} s (--distributed-timeout-minutes={:.3g}): a peer rank "
                            "has died, is stuck, or was never started",
                            what, hc.timeout_s, hc.timeout_s / 60.0));
      }
    }
    for (const auto& [comm, info] : comms) {
      ncclResult_t err = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &err) == ncclSuccess && err != ncclSuccess && err != ncclInProgress) {
        die(lk, fmt::format("NCCL reported an asynchronous error on {}: {} ({}); a peer rank has probably died or "
                            "lost its connection",
                            info.desc, ncclGetErrorString(err), ncclGetLastError(comm)));
      }
    }
    // (entries exist only once a communicator is registered, which sets first_device)
    for (auto it = entries.begin(); cuda_ready && it != entries.end();) {
      cudaError_t q = cudaEventQuery(it->event);
      if (q == cudaErrorNotReady) {
        auto ci = comms.find(it->comm);
        const double t = seconds_since(it->enqueued);
        if (ci != comms.end() && ci->second.timeout_s > 0 && t > ci->second.timeout_s) {
          die(lk, fmt::format("NCCL {} on {} has not completed {:.1f} s after it was enqueued "
                              "(--distributed-timeout-minutes={:.3g}): a peer rank has died or is stuck",
                              it->op, ci->second.desc, t, ci->second.timeout_s / 60.0));
        }
        ++it;
        continue;
      }
      // Completed, or a CUDA error that the main thread will report at its next CUDA call.
      if (q != cudaSuccess) cudaGetLastError();
      free_events[it->device].push_back(it->event);
      it = entries.erase(it);
    }
  }
}

void Watchdog::State::die(std::unique_lock<std::mutex>& lk, const std::string& msg) {
  std::vector<ncclComm_t> to_abort;
  for (const auto& [comm, info] : comms) to_abort.push_back(comm);
  lk.unlock();
  std::fprintf(stderr,
               "[megatron.cpp NCCL watchdog] %s. Aborting %zu NCCL communicator(s) and exiting this process with "
               "status 1 (a rank cannot continue after a failed collective).\n",
               msg.c_str(), to_abort.size());
  std::fflush(stderr);
  // ncclCommAbort lets kernels blocked on the dead peer return and closes connections, so that
  // peers notice sooner. Bounded: exit anyway after 10 s.
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread([to_abort, done] {
    for (ncclComm_t c : to_abort) ncclCommAbort(c);
    done->store(true);
  }).detach();
  const auto t0 = Clock::now();
  while (!done->load() && seconds_since(t0) < 10.0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::_Exit(1);
}

}  // namespace mt::nccl_detail
