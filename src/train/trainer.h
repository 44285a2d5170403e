// `megatron pretrain`: the training loop in the shape of Megatron's pretrain()
// (megatron/training/training.py): build model and optimizer, optionally resume, then
// iterations of gradient accumulation over micro-batches, an optimizer step, Megatron-format
// log lines every --log-interval, evaluation every --eval-interval, checkpoints every
// --save-interval. No host synchronisation inside an iteration except at log, eval and save
// points (docs/architecture.md principle 5).
#pragma once
#include "train/arguments.h"

namespace mt {

/// Runs pretraining; returns the process exit code. Errors: mt::Error for invalid arguments,
/// data or checkpoints (the caller prints them and exits non-zero).
int run_pretrain(PretrainArgs args);

/// True once run_pretrain has entered its training loop in this process (errors before that
/// point are the same on every rank; apps/megatron.cpp prints them on rank 0 only).
bool training_started();

/// Resolves --device (auto = cuda:0 when available, else cpu).
Device resolve_device(const std::string& flag);

/// Result of one evaluation (for logs and tests).
struct EvalResult {
  double loss = 0;
  double ppl = 0;
};

}  // namespace mt
