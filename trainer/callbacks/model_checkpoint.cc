#include "trainer/callbacks/model_checkpoint.h"

#include <filesystem>
#include <sstream>

#include "base/errors.h"
#include "trainer/callbacks/internal/metric_text.h"
#include "trainer/trainer.h"

namespace shardtrain::trainer {
namespace fs = std::filesystem;
using internal::Available;
using internal::CheckMode;
using internal::Num;
using internal::ParseNum;

// --- ModelCheckpoint -----------------------------------------------------------

ModelCheckpoint::ModelCheckpoint(ModelCheckpointOptions options) : options_(std::move(options)) {
  CheckMode("ModelCheckpoint", options_.mode);
  ST_CHECK_ARG(options_.save_top_k >= -1, "ModelCheckpoint: save_top_k must be >= -1, got ", options_.save_top_k);
  ST_CHECK_ARG(options_.every_n_train_steps >= 0, "ModelCheckpoint: every_n_train_steps must be >= 0, got ",
               options_.every_n_train_steps);
  ST_CHECK_ARG(options_.every_n_epochs >= -1, "ModelCheckpoint: every_n_epochs must be >= 0 (or -1: default), got ",
               options_.every_n_epochs);
  if (options_.every_n_epochs < 0) options_.every_n_epochs = options_.every_n_train_steps > 0 ? 0 : 1;
  if (options_.filename.empty()) {
    options_.filename = "{epoch}-{step}";
    if (!options_.monitor.empty()) options_.filename += "-{" + options_.monitor + ":.4f}";
  }
}

std::string ModelCheckpoint::FormatName(int64_t epoch, int64_t step, const std::map<std::string, double>& metrics) const {
  const std::string& t = options_.filename;
  std::string out;
  size_t i = 0;
  while (i < t.size()) {
    const size_t open = t.find('{', i);
    if (open == std::string::npos) {
      out += t.substr(i);
      break;
    }
    const size_t close = t.find('}', open);
    ST_CHECK_ARG(close != std::string::npos, "ModelCheckpoint: unbalanced '{' in filename '", t, "'");
    out += t.substr(i, open - i);
    std::string key = t.substr(open + 1, close - open - 1);
    std::string fmt;
    if (auto colon = key.find(':'); colon != std::string::npos) {
      fmt = key.substr(colon + 1);
      key = key.substr(0, colon);
    }
    std::ostringstream os;
    os << key << "=";
    if (key == "epoch" && fmt.empty()) {
      os << epoch;
    } else if (key == "step" && fmt.empty()) {
      os << step;
    } else {
      double v = key == "epoch" ? static_cast<double>(epoch) : key == "step" ? static_cast<double>(step) : 0.0;
      if (key != "epoch" && key != "step") {
        auto it = metrics.find(key);
        if (it != metrics.end()) v = it->second;
      }
      if (fmt.size() >= 3 && fmt[0] == '.' && fmt.back() == 'f') {
        os << std::fixed << std::setprecision(std::stoi(fmt.substr(1, fmt.size() - 2))) << v;
      } else {
        os << v;
      }
    }
    out += os.str();
    i = close + 1;
  }
  return out + ".ckpt";
}

void ModelCheckpoint::on_fit_start(Trainer& trainer, TrainingModule&) {
  dir_ = options_.dirpath.empty() ? trainer.checkpoint_dir() : options_.dirpath;
  if (pending_state_.empty()) return;
  std::map<std::string, std::string> state;
  state.swap(pending_state_);
  auto get = [&](const char* key) {
    auto it = state.find(key);
    return it == state.end() ? std::string() : it->second;
  };
  // As Lightning: the kept checkpoints are only restored when they are in this
  // directory (a resumed run usually logs to a new version_N).
  if (get("dirpath") != dir_) return;
  best_model_path_ = get("best_model_path");
  best_model_score_ = get("best_model_score").empty() ? 0.0 : ParseNum(get("best_model_score"));
  last_model_path_ = get("last_model_path");
  best_k_.clear();
  std::istringstream in(get("best_k_models"));
  std::string line;
  while (std::getline(in, line)) {
    const auto tab = line.rfind('\t');
    if (tab != std::string::npos) best_k_[line.substr(0, tab)] = ParseNum(line.substr(tab + 1));
  }
}

void ModelCheckpoint::Save(Trainer& trainer, int64_t epoch) {
  const int64_t step = trainer.global_step();
  if (step == last_step_saved_) return;
  last_step_saved_ = step;
  const auto& metrics = trainer.callback_metrics();
  const bool by_step = options_.monitor.empty();
  double score = static_cast<double>(step);
  bool have = true;
  if (!by_step) {
    auto it = metrics.find(options_.monitor);
    if (it == metrics.end()) {
      // As Lightning: an error once validation has run, else skipped.
      ST_CHECK_ARG(trainer.val_losses().empty(), "ModelCheckpoint(monitor='", options_.monitor,
                   "') could not find the monitored metric; available: ", Available(metrics),
                   ". Log it with TrainingModule::log('", options_.monitor, "', value)");
      have = false;
    } else {
      score = it->second;
      if (std::isnan(score)) score = options_.mode == "min" ? std::numeric_limits<double>::infinity()
                                                           : -std::numeric_limits<double>::infinity();
    }
  }
  const int64_t k = options_.save_top_k;
  if (have && k != 0) {
    const std::string worst = WorstKept();
    if (k < 0 || static_cast<int64_t>(best_k_.size()) < k || Better(score, best_k_.at(worst))) {
      const std::string path = (fs::path(dir_) / FormatName(epoch, step, metrics)).string();
      best_k_[path] = score;
      std::string evict;
      if (k > 0 && static_cast<int64_t>(best_k_.size()) > k) {
        evict = worst;
        best_k_.erase(worst);
      }
      best_model_path_.clear();
      for (const auto& [p, s] : best_k_) {
        if (best_model_path_.empty() || Better(s, best_model_score_)) {
          best_model_path_ = p;
          best_model_score_ = s;
        }
      }
      trainer.SaveCheckpoint(path);
      if (!evict.empty() && evict != path && trainer.rank() == 0) {
        // Once the new one is complete (async_checkpoint): a crash before keeps the old.
        trainer.WhenCheckpointSaved([evict] {
          std::error_code ec;
          fs::remove_all(evict, ec);
        });
      }
    }
  }
  if (options_.save_last) {
    last_model_path_ = (fs::path(dir_) / "last.ckpt").string();
    trainer.SaveCheckpoint(last_model_path_);
  }
}

void ModelCheckpoint::on_train_batch_end(Trainer& trainer, TrainingModule&, const at::Tensor&, int64_t) {
  const int64_t n = options_.every_n_train_steps;
  const int64_t step = trainer.global_step();
  if (n > 0 && step > 0 && step % n == 0) Save(trainer, trainer.current_epoch());
}

void ModelCheckpoint::on_train_epoch_end(Trainer& trainer, TrainingModule&, int64_t epoch) {
  const int64_t n = options_.every_n_epochs;
  if (n > 0 && (epoch + 1) % n == 0) Save(trainer, epoch);
}

std::string ModelCheckpoint::state_key() const {
  return "ModelCheckpoint{'monitor': " + internal::PyRepr(options_.monitor, /*none_if_empty=*/true) +
         ", 'mode': " + internal::PyRepr(options_.mode) +
         ", 'every_n_train_steps': " + std::to_string(options_.every_n_train_steps) +
         ", 'every_n_epochs': " + std::to_string(options_.every_n_epochs) + ", 'train_time_interval': None}";
}

bool ModelCheckpoint::Better(double a, double b) const {
  // Without a monitor the score is the step: later is better.
  return options_.monitor.empty() || options_.mode == "max" ? a > b : a < b;
}

std::string ModelCheckpoint::WorstKept() const {
  std::string worst;
  for (const auto& [p, s] : best_k_) {
    if (worst.empty() || Better(best_k_.at(worst), s)) worst = p;
  }
  return worst;
}

StateDict ModelCheckpoint::checkpoint_state() const {
  StateValue::Scores k;
  for (const auto& [p, s] : best_k_) k[p] = ScoreTensor{s};
  const std::string worst = WorstKept();
  // Lightning's kth_value before anything is kept: the worst possible score.
  const double none_kept =
      Better(0, 1) ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
  return {{"monitor", options_.monitor.empty() ? StateValue() : StateValue(options_.monitor)},
          {"best_model_score", best_model_path_.empty() ? StateValue() : StateValue(ScoreTensor{best_model_score_})},
          {"best_model_path", best_model_path_},
          {"current_score", StateValue()},
          {"dirpath", dir_},
          {"best_k_models", k},
          {"kth_best_model_path", worst},
          {"kth_value", ScoreTensor{worst.empty() ? none_kept : best_k_.at(worst)}},
          {"last_model_path", last_model_path_}};
}

void ModelCheckpoint::load_checkpoint_state(const StateDict& state) {
  std::map<std::string, std::string> text;
  for (const auto& [k, v] : state) {
    if (!v.is_none()) text[k] = v.ToString();  // best_k_models: "path\tscore" lines, as state_dict() writes
  }
  load_state_dict(text);
}

std::string ModelCheckpoint::legacy_state_key() const {
  return "ModelCheckpoint{monitor=" + options_.monitor + ", mode=" + options_.mode +
         ", every_n_train_steps=" + std::to_string(options_.every_n_train_steps) +
         ", every_n_epochs=" + std::to_string(options_.every_n_epochs) + "}";
}

std::map<std::string, std::string> ModelCheckpoint::state_dict() const {
  std::ostringstream k;
  for (const auto& [p, s] : best_k_) k << p << '\t' << Num(s) << '\n';
  return {{"dirpath", dir_},
          {"best_model_path", best_model_path_},
          {"best_model_score", Num(best_model_score_)},
          {"last_model_path", last_model_path_},
          {"best_k_models", k.str()}};
}

void ModelCheckpoint::load_state_dict(const std::map<std::string, std::string>& state) { pending_state_ = state; }

}  // namespace shardtrain::trainer
