#include "tests/tensor_parallel/tiny_tp_lm.h"

#include <ATen/ATen.h>

namespace shardtrain::tensor_parallel::testing {

TinyBlockImpl::TinyBlockImpl(const TinyConfig& c) {
  const comm::CommunicatorPtr group = TensorParallelScope::CurrentGroup();
  local_heads_ = c.heads / (group ? group->size() : 1);
  auto linear = [&](const char* name, int64_t in, int64_t out, LinearStyle style, int64_t chunks) {
    ParallelLinearOptions o(in, out, style);
    o.chunks = chunks;
    o.bias = c.bias;
    return register_module(name, std::make_shared<ParallelLinearImpl>(o));
  };
  auto norm = [&](const char* name) {
    return register_module(
        name, std::make_shared<SequenceParallel<torch::nn::LayerNormImpl>>(torch::nn::LayerNormOptions({c.embd})));
  };
  ln_1_ = norm("ln_1");
  qkv_ = linear("qkv", c.embd, 3 * c.embd, LinearStyle::kColwise, 3);
  proj_ = linear("proj", c.embd, c.embd, LinearStyle::kRowwise, 1);
  ln_2_ = norm("ln_2");
  fc_ = linear("fc", c.embd, 4 * c.embd, LinearStyle::kColwise, 1);
  fc_proj_ = linear("fc_proj", 4 * c.embd, c.embd, LinearStyle::kRowwise, 1);
}

std::atomic<int64_t> TinyBlockImpl::forward_calls{0};

at::Tensor TinyBlockImpl::forward(const at::Tensor& x) {
  ++forward_calls;
  at::Tensor qkv = qkv_->forward(ln_1_->forward(x));  // [B, T, 3 * C_local], the whole sequence
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3;
  auto parts = qkv.split(C, 2);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, local_heads_, C / local_heads_}).transpose(1, 2); };
  at::Tensor y = at::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), {}, 0.0, true);
  at::Tensor h = x + proj_->forward(y.transpose(1, 2).contiguous().view({B, T, C}));
  return h + fc_proj_->forward(at::gelu(fc_->forward(ln_2_->forward(h)), "tanh"));
}

TinyLmImpl::TinyLmImpl(const TinyConfig& c)
    : group_(TensorParallelScope::CurrentGroup()), sequence_parallel_(TensorParallelScope::CurrentSequenceParallel()) {
  wte_ = register_module("wte", std::make_shared<ParallelEmbeddingImpl>(c.vocab, c.embd));
  wpe_ = register_module("wpe", std::make_shared<SequenceParallel<torch::nn::EmbeddingImpl>>(c.block, c.embd));
  for (int64_t i = 0; i < c.layers; ++i) {
    blocks_.push_back(register_module("h" + std::to_string(i), std::make_shared<sharding::Sharded<TinyBlockImpl>>(c)));
  }
  ln_f_ = register_module(
      "ln_f", std::make_shared<SequenceParallel<torch::nn::LayerNormImpl>>(torch::nn::LayerNormOptions({c.embd})));
}

at::Tensor TinyLmImpl::forward(const at::Tensor& ids) {
  int64_t begin = 0, end = ids.size(1);
  if (sequence_parallel_) {  // this rank's positions: the position embedding's gradient is partial
    const int64_t n = ids.size(1) / group_->size();
    begin = group_->rank() * n;
    end = begin + n;
  }
  at::Tensor x = wte_->forward(ids) + wpe_->forward(at::arange(begin, end, ids.options().dtype(at::kLong)));
  for (auto& b : blocks_) x = b->forward(x);
  return wte_->TiedLogits(ln_f_->forward(x));
}

at::Tensor TinyLmImpl::Loss(const at::Tensor& logits, const at::Tensor& targets) {
  return VocabParallelCrossEntropy(logits, targets, wte_->vocab_range().first, group_);
}

}  // namespace shardtrain::tensor_parallel::testing
