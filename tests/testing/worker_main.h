// The main() of the tests' real training programs (tests/faults:fault_worker,
// tests/trainer:preempt_worker), which the shell tests start as processes.
#ifndef SHARDTRAIN_TESTS_TESTING_WORKER_MAIN_H_
#define SHARDTRAIN_TESTS_TESTING_WORKER_MAIN_H_

namespace shardtrain::testing {

// Runs run(argc, argv) and returns the process's exit code: run's result; for a
// trainer::Preempted, its exit code (128 + the signal); for any other exception,
// 1 after printing "error: <what>" on stderr. In every case it first waits for
// the local ranks this process launched (launch/launcher.h JoinLocalRanks), so
// that rank 0 exits with the job's code.
int WorkerMain(int (*run)(int argc, char** argv), int argc, char** argv);

}  // namespace shardtrain::testing

#endif  // SHARDTRAIN_TESTS_TESTING_WORKER_MAIN_H_
