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
void InitLinear(torch::nn::Linear& l, double std) {
  torch::nn::init::normal_(l->weight, 0.0, std);
  if (l->bias.defined()) torch::nn::init::zeros_(l->bias);
}
}  // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptConfig& c) : n_head_(c.n_head), dropout_(c.dropout) {
  ST_CHECK_ARG(c.n_embd % c.n_head == 0, "GPT: n_embd (", c.n_embd, ") must be divisible by n_head (", c.n_head, ")");
  c_attn_ = register_module("c_attn", torch::nn::Linear(c.n_embd, 3 * c.n_embd));
  c_proj_ = register_module("c_proj", torch::nn::Linear(c.n_embd, c.n_embd));
  InitLinear(c_attn_, 0.02);
  InitLinear(c_proj_, 0.02 / std::sqrt(2.0 * c.n_layer));
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  auto qkv = c_attn_->forward(x).split(C, 2);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, n_head_, C / n_head_}).transpose(1, 2); };
  at::Tensor y = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), {},
                                                  is_training() ? dropout_ : 0.0, /*is_causal=*/true);
  y = y.transpose(1, 2).contiguous().view({B, T, C});
  return c_proj_->forward(y);
}

MlpImpl::MlpImpl(const GptConfig& c) {
  c_fc_ = register_module("c_fc", torch::nn::Linear(c.n_embd, 4 * c.n_embd));
  c_proj_ = register_module("c_proj", torch::nn::Linear(4 * c.n_embd, c.n_embd));
  dropout_ = register_module("dropout", torch::nn::Dropout(c.dropout));
  InitLinear(c_fc_, 0.02);
  InitLinear(c_proj_, 0.02 / std::sqrt(2.0 * c.n_layer));
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  return dropout_->forward(c_proj_->forward(at::gelu(c_fc_->forward(x), "tanh")));
}

BlockImpl::BlockImpl(const GptConfig& c) {
  ln_1_ = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  attn_ = register_module("attn", std::make_shared<CausalSelfAttentionImpl>(c));
  ln_2_ = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  mlp_ = register_module("mlp", std::make_shared<MlpImpl>(c));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + attn_->forward(ln_1_->forward(x));
  return h + mlp_->forward(ln_2_->forward(h));
}

GptImpl::GptImpl(const GptConfig& c) : config_(c) {
  ST_CHECK_ARG(c.vocab_size > 0 && c.block_size > 0 && c.n_layer > 0 && c.n_head > 0 && c.n_embd > 0,
               "GPT: all sizes must be positive, got ", c.ToString());
  wte_ = register_module("wte", torch::nn::Embedding(c.vocab_size, c.n_embd));
  wpe_ = register_module("wpe", torch::nn::Embedding(c.block_size, c.n_embd));
  torch::nn::init::normal_(wte_->weight, 0.0, 0.02);
  torch::nn::init::normal_(wpe_->weight, 0.0, 0.02);
  drop_ = register_module("drop", torch::nn::Dropout(c.dropout));
  h_ = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer; ++i) {
    auto b = std::make_shared<sharding::Sharded<BlockImpl>>(c);
    h_->push_back(b);
    blocks_.push_back(b);
  }
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
}

at::Tensor GptImpl::forward(const at::Tensor& idx) {
  const int64_t T = idx.size(1);
  ST_CHECK_ARG(T <= config_.block_size, "GPT: sequence length ", T, " exceeds block_size ", config_.block_size);
  at::Tensor pos = at::arange(T, idx.options().dtype(at::kLong));
  at::Tensor x = drop_->forward(wte_->forward(idx) + wpe_->forward(pos));
  for (auto& b : blocks_) x = b->forward(x);
  x = ln_f_->forward(x);
  return at::linear(x, wte_->weight);  // tied output head
}

at::Tensor GptImpl::Loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}));
}

at::Tensor GptImpl::Generate(at::Tensor idx, int64_t n, double temperature, int64_t top_k) {
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
