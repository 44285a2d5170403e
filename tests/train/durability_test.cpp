// Checkpoint durability and run checks of `megatron pretrain` on CPU, end to end through the
// binary (MT_MEGATRON_BIN): per-shard checksums (flipped byte, truncated and missing shard named),
// --fallback-to-previous-checkpoint, a failed save (file-size limit = disk full) leaving nothing
// behind, --async-save writing the same bytes as a synchronous save and not changing the losses,
// SIGKILL at random points during saves (the latest checkpoint always loads and training resumes
// bitwise), --exit-signal-handler, --exit-duration-in-mins, --no-save-optim, --no-load-rng,
// --check-for-nan-in-loss-and-grad, and the TensorBoard / --metrics-file outputs.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <thread>

#include "testing/testing.h"
#include "train/tensorboard.h"

namespace fs = std::filesystem;

namespace {

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// A child process running the binary with stdout+stderr in a file.
struct Child {
  pid_t pid = -1;
  fs::path log;
  std::string output() const { return read_bytes(log); }
  // Waits; returns the exit status, or 128 + signal.
  int wait() {
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
  // Non-blocking: true when it has exited (status in *rc).
  bool exited(int* rc) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) != pid) return false;
    *rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return true;
  }
};

// in_shell: the shell stays the binary's parent (a stand-in for a launcher: killing c.pid
// orphans the binary) instead of exec'ing it.
Child spawn(const std::string& args, const fs::path& log, rlim_t fsize_limit = RLIM_INFINITY, bool in_shell = false) {
  const char* bin = std::getenv("MT_MEGATRON_BIN");
  const std::string exe = std::string(bin ? bin : "megatron") + " " + args;
  const std::string cmd = in_shell ? exe + " & wait" : "exec " + exe;
  Child c;
  c.log = log;
  c.pid = fork();
  if (c.pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    if (fsize_limit != RLIM_INFINITY) {  // "disk full": writes past the limit fail with EFBIG
      signal(SIGXFSZ, SIG_IGN);
      rlimit rl{fsize_limit, fsize_limit};
      setrlimit(RLIMIT_FSIZE, &rl);
    }
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return c;
}

struct RunResult {
  int rc;
  std::string out;
};

class Durability : public ::testing::Test {
 protected:
  static fs::path dir;
  static std::string tok, data;
  static int runs;

  static RunResult run(const std::string& args, rlim_t fsize_limit = RLIM_INFINITY) {
    Child c = spawn(args, dir / ("run" + std::to_string(runs++) + ".log"), fsize_limit);
    const int rc = c.wait();
    return {rc, c.output()};
  }

  static void SetUpTestSuite() {
    dir = fs::temp_directory_path() / ("mt_durability_test_" + std::to_string(getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir / "corpus");
    // A GPT-2-format byte-level vocabulary of 256 byte tokens + <|endoftext|>.
    nlohmann::json vocab;
    std::vector<int> bs;
    for (int b = 33; b <= 126; ++b) bs.push_back(b);
    for (int b = 161; b <= 172; ++b) bs.push_back(b);
    for (int b = 174; b <= 255; ++b) bs.push_back(b);
    std::vector<uint32_t> cs(bs.begin(), bs.end());
    int extra = 0;
    for (int b = 0; b < 256; ++b)
      if (std::find(bs.begin(), bs.end(), b) == bs.end()) bs.push_back(b), cs.push_back(256 + extra++);
    auto utf8 = [](uint32_t cp) {
      std::string s;
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      return s;
    };
    for (size_t i = 0; i < bs.size(); ++i) vocab[utf8(cs[i])] = static_cast<int>(i);
    vocab["<|endoftext|>"] = 256;
    std::ofstream(dir / "vocab.json") << vocab.dump();
    std::ofstream(dir / "merges.txt") << "#version: 0.2\n";
    const char* words[] = {"the", "whale", "sea", "ship", "captain", "harpoon", "white", "deep", "sailor", "oil"};
    uint32_t x = 99;
    for (int d = 0; d < 16; ++d) {
      std::ofstream f(dir / "corpus" / ("doc" + std::to_string(100 + d) + ".txt"));
      for (int w = 0; w < 120; ++w) {
        x = x * 1103515245u + 12345u;
        f << words[(x >> 16) % 10] << ((w % 12 == 11) ? ".\n" : " ");
      }
    }
    tok = "--vocab-file " + (dir / "vocab.json").string() + " --merge-file " + (dir / "merges.txt").string();
    RunResult r = run("preprocess-data --input " + (dir / "corpus").string() + " --output-prefix " +
                      (dir / "tiny").string() + " --append-eod " + tok);
    ASSERT_EQ(r.rc, 0) << r.out;
    data = (dir / "tiny_text_document").string();
  }
  static void TearDownTestSuite() { fs::remove_all(dir); }

  static std::string train(const std::string& extra, int hidden = 32) {
    return "pretrain --num-layers 2 --hidden-size " + std::to_string(hidden) +
           " --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 "
           "--global-batch-size 4 --lr 1e-2 --min-lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 2 --lr-decay-iters 40 "
           "--log-interval 1 --eval-interval 1000 --eval-iters 1 --split 90,10,0 --device cpu --no-progress "
           "--data-path " + data + " " + tok + " " + extra;
  }
};
fs::path Durability::dir;
std::string Durability::tok, Durability::data;
int Durability::runs = 0;

std::vector<std::string> loss_lines(const std::string& out) {
  std::vector<std::string> v;
  std::regex re("iteration +([0-9]+)/ *[0-9]+ .*lm loss: ([0-9.E+-]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    v.push_back((*it)[1].str() + ":" + (*it)[2].str());
  return v;
}

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

TEST_F(Durability, CorruptTruncatedOrMissingShardIsNamed) {
  const fs::path ck = dir / "ck_corrupt";
  RunResult r = run(train("--train-iters 4 --save-interval 2 --save " + ck.string()));
  ASSERT_EQ(r.rc, 0) << r.out;
  const fs::path shard = ck / "iter_0000004" / "rank_00000.bin";
  const std::string good = read_bytes(shard);
  ASSERT_GT(good.size(), 1000u);
  const std::string resume = train("--train-iters 6 --load " + ck.string());
  {  // one flipped byte anywhere (here: a random one) is detected
    std::string bad = good;
    std::mt19937 rng(std::random_device{}());
    const size_t at = rng() % bad.size();
    bad[at] = static_cast<char>(bad[at] ^ (1 << (rng() % 8)));
    std::ofstream(shard, std::ios::binary | std::ios::trunc) << bad;
    RunResult l = run(resume);
    EXPECT_NE(l.rc, 0) << l.out;
    EXPECT_TRUE(contains(l.out, shard.string()) && contains(l.out, "is corrupt")) << "byte " << at << "\n" << l.out;
    EXPECT_TRUE(contains(l.out, "--fallback-to-previous-checkpoint")) << l.out;
    // Asked for: the previous complete checkpoint (iteration 2) is loaded instead, with a warning.
    RunResult f = run(train("--train-iters 6 --fallback-to-previous-checkpoint --load " + ck.string()));
    EXPECT_EQ(f.rc, 0) << f.out;
    EXPECT_TRUE(contains(f.out, "falling back to the checkpoint of iteration 2")) << f.out;
    EXPECT_TRUE(contains(f.out, "at iteration 2 (")) << f.out;
  }
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << good.substr(0, good.size() - 4);
  RunResult t = run(resume);
  EXPECT_NE(t.rc, 0);
  EXPECT_TRUE(contains(t.out, shard.string()) && contains(t.out, "truncated")) << t.out;
  fs::remove(shard);
  RunResult m = run(resume);
  EXPECT_NE(m.rc, 0);
  EXPECT_TRUE(contains(m.out, shard.string()) && contains(m.out, "missing")) << m.out;
  // Restored, it loads again.
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << good;
  RunResult ok = run(resume);
  EXPECT_EQ(ok.rc, 0) << ok.out;
  EXPECT_TRUE(contains(ok.out, "loaded checkpoint from " + ck.string() + " at iteration 4")) << ok.out;
}

// metadata.json is the index of the data files: an edit or damage there is found by its own
// checksum and by each shard's, and the error names the tensors (format version 3). Swapping the
// offsets of two same-sized tensors used to load the wrong weights silently (issue 37 part 6).
TEST_F(Durability, EditedMetadataNamesTheTensors) {
  const fs::path ck = dir / "ck_meta";
  RunResult r = run(train("--train-iters 2 --save " + ck.string()));
  ASSERT_EQ(r.rc, 0) << r.out;
  const fs::path meta_path = ck / "iter_0000002" / "metadata.json";
  const std::string good = read_bytes(meta_path);
  const nlohmann::json meta = nlohmann::json::parse(good);
  ASSERT_EQ(meta.at("version").get<int>(), 3);
  ASSERT_TRUE(meta.contains("metadata_crc32c"));
  // Two tensors of the same size whose shards sit in one file: swap their offsets.
  std::map<std::pair<std::string, uint64_t>, std::vector<size_t>> same;  // (file, bytes) -> tensors
  for (size_t i = 0; i < meta.at("tensors").size(); ++i) {
    const nlohmann::json& sh = meta.at("tensors")[i].at("shards")[0];
    uint64_t bytes = 4;
    for (const auto& d : sh.at("shape")) bytes *= d.get<uint64_t>();
    same[{sh.at("file").get<std::string>(), bytes}].push_back(i);
  }
  std::vector<size_t> pair;
  for (const auto& [key, v] : same)
    if (v.size() >= 2) pair = {v[0], v[1]};
  ASSERT_EQ(pair.size(), 2u);
  nlohmann::json swapped = meta;
  auto& a = swapped["tensors"][pair[0]]["shards"][0]["offset_bytes"];
  auto& b = swapped["tensors"][pair[1]]["shards"][0]["offset_bytes"];
  std::swap(a, b);
  const std::string name_a = meta["tensors"][pair[0]]["name"], name_b = meta["tensors"][pair[1]]["name"];
  const std::string resume = train("--train-iters 4 --load " + ck.string());
  auto write = [&](const nlohmann::json& j) { std::ofstream(meta_path, std::ios::trunc) << j.dump(1); };
  write(swapped);
  RunResult e = run(resume);
  EXPECT_NE(e.rc, 0) << e.out;
  EXPECT_TRUE(contains(e.out, "metadata.json does not match the data of rank_00000.bin") &&
              contains(e.out, "'" + name_a + "'") && contains(e.out, "'" + name_b + "'") &&
              contains(e.out, "the index was edited or damaged"))
      << e.out;
  EXPECT_FALSE(contains(e.out, "loaded checkpoint")) << e.out;
  // The same edit with metadata.json's own checksum dropped: each tensor's checksum still names them.
  swapped.erase("metadata_crc32c");
  write(swapped);
  RunResult d = run(resume);
  EXPECT_NE(d.rc, 0) << d.out;
  EXPECT_TRUE(contains(d.out, "has no checksum of its metadata.json") && contains(d.out, "'" + name_a + "'") &&
              contains(d.out, "'" + name_b + "'"))
      << d.out;
  // An edit outside the tensors (the seed) is found by metadata.json's checksum.
  nlohmann::json seed = meta;
  seed["seed"] = 4321;
  write(seed);
  RunResult s = run(resume);
  EXPECT_NE(s.rc, 0) << s.out;
  EXPECT_TRUE(contains(s.out, meta_path.string() + "' was edited or damaged: its checksum is") &&
              contains(s.out, "a field outside them"))
      << s.out;
  // A checkpoint of format version 2 (no checksums of metadata.json or of the tensors) loads, with
  // a warning that its index cannot be verified.
  nlohmann::json v2 = meta;
  v2["version"] = 2;
  v2.erase("metadata_crc32c");
  for (auto& t : v2["tensors"])
    for (auto& sh : t["shards"]) sh.erase("crc32c");
  write(v2);
  RunResult old = run(resume);
  EXPECT_EQ(old.rc, 0) << old.out;
  EXPECT_TRUE(contains(old.out, "(format version 2) was written without checksums of metadata.json and of each "
                                "tensor") &&
              contains(old.out, "loaded checkpoint from " + ck.string() + " at iteration 2"))
      << old.out;
  // Restored, it loads without a warning.
  std::ofstream(meta_path, std::ios::trunc) << good;
  RunResult ok = run(resume);
  EXPECT_EQ(ok.rc, 0) << ok.out;
  EXPECT_FALSE(contains(ok.out, "checksum")) << ok.out;
}

TEST_F(Durability, FailedSaveLeavesNothingBehind) {
  const fs::path ck = dir / "ck_full";
  RunResult a = run(train("--train-iters 2 --save " + ck.string()));
  ASSERT_EQ(a.rc, 0) << a.out;
  const std::string before = read_bytes(ck / "iter_0000002" / "rank_00000.bin");
  // "Disk full": files may not grow beyond 20 kB, the shard needs more.
  RunResult b = run(train("--train-iters 4 --save " + ck.string() + " --load " + ck.string()), 20000);
  EXPECT_NE(b.rc, 0) << b.out;
  EXPECT_TRUE(contains(b.out, "error writing checkpoint file") && contains(b.out, "iter_0000004.tmp")) << b.out;
  EXPECT_FALSE(fs::exists(ck / "iter_0000004.tmp")) << b.out;
  EXPECT_FALSE(fs::exists(ck / "iter_0000004"));
  EXPECT_EQ(read_bytes(ck / "latest_checkpointed_iteration.txt"), "2\n");
  EXPECT_EQ(read_bytes(ck / "iter_0000002" / "rank_00000.bin"), before);
  // What an interrupted save leaves is removed by the next run.
  fs::create_directories(ck / "iter_0000009.tmp");
  RunResult c = run(train("--train-iters 4 --save " + ck.string() + " --load " + ck.string()));
  EXPECT_EQ(c.rc, 0) << c.out;
  EXPECT_FALSE(fs::exists(ck / "iter_0000009.tmp"));
  EXPECT_TRUE(contains(c.out, "iter_0000009.tmp")) << c.out;
}

TEST_F(Durability, AsyncSaveWritesTheSameBytes) {
  const fs::path s = dir / "ck_sync", a = dir / "ck_async";
  RunResult rs = run(train("--train-iters 4 --save-interval 1 --save " + s.string()));
  RunResult ra = run(train("--train-iters 4 --save-interval 1 --async-save --save " + a.string()));
  ASSERT_EQ(rs.rc, 0) << rs.out;
  ASSERT_EQ(ra.rc, 0) << ra.out;
  EXPECT_TRUE(contains(ra.out, "(--async-save)")) << ra.out;
  EXPECT_EQ(loss_lines(rs.out), loss_lines(ra.out));
  for (int it = 1; it <= 4; ++it) {
    char name[32];
    std::snprintf(name, sizeof(name), "iter_%07d", it);
    for (const char* f : {"metadata.json", "rank_00000.bin"}) {
      const std::string x = read_bytes(s / name / f), y = read_bytes(a / name / f);
      ASSERT_FALSE(x.empty()) << name << "/" << f;
      EXPECT_TRUE(x == y) << name << "/" << f << " differs between synchronous and --async-save";
    }
  }
  EXPECT_EQ(read_bytes(a / "latest_checkpointed_iteration.txt"), "4\n");
}

// The snapshot taken at every step boundary changes nothing in training: the losses of a run that
// saves asynchronously after every iteration are those of a run that never saves (on a GPU the
// step after a save waits on the device for the snapshot's copy: tests/train/async_save_cuda_test).
TEST_F(Durability, AsyncSaveDoesNotChangeTraining) {
  const fs::path a = dir / "ck_async_every";
  RunResult plain = run(train("--train-iters 6"));
  RunResult saving = run(train("--train-iters 6 --save-interval 1 --async-save --save " + a.string()));
  ASSERT_EQ(plain.rc, 0) << plain.out;
  ASSERT_EQ(saving.rc, 0) << saving.out;
  const std::vector<std::string> losses = loss_lines(plain.out);
  ASSERT_EQ(losses.size(), 6u) << plain.out;
  EXPECT_EQ(loss_lines(saving.out), losses);
  EXPECT_EQ(read_bytes(a / "latest_checkpointed_iteration.txt"), "6\n");
}

// SIGKILL at random moments of a run that saves every iteration (sync or async, alternating),
// then restart from the same directory; repeated (12 kills: each costs a start and a verifying
// load, and this test was 70% of durability_test's time at 20; the moments are random in every
// run). Every restart must load the latest checkpoint, and the final checkpoint must equal an
// uninterrupted run's bit for bit.
TEST_F(Durability, SigkillDuringSavesAlwaysResumesBitwise) {
  const int kIters = 30;
  const fs::path ref = dir / "ck_ref", ck = dir / "ck_kill";
  const std::string common = "--train-iters " + std::to_string(kIters) + " --save-interval 1 ";
  const auto t0 = std::chrono::steady_clock::now();
  RunResult r = run(train(common + "--save " + ref.string(), 64));
  ASSERT_EQ(r.rc, 0) << r.out;
  // Kill moments spread over the length of an uninterrupted run on this machine (however loaded).
  const int64_t run_ms = std::max<int64_t>(
      50, std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count());
  std::mt19937 rng(std::random_device{}());
  int kills = 0, attempts = 0, finished = 0;
  while (attempts < 48 && kills < 12) {
    ++attempts;
    const bool async = attempts % 2 == 0;
    Child c = spawn(train(common + (async ? "--async-save " : "") + "--save " + ck.string() + " --load " + ck.string(), 64),
                    dir / "kill.log");
    const auto delay = std::chrono::milliseconds(run_ms / 20 + static_cast<int64_t>(rng() % static_cast<uint32_t>(run_ms * 8 / 10)));
    const auto until = std::chrono::steady_clock::now() + delay;
    int rc = -1;
    bool done = false;
    while (std::chrono::steady_clock::now() < until && !(done = c.exited(&rc)))
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (!done) {
      kill(c.pid, SIGKILL);
      rc = c.wait();
      ++kills;
    }
    const std::string out = c.output();
    if (rc != 128 + SIGKILL) {
      ASSERT_EQ(rc, 0) << "attempt " << attempts << " failed on its own:\n" << out;
      ++finished;
      // Start over from scratch to get more kills.
      EXPECT_TRUE(read_bytes(ck / "iter_0000030" / "rank_00000.bin") == read_bytes(ref / "iter_0000030" / "rank_00000.bin"))
          << "final checkpoint differs from the uninterrupted run after " << kills << " kills";
      fs::remove_all(ck);
    }
    // Whatever was killed: the tracker names a checkpoint that verifies (the next start loads it).
    if (fs::exists(ck / "latest_checkpointed_iteration.txt")) {
      RunResult v = run(train("--train-iters " + std::to_string(kIters) + " --exit-interval 1 --load " + ck.string(), 64));
      EXPECT_EQ(v.rc, 0) << "latest checkpoint does not load after kill " << kills << ":\n" << v.out;
      EXPECT_TRUE(contains(v.out, "loaded checkpoint from")) << v.out;
    }
  }
  EXPECT_GE(kills, 8) << "too few kills landed during the runs";
  // Finish the interrupted run and compare with the uninterrupted one.
  RunResult last = run(train(common + "--save " + ck.string() + " --load " + ck.string(), 64));
  ASSERT_EQ(last.rc, 0) << last.out;
  EXPECT_TRUE(read_bytes(ck / "iter_0000030" / "rank_00000.bin") == read_bytes(ref / "iter_0000030" / "rank_00000.bin"))
      << "resumed after " << kills << " kills, the final checkpoint differs from the uninterrupted run";
  std::printf("%d kills, %d runs finished on their own\n", kills, finished);
}

// ---- Jobs and their launchers (issue 37 part 3) ----

bool ended(pid_t pid) { return mt::testing::process_ended(pid); }

// Processes named `comm` whose command line contains `needle`, or whose parent is `ppid` (> 0).
std::vector<pid_t> find_processes(const std::string& comm, const std::string& needle, pid_t ppid = 0) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string c, stat;
    std::getline(std::ifstream(e.path() / "comm"), c);
    std::getline(std::ifstream(e.path() / "stat"), stat);
    const std::string cmdline = read_bytes(e.path() / "cmdline");
    if (c != comm || stat.empty() || ended(std::stoi(name))) continue;
    const size_t close = stat.rfind(')');
    const pid_t parent = std::atoi(stat.c_str() + close + 4);  // ") S <ppid>"
    if ((ppid > 0 && parent == ppid) || (ppid == 0 && cmdline.find(needle) != std::string::npos))
      out.push_back(std::stoi(name));
  }
  return out;
}

// Waits until `what` appears in the child's output (false after timeout_s or when it exited).
bool wait_for_output(Child& c, const std::string& what, double timeout_s) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < until) {
    if (contains(c.output(), what)) return true;
    int rc = 0;
    if (c.exited(&rc)) return contains(c.output(), what);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

bool all_ended_within(const std::vector<pid_t>& pids, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  auto done = [&] { return std::all_of(pids.begin(), pids.end(), ended); };
  while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return done();
}

const char* kPublishDelay = "MT_TEST_CHECKPOINT_PUBLISH_DELAY_MS";
const char* kHookLine = "test hook: publication of the checkpoint of iteration 1 delayed";

// kill -9 of `megatron pretrain --nproc-per-node 2` while rank 0 is about to publish a checkpoint
// (held there by the test hook): no rank is left 2 s later, and nothing is published, ever. (The
// launcher used to give mpiexec SIGTERM when it died, which mpiexec passed on to the ranks: with
// --exit-signal-handler they finished the step, saved and published.)
TEST_F(Durability, LauncherKilledDuringSaveLeavesNoRankAndPublishesNothing) {
  if (std::system("command -v mpiexec > /dev/null 2>&1") != 0) GTEST_SKIP() << "no mpiexec";
  const fs::path ck = dir / "ck_launcher_kill";
  setenv(kPublishDelay, "3000", 1);
  // --exit-signal-handler as supervised jobs run: a rank that got SIGTERM would save and publish.
  Child launcher = spawn(train("--train-iters 50 --save-interval 1 --nproc-per-node 2 --exit-signal-handler --save " +
                               ck.string()),
                         dir / "launcher_kill.log");
  unsetenv(kPublishDelay);
  ASSERT_TRUE(wait_for_output(launcher, kHookLine, 120)) << launcher.output();
  const auto hooked = std::chrono::steady_clock::now();
  const std::vector<pid_t> ranks = find_processes("megatron", ck.string());  // cmdline: NUL-separated
  std::vector<pid_t> rank_pids;
  for (pid_t p : ranks)
    if (p != launcher.pid) rank_pids.push_back(p);
  ASSERT_EQ(rank_pids.size(), 2u) << launcher.output();
  kill(launcher.pid, SIGKILL);
  EXPECT_EQ(launcher.wait(), 128 + SIGKILL);
  EXPECT_TRUE(all_ended_within(rank_pids, 2.0)) << "ranks outlived their launcher by 2 s";
  for (pid_t p : rank_pids)
    if (!ended(p)) kill(p, SIGKILL);
  // Past the moment the held publication would have happened: nothing was published.
  std::this_thread::sleep_until(hooked + std::chrono::milliseconds(4000));
  EXPECT_FALSE(fs::exists(ck / "latest_checkpointed_iteration.txt")) << launcher.output();
  EXPECT_FALSE(fs::exists(ck / "iter_0000001")) << launcher.output();
  // The directory is free at once for the next job, which starts from scratch.
  RunResult next = run(train("--train-iters 1 --save " + ck.string() + " --load " + ck.string()));
  EXPECT_EQ(next.rc, 0) << next.out;
  EXPECT_TRUE(contains(next.out, "starting from scratch")) << next.out;
}

// One rank whose launcher (a shell standing in for torchrun or mpiexec) is killed while the rank
// is about to publish: it ends at once (the parent-death signal), and with that signal disarmed
// (test hook) the check before publication still refuses to publish.
TEST_F(Durability, RankWhoseLauncherDiedPublishesNothing) {
  for (const bool signal : {true, false}) {
    SCOPED_TRACE(signal ? "parent-death signal" : "no signal: the check before publication");
    const fs::path ck = dir / (signal ? "ck_orphan_signal" : "ck_orphan_check");
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    setenv("LOCAL_RANK", "0", 1);
    setenv(kPublishDelay, "1000", 1);
    if (!signal) setenv("MT_TEST_NO_PARENT_DEATH_SIGNAL", "1", 1);
    Child shell = spawn(train("--train-iters 3 --save-interval 1 --save " + ck.string()),
                        dir / (signal ? "orphan_signal.log" : "orphan_check.log"), RLIM_INFINITY, /*in_shell=*/true);
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", kPublishDelay, "MT_TEST_NO_PARENT_DEATH_SIGNAL"}) unsetenv(v);
    ASSERT_TRUE(wait_for_output(shell, kHookLine, 120)) << shell.output();
    const std::vector<pid_t> rank = find_processes("megatron", "", shell.pid);
    ASSERT_EQ(rank.size(), 1u) << shell.output();
    kill(shell.pid, SIGKILL);
    shell.wait();
    EXPECT_TRUE(all_ended_within(rank, signal ? 2.0 : 30.0)) << shell.output();
    if (!ended(rank[0])) kill(rank[0], SIGKILL);
    const std::string out = shell.output();
    const std::string parent = "(parent process " + std::to_string(shell.pid) + ") has died";
    if (signal)
      EXPECT_TRUE(contains(out, "error (rank 0): its launcher " + parent + "; exiting at once, without saving")) << out;
    else
      EXPECT_TRUE(contains(out, "checkpoint of iteration 1 not published: the launcher that started this rank " + parent))
          << out;
    EXPECT_FALSE(fs::exists(ck / "latest_checkpointed_iteration.txt")) << out;
    EXPECT_FALSE(fs::exists(ck / "iter_0000001")) << out;
  }
}

// Two jobs on one --save directory: the second is refused at start, naming the directory and the
// first job's pid and host; the first finishes untouched, and the directory is free after it.
TEST_F(Durability, SecondJobOnOneSaveDirectoryIsRefused) {
  const fs::path ck = dir / "ck_two_jobs";
  setenv(kPublishDelay, "3000", 1);
  Child first = spawn(train("--train-iters 2 --save-interval 1 --save " + ck.string()), dir / "first_job.log");
  unsetenv(kPublishDelay);
  ASSERT_TRUE(wait_for_output(first, kHookLine, 120)) << first.output();
  RunResult second = run(train("--train-iters 4 --save " + ck.string() + " --load " + ck.string()));
  EXPECT_NE(second.rc, 0) << second.out;
  char host[256] = "";
  gethostname(host, sizeof(host) - 1);
  EXPECT_TRUE(contains(second.out, "--save directory '" + ck.string() + "' is in use by another job: pid " +
                                       std::to_string(first.pid) + " on host " + host))
      << second.out;
  EXPECT_FALSE(contains(second.out, "> datasets")) << second.out;
  EXPECT_EQ(first.wait(), 0) << first.output();
  EXPECT_EQ(read_bytes(ck / "latest_checkpointed_iteration.txt"), "2\n");
  RunResult third = run(train("--train-iters 3 --save " + ck.string() + " --load " + ck.string()));
  EXPECT_EQ(third.rc, 0) << third.out;
  EXPECT_TRUE(contains(third.out, "loaded checkpoint from " + ck.string() + " at iteration 2")) << third.out;
}

TEST_F(Durability, SignalHandlerSavesAndExitsZero) {
  const fs::path ck = dir / "ck_signal";
  Child c = spawn(train("--train-iters 100000 --exit-signal-handler --save " + ck.string()), dir / "signal.log");
  // Wait until it trains, then SIGTERM.
  for (int i = 0; i < 3000 && !contains(c.output(), "iteration        2/"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  kill(c.pid, SIGTERM);
  const int rc = c.wait();
  const std::string out = c.output();
  EXPECT_EQ(rc, 0) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("exiting program at iteration ([0-9]+) \\(received signal SIGTERM"))) << out;
  EXPECT_EQ(read_bytes(ck / "latest_checkpointed_iteration.txt"), m[1].str() + "\n");
  // Under the local launcher (--nproc-per-node 2, CPU ranks under mpiexec) SIGTERM to the launcher
  // reaches the ranks: they save together and exit 0.
  if (std::system("command -v mpiexec > /dev/null 2>&1") == 0) {
    const fs::path ck3 = dir / "ck_signal_ranks";
    Child l = spawn(train("--train-iters 100000 --nproc-per-node 2 --exit-signal-handler --save " + ck3.string()),
                    dir / "signal_ranks.log");
    for (int i = 0; i < 3000 && !contains(l.output(), "iteration        2/"); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    kill(l.pid, SIGTERM);
    EXPECT_EQ(l.wait(), 0) << l.output();
    std::smatch m2;
    const std::string out2 = l.output();
    ASSERT_TRUE(std::regex_search(out2, m2, std::regex("exiting program at iteration ([0-9]+) \\(received signal"))) << out2;
    EXPECT_EQ(read_bytes(ck3 / "latest_checkpointed_iteration.txt"), m2[1].str() + "\n");
  }
  // --exit-duration-in-mins: a tiny budget stops after the first iteration, with a checkpoint.
  const fs::path ck2 = dir / "ck_duration";
  RunResult d = run(train("--train-iters 100000 --exit-duration-in-mins 0.00001 --save " + ck2.string()));
  EXPECT_EQ(d.rc, 0) << d.out;
  EXPECT_TRUE(contains(d.out, "exiting program at iteration 1 (--exit-duration-in-mins")) << d.out;
  EXPECT_EQ(read_bytes(ck2 / "latest_checkpointed_iteration.txt"), "1\n");
}

TEST_F(Durability, NoSaveOptimAndNoLoadRng) {
  const fs::path ck = dir / "ck_noopt";
  RunResult a = run(train("--train-iters 2 --no-save-optim --save " + ck.string()));
  ASSERT_EQ(a.rc, 0) << a.out;
  const auto meta = nlohmann::json::parse(read_bytes(ck / "iter_0000002" / "metadata.json"));
  EXPECT_FALSE(meta.at("has_optimizer").get<bool>());
  for (const auto& t : meta.at("tensors")) EXPECT_EQ(t.at("name").get<std::string>().rfind("optim/", 0), std::string::npos);
  RunResult b = run(train("--train-iters 4 --load " + ck.string()));
  EXPECT_NE(b.rc, 0);
  EXPECT_TRUE(contains(b.out, "no optimizer state")) << b.out;
  RunResult c = run(train("--train-iters 4 --no-load-optim --load " + ck.string()));
  EXPECT_EQ(c.rc, 0) << c.out;
  // --no-load-rng: a new --seed is accepted on resume (refused without it).
  RunResult d = run(train("--train-iters 4 --no-load-optim --seed 7 --load " + ck.string()));
  EXPECT_NE(d.rc, 0);
  EXPECT_TRUE(contains(d.out, "--no-load-rng")) << d.out;
  RunResult e = run(train("--train-iters 4 --no-load-optim --no-load-rng --seed 7 --load " + ck.string()));
  EXPECT_EQ(e.rc, 0) << e.out;
}

TEST_F(Durability, NanLossStopsWithTheIteration) {
  const fs::path ck = dir / "ck_nan";
  RunResult r = run(train("--train-iters 20 --lr 1e10 --save-interval 1 --save " + ck.string()));
  EXPECT_NE(r.rc, 0) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("iteration ([0-9]+): the (loss|gradient norm) is NaN or Inf"))) << r.out;
  const int bad = std::stoi(m[1].str());
  // No checkpoint at or after the bad iteration.
  for (int it = bad; it <= 20; ++it) {
    char name[32];
    std::snprintf(name, sizeof(name), "iter_%07d", it);
    EXPECT_FALSE(fs::exists(ck / name)) << name << "\n" << r.out;
  }
  // Switched off: Megatron's old behaviour (skipped iterations, exit 0).
  RunResult off = run(train("--train-iters 6 --lr 1e10 --no-check-for-nan-in-loss-and-grad"));
  EXPECT_EQ(off.rc, 0) << off.out;
}

TEST_F(Durability, TensorBoardAndMetricsFile) {
  const fs::path tb = dir / "tb", mf = dir / "metrics.jsonl";
  RunResult r = run(train("--train-iters 4 --log-interval 2 --eval-interval 2 --tensorboard-dir " + tb.string() +
                          " --log-timers-to-tensorboard --log-memory-to-tensorboard --log-validation-ppl-to-tensorboard "
                          "--timing-log-level 1 --metrics-file " + mf.string()));
  ASSERT_EQ(r.rc, 0) << r.out;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(tb)) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  std::map<std::string, std::map<int64_t, float>> got;
  for (const auto& s : mt::read_tensorboard_scalars(files[0].string())) got[s.tag][s.step] = s.value;
  for (const char* tag : {"lm loss", "lm loss vs samples", "learning-rate", "learning-rate vs samples", "batch-size",
                          "grad-norm", "loss-scale", "world-size", "iteration-time", "throughput", "forward-backward-time",
                          "optimizer-time", "mem-allocated-bytes", "lm loss validation", "lm loss validation vs samples",
                          "lm loss validation ppl"})
    EXPECT_TRUE(got.count(tag)) << "missing tag '" << tag << "'";
  EXPECT_EQ(got["lm loss"].size(), 4u);  // every iteration (--tensorboard-log-interval 1)
  EXPECT_EQ(got["lm loss vs samples"].count(16), 1u);  // 4 iterations x global batch 4
  EXPECT_EQ(got["grad-norm"].size(), 2u);  // at the log iterations 2 and 4
  // The validation losses of the log are the TensorBoard values.
  std::regex re("validation loss at iteration ([0-9]+) \\| lm loss value: ([0-9.E+-]+)");
  int n = 0;
  for (std::sregex_iterator it(r.out.begin(), r.out.end(), re), end; it != end; ++it, ++n)
    EXPECT_NEAR(got["lm loss validation"][std::stoll((*it)[1].str())], std::stod((*it)[2].str()), 1e-5);
  EXPECT_EQ(n, 3);  // iterations 0, 2, 4
  // JSON lines: 2 train points, 3 validations, each a JSON object.
  std::ifstream f(mf);
  std::string line;
  int train = 0, valid = 0;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.at("type") == "train") {
      ++train;
      EXPECT_TRUE(j.at("lm_loss").is_number() && j.at("grad_norm").is_number() && j.contains("tokens_per_second")) << line;
    } else {
      ++valid;
      EXPECT_EQ(j.at("type"), "validation");
    }
  }
  EXPECT_EQ(train, 2);
  EXPECT_EQ(valid, 3);
}

// Faults a new user met (issue 20 part 5): each a clear message and the right exit status.
TEST_F(Durability, NewUserFaults) {
  RunResult v = run("--version");
  EXPECT_EQ(v.rc, 0);
  EXPECT_TRUE(contains(v.out, "megatron.cpp ")) << v.out;
  RunResult sub = run("pretrian --lr 1");
  EXPECT_NE(sub.rc, 0);
  EXPECT_TRUE(contains(sub.out, "unknown subcommand 'pretrian'") && contains(sub.out, "pretrain, generate")) << sub.out;
  struct Case {
    std::string args, expect;
  };
  const std::vector<Case> cases = {
      {"preprocess-data --input x --output-prefix y --workers 0", "--workers: must be a positive integer (>= 1), got '0'"},
      {train("--train-iters 2 --ffn-hidden-size 0"), "--ffn-hidden-size: must be a positive integer (>= 1), got '0'"},
      {train("--train-iters 2 --nproc-per-node 0"), "--nproc-per-node: must be a positive integer (>= 1), got '0'"},
      {train("--train-iters 2 --nproc-per-node -1"), "--nproc-per-node: must be a positive integer (>= 1), got '-1'"},
      {"generate --load x --num-samples 0", "--num-samples: must be a positive integer (>= 1), got '0'"},
      {train("--train-iters 2 --tensorboard-log-interval 0"),
       "--tensorboard-log-interval: must be a positive integer (>= 1), got '0'"},
      {train("--train-iters 2 --async-save"), "--async-save given without --save"},
  };
  for (const auto& c : cases) {
    RunResult r = run(c.args);
    EXPECT_NE(r.rc, 0) << c.args;
    EXPECT_TRUE(contains(r.out, c.expect)) << "expected '" << c.expect << "' in:\n" << r.out;
    EXPECT_LT(r.out.size(), 400u) << "message too long:\n" << r.out;
  }
  {  // Under several ranks a bad input is reported once (rank 0), not once per rank, and without
     // the launcher's boilerplate (mpiexec's "Primary job terminated normally..." blocks).
    setenv("OMP_NUM_THREADS", "1", 1);  // the user's settings: no launcher line about OpenMP
    setenv("OMP_WAIT_POLICY", "passive", 1);
    RunResult r = run(train("--train-iters 2 --nproc-per-node 2 --seq-length 32"));
    unsetenv("OMP_NUM_THREADS");
    unsetenv("OMP_WAIT_POLICY");
    EXPECT_EQ(r.rc, 1) << r.out;
    if (!contains(r.out, "could not run mpiexec")) {
      const std::string msg = "--seq-length 32 exceeds --max-position-embeddings 16";
      const size_t first = r.out.find(msg);
      EXPECT_NE(first, std::string::npos) << r.out;
      EXPECT_EQ(r.out.find(msg, first + 1), std::string::npos) << "printed more than once:\n" << r.out;
      EXPECT_TRUE(r.out.starts_with("error: ")) << r.out;
      for (const char* boilerplate : {"Primary job", "mpiexec detected", "-----", "[megatron launcher]", "Exit code"})
        EXPECT_FALSE(contains(r.out, boilerplate)) << "launcher boilerplate '" << boilerplate << "':\n" << r.out;
      EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << "more than the error:\n" << r.out;
    }
  }
  // Absurd sizes stop at once, before any index is built, naming the values and the memory.
  for (const auto& [args, expect] : std::vector<std::pair<std::string, std::string>>{
           {train("--train-iters 2 --micro-batch-size 99999999999 --global-batch-size 99999999999"),
            "--micro-batch-size 99999999999 x --seq-length 16"},
           {train("--train-iters 100000000000"), "samples of --seq-length 16 would take"}}) {
    const auto t0 = std::chrono::steady_clock::now();
    RunResult r = run(args);
    EXPECT_NE(r.rc, 0);
    EXPECT_TRUE(contains(r.out, expect) && contains(r.out, "GiB of memory available")) << r.out;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  }
  // A prompt longer than the model's context is an error, not silently cut.
  const fs::path ck = dir / "ck_gen";
  ASSERT_EQ(run(train("--train-iters 1 --save " + ck.string())).rc, 0);
  RunResult g = run("generate --load " + ck.string() + " " + tok + " --device cpu --prompt \"" + std::string(40, 'x') + "\"");
  EXPECT_NE(g.rc, 0);
  EXPECT_TRUE(contains(g.out, "prompt 0 has 40 tokens but the context holds")) << g.out;
  // The default --split 969,30,1 on a small corpus: the empty test split is a warning, training runs.
  fs::create_directories(dir / "corpus40");
  for (int d = 0; d < 40; ++d)
    std::ofstream(dir / "corpus40" / ("d" + std::to_string(100 + d) + ".txt")) << "the whale and the sea, the ship.\n";
  ASSERT_EQ(run("preprocess-data --input " + (dir / "corpus40").string() + " --output-prefix " + (dir / "c40").string() +
                " --append-eod " + tok).rc, 0);
  std::string flags = train("--train-iters 2");
  flags = std::regex_replace(flags, std::regex("--split 90,10,0 "), "");
  flags = std::regex_replace(flags, std::regex("--data-path [^ ]+"), "--data-path " + (dir / "c40_text_document").string());
  RunResult sp = run(flags);
  EXPECT_EQ(sp.rc, 0) << sp.out;
  EXPECT_TRUE(contains(sp.out, "the test split of") && contains(sp.out, "only a warning")) << sp.out;
}

}  // namespace
