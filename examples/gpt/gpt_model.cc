#include "examples/gpt/gpt_model.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <cmath>
#include <sstream>

#include "base/errors.h"

namespace shardtrain::examples {

int64_t GptConfig::NumParameters() const {
  const int64_t per_block = 2 * 2 * n_embd + (n_embd * 3 * n_embd + 3 * n_embd) + (n_embd * n_embd + n_embd) +
                            (n_embd * 4 * n_embd + 4 * n_embd) + (4 * n_embd * n_embd + n_embd);
  return vocab_size * n_embd + block_size * n_embd + n_layer * per_block + 2 * n_embd;
}

std::string GptConfig::ToString() const {
  std::ostringstream os;
  os << "GPT(vocab=" << vocab_size << ", block=" << block_size << ", layers=" << n_layer << ", heads=" << n_head
     << ", embd=" << n_embd << ", params=" << NumParameters() << ")";
  return os.str();
}

namespace {
using tensor_parallel::LinearStyle;
using tensor_parallel::ParallelLinearImpl;
using tensor_parallel::ParallelLinearOptions;
using tensor_parallel::SequenceParallel;
using tensor_parallel::TensorParallelScope;

// A linear layer of the plan, drawn as torch::nn::Linear is (nanoGPT's
// initialisation follows once a module's layers are built: the same random
// numbers in the same order as with torch::nn::Linear).
std::shared_ptr<ParallelLinearImpl> Linear(int64_t in, int64_t out, LinearStyle style, int64_t chunks = 1) {
  ParallelLinearOptions o(in, out, style);
  o.chunks = chunks;
  return std::make_shared<ParallelLinearImpl>(o);
}

std::shared_ptr<SequenceParallel<torch::nn::LayerNormImpl>> Norm(int64_t n) {
  return std::make_shared<SequenceParallel<torch::nn::LayerNormImpl>>(torch::nn::LayerNormOptions({n}));
}

int TensorParallelSize() {
  const auto g = TensorParallelScope::CurrentGroup();
  return g ? g->size() : 1;
}
}  // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptConfig& c) : dropout_(c.dropout) {
  ST_CHECK_ARG(c.n_embd % c.n_head == 0, "GPT: n_embd (", c.n_embd, ") must be divisible by n_head (", c.n_head, ")");
  const int tp = TensorParallelSize();
  ST_CHECK_ARG(c.n_head % tp == 0, "GPT: n_head (", c.n_head, ") must be divisible by tensor_parallel_size (", tp,
               "): each rank computes whole heads");
  n_head_ = c.n_head / tp;
  c_attn_ = register_module("c_attn", Linear(c.n_embd, 3 * c.n_embd, LinearStyle::kColwise, 3));
  c_proj_ = register_module("c_proj", Linear(c.n_embd, c.n_embd, LinearStyle::kRowwise));
  c_attn_->InitNormal(0.0, 0.02);
  c_proj_->InitNormal(0.0, 0.02 / std::sqrt(2.0 * c.n_layer));
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  at::Tensor fused = c_attn_->forward(x);  // [B, T, 3C] (tensor parallel: this rank's heads, the whole sequence)
  const int64_t B = fused.size(0), T = fused.size(1), C = fused.size(2) / 3;
  auto qkv = fused.split(C, 2);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, n_head_, C / n_head_}).transpose(1, 2); };
  at::Tensor y = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), {},
                                                  is_training() ? dropout_ : 0.0, /*is_causal=*/true);
  y = y.transpose(1, 2).contiguous().view({B, T, C});
  return c_proj_->forward(y);
}

MlpImpl::MlpImpl(const GptConfig& c) {
  c_fc_ = register_module("c_fc", Linear(c.n_embd, 4 * c.n_embd, LinearStyle::kColwise));
  c_proj_ = register_module("c_proj", Linear(4 * c.n_embd, c.n_embd, LinearStyle::kRowwise));
  dropout_ = register_module("dropout", torch::nn::Dropout(c.dropout));
  c_fc_->InitNormal(0.0, 0.02);
  c_proj_->InitNormal(0.0, 0.02 / std::sqrt(2.0 * c.n_layer));
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  return dropout_->forward(c_proj_->forward(at::gelu(c_fc_->forward(x), "tanh")));
}

BlockImpl::BlockImpl(const GptConfig& c) {
  ln_1_ = register_module("ln_1", Norm(c.n_embd));
  attn_ = register_module("attn", std::make_shared<CausalSelfAttentionImpl>(c));
  ln_2_ = register_module("ln_2", Norm(c.n_embd));
  mlp_ = register_module("mlp", std::make_shared<MlpImpl>(c));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + attn_->forward(ln_1_->forward(x));
  return h + mlp_->forward(ln_2_->forward(h));
}

GptImpl::GptImpl(const GptConfig& c)
    : config_(c),
      tp_group_(TensorParallelScope::CurrentGroup()),
      sequence_parallel_(TensorParallelScope::CurrentSequenceParallel()) {
  ST_CHECK_ARG(c.vocab_size > 0 && c.block_size > 0 && c.n_layer > 0 && c.n_head > 0 && c.n_embd > 0,
               "GPT: all sizes must be positive, got ", c.ToString());
  ST_CHECK_ARG(!sequence_parallel_ || c.block_size % tp_group_->size() == 0,
               "GPT with sequence parallelism: block_size (", c.block_size, ") must divide by tensor_parallel_size (",
               tp_group_->size(), ")");
  wte_ = register_module("wte", std::make_shared<tensor_parallel::ParallelEmbeddingImpl>(c.vocab_size, c.n_embd));
  wpe_ = register_module("wpe", std::make_shared<SequenceParallel<torch::nn::EmbeddingImpl>>(c.block_size, c.n_embd));
  wte_->InitNormal(0.0, 0.02);
  torch::nn::init::normal_(wpe_->weight, 0.0, 0.02);
  drop_ = register_module("drop", torch::nn::Dropout(c.dropout));
  h_ = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer; ++i) {
    auto b = std::make_shared<sharding::Sharded<BlockImpl>>(c);
    h_->push_back(b);
    blocks_.push_back(b);
  }
  ln_f_ = register_module("ln_f", Norm(c.n_embd));
}

at::Tensor GptImpl::forward(const at::Tensor& idx) {
  const int64_t T = idx.size(1);
  ST_CHECK_ARG(T <= config_.block_size, "GPT: sequence length ", T, " exceeds block_size ", config_.block_size);
  int64_t begin = 0, end = T, pad = 0;
  at::Tensor ids = idx;
  if (sequence_parallel_) {
    // The sequence splits over the group: pad it at the end to a multiple of
    // the group (causal attention: the padding changes no earlier position),
    // and embed this rank's positions (wpe's gradient is then partial: the
    // strategy sums it).
    const int64_t tp = tp_group_->size();
    pad = (tp - T % tp) % tp;
    if (pad > 0) ids = at::constant_pad_nd(idx, {0, pad}, 0);
    begin = tp_group_->rank() * ((T + pad) / tp);
    end = begin + (T + pad) / tp;
  }
  at::Tensor pos = at::arange(begin, end, idx.options().dtype(at::kLong));
  at::Tensor x = drop_->forward(wte_->forward(ids) + wpe_->forward(pos));
  for (auto& b : blocks_) x = b->forward(x);
  x = ln_f_->forward(x);
  at::Tensor logits = wte_->TiedLogits(x);  // tied output head
  return pad > 0 ? logits.slice(1, 0, T) : logits;
}

at::Tensor GptImpl::GatherLogits(const at::Tensor& logits) const {
  return tensor_parallel::GatherVocabulary(logits, config_.vocab_size, tp_group_);
}

at::Tensor GptImpl::Loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}));
}

at::Tensor GptImpl::LossOf(const at::Tensor& logits, const at::Tensor& targets) const {
  if (!tp_group_) return Loss(logits, targets);
  return tensor_parallel::VocabParallelCrossEntropy(logits, targets, wte_->vocab_range().first, tp_group_);
}

at::Tensor GptImpl::Generate(at::Tensor idx, int64_t n, double temperature, int64_t top_k) {
  ST_CHECK_ARG(!tp_group_, "GPT: Generate needs the whole model; this one is split over ", tp_group_->size(),
               " tensor-parallel ranks (load its full checkpoint into a model built without model_parallel)");
  at::NoGradGuard no_grad;
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor cond = idx.size(1) <= config_.block_size ? idx : idx.slice(1, idx.size(1) - config_.block_size);
    at::Tensor logits = forward(cond).select(1, cond.size(1) - 1).to(at::kFloat) / temperature;
    if (top_k > 0 && top_k < logits.size(-1)) {
      at::Tensor kth = std::get<0>(logits.topk(top_k)).select(-1, top_k - 1).unsqueeze(-1);
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
    }
    at::Tensor next = at::multinomial(at::softmax(logits, -1), 1);
    idx = at::cat({idx, next}, 1);
  }
  return idx;
}

}  // namespace shardtrain::examples
