// TensorBoard event files for `megatron pretrain --tensorboard-dir D`: the scalars Megatron-LM
// logs through torch.utils.tensorboard.SummaryWriter.add_scalar ("lm loss", "learning-rate",
// "grad-norm", "loss-scale", "lm loss validation", ...; megatron/training/training.py
// training_log and evaluate_and_print_results), written without protobuf or TensorFlow: the
// three messages involved are encoded by hand.
//
// Format (sources: tensorboard/compat/proto/event.proto and summary.proto, copies of
// tensorflow/core/util/event.proto and tensorflow/core/framework/summary.proto;
// tensorboard/summary/writer/record_writer.py and event_file_writer.py; TensorFlow's
// tensorflow/core/lib/io/record_writer.cc and lib/hash/crc32c.h):
//   File  <log_dir>/events.out.tfevents.<unix seconds, 10 digits>.<hostname>.<pid>.<n>
//         (n counts the writers this process opened, as torch's EventFileWriter does, so two
//         writers opened in the same second get different files). A sequence of TFRecords:
//   Record  uint64 length (little-endian) | uint32 masked_crc32c(the 8 length bytes)
//           | data[length] | uint32 masked_crc32c(data), all little-endian;
//           masked_crc32c(x) = ((c >> 15) | (c << 17)) + 0xa282ead8 (uint32), c = crc32c(x),
//           CRC-32C = Castagnoli, reflected polynomial 0x82F63B78.
//   data  a serialized tensorflow.Event:
//           Event      1: wall_time (double, wire type 1, seconds since the Unix epoch)
//                      2: step (int64, varint)
//                      3: file_version (string; the first record holds "brain.Event:2")
//                      5: summary (Summary, length-delimited)
//           Summary    1: value (repeated Summary.Value, length-delimited)
//           Value      1: tag (string)   2: simple_value (float, wire type 5)
//   One Event per add_scalar (one Summary.Value in it), as torch's SummaryWriter writes them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/crc32c.h"  // crc32c()

namespace mt {

/// TFRecord's masked CRC: ((c >> 15) | (c << 17)) + 0xa282ead8 with c = crc32c(data, n)
/// (tensorflow/core/lib/hash/crc32c.h Mask).
uint32_t masked_crc32c(const void* data, size_t n);

/// Appends scalars to one new TensorBoard event file in a log directory.
///
/// Records are buffered in a std::FILE (no per-scalar system call or fsync) and reach the OS at
/// flush() and in the destructor; TensorBoard sees them from then on. Not thread-safe: use one
/// writer from one thread (rank 0 of `megatron pretrain` logs from its training loop). Movable,
/// not copyable.
class TensorBoardWriter {
 public:
  /// Creates `log_dir` (and its parents) when missing and opens a new event file in it
  /// (never overwrites one), then writes the file_version record "brain.Event:2" and flushes.
  /// Errors: mt::Error naming `log_dir` when it is empty, cannot be created, is not a
  /// directory or the file cannot be created or written in it.
  explicit TensorBoardWriter(const std::string& log_dir);
  /// Flushes; errors on that last flush are logged as warnings, not thrown.
  ~TensorBoardWriter();
  TensorBoardWriter(TensorBoardWriter&&) noexcept = default;
  TensorBoardWriter& operator=(TensorBoardWriter&&) noexcept = default;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  /// Appends one Event{wall_time, step, Summary{Value{tag, simple_value = float(value)}}}.
  /// `value` is stored as float32 (TensorBoard's simple_value), NaN/Inf included; `step` is the
  /// x axis (Megatron: the iteration, or consumed samples for the "... vs samples" tags);
  /// `wall_time` in seconds since the Unix epoch, negative = now. Errors: mt::Error for an
  /// empty tag, or naming the file when the write fails.
  void add_scalar(const std::string& tag, double value, int64_t step, double wall_time = -1);

  /// Hands the buffered records to the OS (fflush; no fsync). Errors: mt::Error naming the file.
  void flush();

  /// The event file: <log_dir>/events.out.tfevents.<seconds>.<hostname>.<pid>.<n>.
  const std::string& path() const { return path_; }

 private:
  struct FileCloser {
    void operator()(std::FILE* f) const;
  };
  void write_record(const std::string& data);

  std::string path_;
  std::unique_ptr<std::FILE, FileCloser> file_;
  std::string event_;   // scratch: the Event being encoded
  std::string record_;  // scratch: the framed record
};

/// One scalar read back from an event file (Summary.Value with a simple_value).
struct TensorBoardScalar {
  std::string tag;
  float value;
  int64_t step;
  double wall_time;  // seconds since the Unix epoch
};

/// Reads every simple_value scalar of `event_file` in file order (for tests and tools; any
/// TFRecord event file, not only ours: events without a summary and values of other kinds are
/// skipped, unknown protobuf fields are skipped). Verifies the length CRC and the data CRC of
/// every record. Errors: mt::Error naming the file and the record index (0-based) on a CRC
/// mismatch, a truncated record or malformed protobuf; naming the file when it cannot be read.
std::vector<TensorBoardScalar> read_tensorboard_scalars(const std::string& event_file);

}  // namespace mt
