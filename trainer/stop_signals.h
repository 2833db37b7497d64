// Preemption: SIGTERM, SIGINT and SIGUSR1 ask a running Trainer::Fit to stop.
//
// The first such signal is only recorded (an async-signal-safe flag). Fit
// folds the flag into its one per-step collective, so every rank learns of it
// at the same step wherever the signal landed (a rank, or the launcher, which
// forwards it to its ranks); every rank finishes that step, the checkpoint is
// written, and Fit throws Preempted. A second signal while the first is being
// handled aborts at once (the default action of that signal).
//
// Exit statuses (Preempted::exit_code): 128 + the signal, the shell's and
// SLURM's convention for a job ended by a signal: 143 for SIGTERM, 138 for
// SIGUSR1 (SLURM's --signal=USR1@T), 130 for SIGINT (Ctrl-C). Non-zero, so
// SLURM's requeue (--requeue, or `|| scontrol requeue`) and torchrun's
// --max-restarts treat the run as unfinished; with TrainerOptions::resume =
// "auto" the next start continues from the checkpoint.
#ifndef SHARDTRAIN_TRAINER_STOP_SIGNALS_H_
#define SHARDTRAIN_TRAINER_STOP_SIGNALS_H_

#include <string>
#include <utility>

#include "base/errors.h"

namespace shardtrain::trainer {

// While alive, SIGTERM/SIGINT/SIGUSR1 are recorded instead of ending the
// process. Nestable and thread-safe (threads-as-ranks run several Trainers in
// one process: one signal then stops all of them). The first scope clears the
// record; the last restores the previous handlers (where nothing replaced ours
// since; a handler that chains to ours, like the launcher's, then reaches the
// default action).
class StopSignalScope {
 public:
  StopSignalScope();
  ~StopSignalScope();
  StopSignalScope(const StopSignalScope&) = delete;
  StopSignalScope& operator=(const StopSignalScope&) = delete;
};

// The first recorded stop signal (0: none).
int ReceivedStopSignal();

// "SIGTERM", "SIGINT", "SIGUSR1" (else "signal N").
std::string StopSignalName(int sig);

// 128 + sig: the exit status of a run stopped by `sig` (see above).
int StopExitCode(int sig);

// Thrown by Fit on every rank after a signal stopped it and its checkpoint
// was written. An example's main() turns it into exit_code().
class Preempted : public Error {
 public:
  Preempted(int sig, std::string checkpoint, const std::string& message)
      : Error(message), signal_(sig), checkpoint_(std::move(checkpoint)) {}
  int signal() const { return signal_; }
  int exit_code() const { return StopExitCode(signal_); }
  // The checkpoint written at the stop ("" when checkpointing is off).
  const std::string& checkpoint() const { return checkpoint_; }

 private:
  int signal_;
  std::string checkpoint_;
};

}  // namespace shardtrain::trainer

#endif  // SHARDTRAIN_TRAINER_STOP_SIGNALS_H_
