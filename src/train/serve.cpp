#include "train/serve.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <limits>
#include <span>
#include <type_traits>
#include <mutex>
#include <thread>

#include "core/logging.h"
#include "data/data_args.h"
#include "train/generate.h"
#include "train/inference.h"
#include "train/serve_request.h"

namespace mt {

namespace {

// ---------------------------------------------------------------------------------------------
// Generations run on the main thread of every rank (Megatron's text generation server: rank 0
// serves HTTP and broadcasts each generation to the other ranks, which wait for it). The HTTP
// threads of rank 0 queue jobs; the main thread takes them one at a time, broadcasts a fixed
// header and the prompts to the other tensor / pipeline parallel ranks, and all ranks generate
// together. While idle, rank 0 broadcasts a no-op header every `keepalive` seconds so the others'
// waiting collective stays within the distributed timeout.
// ---------------------------------------------------------------------------------------------

enum JobKind : int64_t { kNoop = 0, kGenerate = 1, kStop = 2 };

// Header: kind, prompts, total prompt tokens, max_new_tokens, greedy, top_k, seed, eod,
// temperature and top_p (fp32 bit patterns).
constexpr int64_t kHeader = 10;

class JobChannel {
 public:
  JobChannel(Communicator& world, Device device, const Stream& stream)
      : world_(world), device_(device), stream_(stream), header_(device, kHeader * sizeof(int64_t)) {}

  /// HTTP thread: queue a generation and wait for its result (rethrows its error).
  GenerationResult submit(std::vector<std::vector<int32_t>> prompts, const GenerationOptions& o) {
    Job job{std::move(prompts), o, {}};
    std::future<GenerationResult> done = job.done.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      MT_REQUIRE(!stopped_, "the server is stopping");
      queue_.push_back(&job);
    }
    cv_.notify_one();
    return done.get();
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
    }
    cv_.notify_one();
  }

  /// Rank 0's main thread: run the queued jobs until stop().
  void lead(TextGenerator& gen, double keepalive_s) {
    for (;;) {
      Job* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, std::chrono::duration<double>(keepalive_s), [&] { return stopped_ || !queue_.empty(); });
        if (stopped_ && queue_.empty()) {
          send({kStop}, {});
          return;
        }
        if (!queue_.empty()) {
          job = queue_.front();
          queue_.pop_front();
        }
      }
      if (job == nullptr) {  // idle: keep the other ranks' wait alive
        send({kNoop}, {});
        continue;
      }
      try {
        const GenerationOptions& o = job->options;
        std::vector<int32_t> flat;
        for (const auto& p : job->prompts) {
          flat.push_back(static_cast<int32_t>(p.size()));
          flat.insert(flat.end(), p.begin(), p.end());
        }
        int64_t t = 0, q = 0;
        std::memcpy(&t, &o.sampling.temperature, sizeof(float));
        std::memcpy(&q, &o.sampling.top_p, sizeof(float));
        const auto total = static_cast<int64_t>(flat.size());  // before `flat` moves into the call
        send({kGenerate, static_cast<int64_t>(job->prompts.size()), total, o.max_new_tokens,
              o.sampling.greedy ? 1 : 0, o.sampling.top_k, static_cast<int64_t>(o.sampling.seed), o.eod, t, q},
             std::move(flat));
        job->done.set_value(gen.generate(job->prompts, o));
      } catch (...) {
        job->done.set_exception(std::current_exception());
      }
    }
  }

  /// The other ranks: generate what rank 0 broadcasts, until it stops.
  void follow(TextGenerator& gen) {
    for (;;) {
      std::vector<int64_t> h(kHeader);
      broadcast_host(h.data(), h.size() * sizeof(int64_t), header_);
      if (h[0] == kStop) return;
      if (h[0] != kGenerate) continue;
      std::vector<int32_t> flat(static_cast<size_t>(h[2]));
      Buffer payload(device_, std::max<size_t>(flat.size(), 1) * sizeof(int32_t));
      broadcast_host(flat.data(), flat.size() * sizeof(int32_t), payload);
      std::vector<std::vector<int32_t>> prompts;
      for (size_t i = 0; i < flat.size();) {
        const auto n = static_cast<size_t>(flat[i++]);
        prompts.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(i),
                             flat.begin() + static_cast<std::ptrdiff_t>(i + n));
        i += n;
      }
      GenerationOptions o;
      o.max_new_tokens = h[3];
      o.sampling.greedy = h[4] != 0;
      o.sampling.top_k = h[5];
      o.sampling.seed = static_cast<uint64_t>(h[6]);
      o.eod = static_cast<int32_t>(h[7]);
      std::memcpy(&o.sampling.temperature, &h[8], sizeof(float));
      std::memcpy(&o.sampling.top_p, &h[9], sizeof(float));
      try {
        gen.generate(prompts, o);  // rank 0 reports an error in it to its client
      } catch (const Error&) {
      }
    }
  }

 private:
  struct Job {
    std::vector<std::vector<int32_t>> prompts;
    GenerationOptions options;
    std::promise<GenerationResult> done;
  };
  // Broadcast of host bytes from rank 0 through `buf` (the communicator's device memory).
  void broadcast_host(void* host, size_t bytes, const Buffer& buf) {
    if (bytes == 0) return;
    const Tensor t(buf.data(), DType::kU8, device_, {static_cast<int64_t>(bytes)});
    if (world_.rank() == 0) copy_bytes(buf.data(), device_, host, Device::cpu(), bytes, stream_);
    world_.broadcast(t, 0, stream_);
    if (world_.rank() != 0) copy_bytes(host, Device::cpu(), buf.data(), device_, bytes, stream_);
    stream_.synchronize();
  }
  void send(std::vector<int64_t> header, std::vector<int32_t> payload) {
    if (world_.size() == 1) return;
    header.resize(kHeader, 0);
    broadcast_host(header.data(), header.size() * sizeof(int64_t), header_);
    if (!payload.empty()) {
      Buffer buf(device_, payload.size() * sizeof(int32_t));
      broadcast_host(payload.data(), payload.size() * sizeof(int32_t), buf);
    }
  }

  Communicator& world_;
  Device device_;
  const Stream& stream_;
  Buffer header_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job*> queue_;
  bool stopped_ = false;
};

class Server {
 public:
  Server(const ServeArgs& a, data::Tokenizer& tok, JobChannel& jobs, int64_t max_batch, int64_t max_seq)
      : args_(a), tok_(&tok), jobs_(jobs), max_batch_(max_batch), max_seq_(max_seq) {
    try {
      eod_ = tok_->eod();
    } catch (const Error&) {
    }
  }

  struct Output {
    std::vector<std::vector<int32_t>> tokens;  // prompt + new
    std::vector<int64_t> prompt_tokens;
  };

  /// Runs one request's prompts (queued behind other requests). Errors: HttpError 400 for a prompt
  /// the tokenizer refuses or the context cannot hold, 503 when --max-queued-requests requests are
  /// already generating or waiting.
  Output generate(const std::vector<std::string>& prompts, int64_t new_tokens, const SamplingOptions& s) {
    std::vector<std::vector<int32_t>> ids;
    for (const auto& p : prompts) {
      std::vector<int32_t> t;
      try {
        t = tok_->encode(p);
      } catch (const Error& e) {
        throw HttpError(400, fmt::format("the prompt cannot be tokenized: {}", e.what()));
      }
      if (t.empty()) t.push_back(eod_ >= 0 ? eod_ : 0);
      if (static_cast<int64_t>(t.size()) >= max_seq_)
        throw HttpError(400, fmt::format("a prompt of {} tokens does not fit the context of {} tokens (at most {} "
                                         "prompt tokens)", t.size(), max_seq_, max_seq_ - 1));
      ids.push_back(std::move(t));
    }
    const Admission admitted(active_, args_.max_queued_requests);
    GenerationOptions o;
    o.max_new_tokens = std::min(new_tokens, max_seq_);  // a sequence stops at the context anyway
    o.sampling = s;
    o.eod = eod_;
    Output out;
    const int64_t B = max_batch_;  // the batches of one request run in order (jobs queue on the main thread)
    for (size_t first = 0; first < ids.size(); first += static_cast<size_t>(B)) {
      const std::vector<std::vector<int32_t>> part(ids.begin() + static_cast<std::ptrdiff_t>(first),
                                                   ids.begin() + static_cast<std::ptrdiff_t>(std::min(ids.size(), first + B)));
      o.sampling.seed = s.seed + first;
      const GenerationResult r = jobs_.submit(part, o);  // an error in it is the server's: HTTP 500
      for (size_t i = 0; i < part.size(); ++i) {
        out.tokens.push_back(r.tokens[i]);
        out.prompt_tokens.push_back(r.prompt_lengths[i]);
      }
    }
    return out;
  }

  HttpReply megatron_api(const nlohmann::json& j) {
    const GenerationRequest r = parse_megatron_api(j, args_.max_prompts, next_seed());
    if (r.stop_token >= 0 && r.stop_token != eod_)
      throw HttpError(400, fmt::format("'stop_token' {} is not supported by this server: generation stops at the "
                                       "tokenizer's end of document {}", r.stop_token, eod_));
    const Output o = generate(r.prompts, r.tokens_to_generate, r.sampling);
    return {200, megatron_api_reply(*tok_, o.tokens)};
  }

  HttpReply completions(const nlohmann::json& j) {
    const GenerationRequest r = parse_completion(j, args_.max_prompts, next_seed());
    const Output o = generate(r.prompts, r.tokens_to_generate, r.sampling);
    nlohmann::json choices = nlohmann::json::array();
    int64_t prompt_total = 0, new_total = 0;
    for (size_t i = 0; i < o.tokens.size(); ++i) {
      std::span<const int32_t> seq(o.tokens[i]);
      const auto prompt = o.prompt_tokens[i];
      const bool at_eod = static_cast<int64_t>(seq.size()) > prompt && seq.back() == eod_;
      if (i % static_cast<size_t>(r.n) == 0) prompt_total += prompt;  // each prompt counts once
      new_total += static_cast<int64_t>(seq.size()) - prompt;
      if (at_eod) seq = seq.first(seq.size() - 1);
      const CompletionText c = completion_text(*tok_, seq, prompt, r.echo, r.stop);
      choices.push_back({{"text", c.text}, {"index", i}, {"logprobs", nullptr},
                         {"finish_reason", at_eod || c.stopped_by_string ? "stop" : "length"}});
    }
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    return {200,
            {{"id", fmt::format("cmpl-{}", ++request_id_)},
             {"object", "text_completion"},
             {"created", std::chrono::duration_cast<std::chrono::seconds>(now).count()},
             {"model", j.contains("model") && j["model"].is_string() ? j["model"].get<std::string>() : args_.load},
             {"choices", choices},
             {"usage", {{"prompt_tokens", prompt_total}, {"completion_tokens", new_total},
                        {"total_tokens", prompt_total + new_total}}}}};
  }

  uint64_t next_seed() { return 1234 + request_id_.load(); }

 private:
  // A request counted among those generating or waiting (at most `max`; one more is HTTP 503).
  class Admission {
   public:
    Admission(std::atomic<int64_t>& count, int64_t max) : count_(count) {
      if (count_.fetch_add(1) >= max) {
        count_.fetch_sub(1);
        throw HttpError(503, fmt::format("the server is busy: {} requests are generating or waiting "
                                         "(--max-queued-requests); retry later", max));
      }
    }
    ~Admission() { count_.fetch_sub(1); }
    Admission(const Admission&) = delete;
    Admission& operator=(const Admission&) = delete;

   private:
    std::atomic<int64_t>& count_;
  };

  const ServeArgs& args_;
  data::Tokenizer* tok_;
  JobChannel& jobs_;
  int64_t max_batch_, max_seq_;
  int32_t eod_ = -1;
  std::atomic<uint64_t> request_id_{0};
  std::atomic<int64_t> active_{0};
};

void reply(httplib::Response& res, const HttpReply& r) {
  res.status = r.status;
  if (r.status == 503) res.set_header("Retry-After", "1");
  res.set_content(dump_json(r.body), "application/json");
}

/// Parses the body and runs a handler; every failure becomes a JSON error reply (never an exception
/// for httplib to turn into a bare 500).
void handle(const httplib::Request& req, httplib::Response& res, const std::function<HttpReply(const nlohmann::json&)>& fn) {
  HttpReply r;
  try {
    r = fn(parse_request_body(req.body));
  } catch (const HttpError& e) {
    r = {e.status, {{"error", e.what()}}};
  } catch (const std::exception& e) {
    r = {500, {{"error", e.what()}}};
  } catch (...) {
    r = {500, {{"error", "unknown error"}}};
  }
  reply(res, r);
}

/// httplib's server with a listen backlog of its own: httplib listens with CPPHTTPLIB_LISTEN_BACKLOG
/// (5, compiled into Debian's library), so of a burst of connections more than the accept loop takes
/// at once get their SYN dropped and wait 1 s or more for its retransmission (144 loopback
/// connections took 13 s). listen() again on the bound socket sets the backlog (POSIX; the kernel
/// caps it at net.core.somaxconn).
class HttpServer : public httplib::Server {
 public:
  static constexpr int kListenBacklog = 1024;
  bool raise_listen_backlog() { return ::listen(svr_sock_, kListenBacklog) == 0; }
};

/// httplib's thread pool: `threads` workers, each serving one connection at a time; where httplib
/// can bound its queue of accepted connections (0.15 and later: ThreadPool(n, max_queued)), at most
/// `max_queued` wait for a worker and the next ones are closed at once.
template <typename Pool>
httplib::TaskQueue* make_pool(size_t threads, size_t max_queued) {
  if constexpr (std::is_constructible_v<Pool, size_t, size_t>) {
    return new Pool(threads, max_queued);
  } else {
    return new Pool(threads);
  }
}

}  // namespace

void add_serve_options(CLI::App& app, ServeArgs& a) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--load", a.load, "Checkpoint directory")->required();
  app.add_option("--vocab-file", a.vocab_file, "GPT-2 vocab.json");
  app.add_option("--merge-file", a.merge_file, "GPT-2 merges.txt");
  app.add_option("--tokenizer-type", a.tokenizer_type, "Tokenizer of --tokenizer-model")->capture_default_str();
  app.add_option("--tokenizer-model", a.tokenizer_model, "tokenizer.json or SentencePiece model");
  data::add_tiktoken_options(app, a.tiktoken);
  app.add_option("--host", a.host, "Address to listen on")->capture_default_str();
  app.add_option("--port", a.port, "Port (0 = any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
  app.add_option("--port-file", a.port_file, "Write the bound port to this file once listening");
  app.add_option("--micro-batch-size", a.micro_batch_size, "Prompts generated together")->capture_default_str();
  app.add_option("--seq-length", a.seq_length, "Context: prompt + generated tokens (0 = the checkpoint's)")
      ->capture_default_str();
  app.add_option("--max-prompts", a.max_prompts, "Prompts per request at most")->capture_default_str();
  app.add_option("--max-request-bytes", a.max_request_bytes, "Largest request body accepted")->capture_default_str();
  app.add_option("--http-threads", a.http_threads, "HTTP worker threads: connections served at once")
      ->capture_default_str()->check(CLI::Range(2, 65536));
  app.add_option("--max-queued-requests", a.max_queued_requests,
                 "Requests generating or waiting at most; more get HTTP 503")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, std::numeric_limits<int64_t>::max()));
  app.add_option("--http-timeout", a.http_timeout,
                 "Seconds a connection may stall reading a request or writing a reply (an idle keep-alive "
                 "connection is closed after at most 5)")
      ->capture_default_str()->check(CLI::Range(1, 3600));
  app.add_option("--device", a.device, "cpu, cuda, cuda:N or auto")->capture_default_str();
  app.add_flag("--bf16", a.bf16, "bf16 (CUDA)");
  app.add_flag("--fp16", a.fp16, "fp16 (CUDA)");
  app.add_option("--tensor-model-parallel-size", a.tensor_model_parallel_size, "Tensor-parallel size")
      ->capture_default_str();
  app.add_option("--pipeline-model-parallel-size", a.pipeline_model_parallel_size, "Pipeline-parallel size")
      ->capture_default_str();
  app.add_option("--nproc-per-node", a.nproc_per_node, "Start N ranks on this machine")->capture_default_str();
}

int run_serve(const ServeArgs& a) {
  MT_REQUIRE(a.micro_batch_size >= 1, "--micro-batch-size must be >= 1, got {}", a.micro_batch_size);
  MT_REQUIRE(a.max_prompts >= 1, "--max-prompts must be >= 1, got {}", a.max_prompts);
  MT_REQUIRE(a.max_queued_requests < a.http_threads, "--max-queued-requests {} must be smaller than --http-threads {} "
             "(threads must stay free to answer other requests, with 503 when the queue is full)",
             a.max_queued_requests, a.http_threads);
  InferenceModelOptions o;
  o.load = a.load;
  o.device = a.device;
  o.bf16 = a.bf16;
  o.fp16 = a.fp16;
  o.seq_length = a.seq_length;
  o.tp = a.tensor_model_parallel_size;
  o.pp = a.pipeline_model_parallel_size;
  InferenceModel im = load_inference_model(o);
  std::unique_ptr<data::Tokenizer> tok = inference_tokenizer(a.load, a.vocab_file, a.merge_file, a.tokenizer_type,
                                                             a.tokenizer_model, im.state.model.vocab_size, a.tiktoken);
  TextGenerator gen(*im.model, a.micro_batch_size, im.config.seq_length, *im.stream);
  JobChannel jobs(*im.world, im.device, *im.stream);
  if (im.world->rank() != 0) {  // the other ranks generate what rank 0 broadcasts
    jobs.follow(gen);
    return 0;
  }
  Server server(a, *tok, jobs, gen.max_batch(), gen.max_sequence_length());
  HttpServer http;
  http.set_payload_max_length(a.max_request_bytes);
  // Slow and idle clients: each connection holds a worker thread while it is open (httplib is
  // thread-per-connection), so a stalled read or write ends after --http-timeout, an idle
  // keep-alive connection is closed after at most 5 s, and the pool is large enough that the
  // requests waiting for generation (--max-queued-requests) leave threads for everyone else.
  http.set_read_timeout(a.http_timeout, 0);
  http.set_write_timeout(a.http_timeout, 0);
  http.set_keep_alive_timeout(std::min(a.http_timeout, 5));
  http.set_keep_alive_max_count(100);
  // A reply is written in pieces (headers, body): without TCP_NODELAY, Nagle's algorithm holds the
  // body until the client acknowledges the headers, which a client delays by 40 ms.
  http.set_tcp_nodelay(true);
  http.new_task_queue = [&a] {
    return make_pool<httplib::ThreadPool>(static_cast<size_t>(a.http_threads), static_cast<size_t>(a.http_threads));
  };
  http.Put("/api", [&](const httplib::Request& q, httplib::Response& r) {
    handle(q, r, [&](const nlohmann::json& j) { return server.megatron_api(j); });
  });
  http.Post("/v1/completions", [&](const httplib::Request& q, httplib::Response& r) {
    handle(q, r, [&](const nlohmann::json& j) { return server.completions(j); });
  });
  // Bodies over --max-request-bytes: httplib answers 413; make it a 400 with a message. Every
  // other error httplib answers itself (404, 400 for a malformed request) gets a JSON body too.
  http.set_error_handler([&](const httplib::Request&, httplib::Response& r) {
    if (r.status == 413) {
      reply(r, {400, {{"error", fmt::format("the request is larger than --max-request-bytes {}", a.max_request_bytes)}}});
    } else if (r.body.empty()) {
      reply(r, {r.status, {{"error", fmt::format("HTTP {}", r.status)}}});
    }
  });
  int port = a.port;
  if (port == 0) {
    port = http.bind_to_any_port(a.host);
    MT_REQUIRE(port > 0, "cannot listen on {}", a.host);
  } else {
    MT_REQUIRE(http.bind_to_port(a.host, port), "cannot listen on {}:{} (in use?)", a.host, port);
  }
  MT_REQUIRE(http.raise_listen_backlog(), "listen() on {}:{} with a backlog of {} failed: {}", a.host, port,
             HttpServer::kListenBacklog, std::strerror(errno));
  if (!a.port_file.empty()) {
    std::ofstream f(a.port_file + ".tmp");
    f << port << "\n";
    f.close();
    std::rename((a.port_file + ".tmp").c_str(), a.port_file.c_str());
  }
  log_info("> serving {} on http://{}:{} (PUT /api, POST /v1/completions){}", a.load, a.host, port,
           im.world->size() > 1 ? fmt::format(" with {} ranks (tensor parallel {}, pipeline parallel {})",
                                              im.world->size(), a.tensor_model_parallel_size,
                                              a.pipeline_model_parallel_size)
                                : std::string());
  // HTTP on its own thread; generations on this one (they broadcast to the other ranks).
  bool listen_ok = true;
  std::thread listener([&] {
    listen_ok = http.listen_after_bind();
    jobs.stop();
  });
  jobs.lead(gen, 60.0);  // a no-op broadcast each idle minute (the distributed timeout is 10)
  listener.join();
  MT_REQUIRE(listen_ok, "the server on {}:{} stopped with an error", a.host, port);
  return 0;
}

}  // namespace mt
