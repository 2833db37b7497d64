#include "examples/llama/llama_model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/init.h>

#include <cmath>
#include <limits>

#include "base/errors.h"

namespace shardtrain::examples::llama {
namespace {

thread_local bool t_zero_init = false;

// [rows, cols] from N(0, std), or zeros under a ZeroInitScope.
at::Tensor InitialWeight(int64_t rows, int64_t cols, double std) {
  at::Tensor w = at::zeros({rows, cols});
  if (!t_zero_init) torch::nn::init::normal_(w, 0.0, std);
  return w;
}

using tensor_parallel::LinearStyle;
using tensor_parallel::ParallelLinearImpl;
using tensor_parallel::SequenceParallel;
using tensor_parallel::TensorParallelScope;

// A linear layer of the plan with Hugging Face's parameter names (weight
// [out, in] from N(0, std), zero under a ZeroInitScope; bias zero).
std::shared_ptr<ParallelLinearImpl> MakeLinear(torch::nn::Module& owner, const char* name, int64_t in, int64_t out,
                                               bool bias, double std, LinearStyle style) {
  tensor_parallel::ParallelLinearOptions o(in, out, style);
  o.bias = bias;
  at::Tensor w = InitialWeight(out, in, std);
  return owner.register_module(name,
                               std::make_shared<ParallelLinearImpl>(o, w, bias ? at::zeros({out}) : at::Tensor()));
}

std::shared_ptr<SequenceParallel<RmsNormImpl>> MakeNorm(torch::nn::Module& owner, const char* name,
                                                        const LlamaConfig& c) {
  return owner.register_module(name, std::make_shared<SequenceParallel<RmsNormImpl>>(c.hidden_size, c.rms_norm_eps));
}

int TensorParallelSize() {
  const auto g = TensorParallelScope::CurrentGroup();
  return g ? g->size() : 1;
}

// Rotary frequencies as Hugging Face computes them (the same float32 operations).
at::Tensor RopeInverseFrequencies(const LlamaConfig& c) {
  const RopeConfig& r = c.rope;
  at::Tensor exponent = at::arange(0, c.head_dim, 2, at::kLong).to(at::kFloat) / c.head_dim;
  at::Tensor inv_freq = at::pow(r.theta, exponent).reciprocal();
  if (r.type == "linear") return inv_freq / r.factor;
  if (r.type != "llama3") return inv_freq;
  const double old_len = static_cast<double>(r.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / r.low_freq_factor;
  const double high_freq_wavelen = old_len / r.high_freq_factor;
  at::Tensor wavelen = inv_freq.reciprocal() * (2 * M_PI);
  at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq);
  at::Tensor smooth = (wavelen.reciprocal() * old_len - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  at::Tensor medium = (wavelen < high_freq_wavelen).logical_not() * (wavelen > low_freq_wavelen).logical_not();
  return at::where(medium, smoothed, scaled);
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// [B, kv_heads, T, D] -> [B, kv_heads * n_rep, T, D], each head repeated n_rep times in place.
at::Tensor RepeatKv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  return x.unsqueeze(2).expand({B, H, n_rep, T, D}).reshape({B, H * n_rep, T, D});
}

// Keeps the smallest set of most likely tokens whose probability reaches top_p.
at::Tensor TopP(const at::Tensor& logits, double top_p) {
  auto [sorted, order] = logits.sort(-1, /*descending=*/true);
  at::Tensor probs = at::softmax(sorted, -1);
  at::Tensor drop = (probs.cumsum(-1) - probs) > top_p;
  sorted = sorted.masked_fill(drop, -std::numeric_limits<float>::infinity());
  return at::empty_like(logits).scatter_(-1, order, sorted);
}

}  // namespace

ZeroInitScope::ZeroInitScope() : previous_(t_zero_init) { t_zero_init = true; }
ZeroInitScope::~ZeroInitScope() { t_zero_init = previous_; }
bool ZeroInitScope::active() { return t_zero_init; }

at::Tensor PickNextToken(at::Tensor logits, const GenerateOptions& o, at::Generator& gen) {
  if (o.greedy) return logits.argmax(-1);
  logits = logits / o.temperature;
  if (o.top_k > 0 && o.top_k < logits.size(-1)) {
    at::Tensor kth = std::get<0>(logits.topk(o.top_k)).select(-1, o.top_k - 1).unsqueeze(-1);
    logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
  }
  if (o.top_p < 1.0) logits = TopP(logits, o.top_p);
  return at::multinomial(at::softmax(logits, -1), 1, /*replacement=*/false, gen).squeeze(-1);
}

RmsNormImpl::RmsNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RmsNormImpl::forward(const at::Tensor& x) {
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps_);
  return weight * h.to(x.scalar_type());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c) : head_dim_(c.head_dim) {
  const int tp = TensorParallelSize();
  ST_CHECK_ARG(c.num_attention_heads % tp == 0 && c.num_key_value_heads % tp == 0, "Llama: num_attention_heads (",
               c.num_attention_heads, ") and num_key_value_heads (", c.num_key_value_heads,
               ") must divide by tensor_parallel_size (", tp, "): each rank computes whole query and key/value heads");
  heads_ = c.num_attention_heads / tp;
  kv_heads_ = c.num_key_value_heads / tp;
  const int64_t q_out = c.num_attention_heads * head_dim_, kv_out = c.num_key_value_heads * head_dim_;
  const double std = c.initializer_range;
  const bool bias = c.attention_bias;
  q_proj_ = MakeLinear(*this, "q_proj", c.hidden_size, q_out, bias, std, LinearStyle::kColwise);
  k_proj_ = MakeLinear(*this, "k_proj", c.hidden_size, kv_out, bias, std, LinearStyle::kColwise);
  v_proj_ = MakeLinear(*this, "v_proj", c.hidden_size, kv_out, bias, std, LinearStyle::kColwise);
  o_proj_ = MakeLinear(*this, "o_proj", q_out, c.hidden_size, bias, std, LinearStyle::kRowwise);
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                       LayerKvCache* cache) {
  at::Tensor q = q_proj_->forward(x);  // this rank's heads over the whole sequence (x: its part under SP)
  const int64_t B = q.size(0), T = q.size(1);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, -1, head_dim_}).transpose(1, 2); };
  q = heads(q);
  at::Tensor k = heads(k_proj_->forward(x)), v = heads(v_proj_->forward(x));
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  q = q * c + RotateHalf(q) * s;
  k = k * c + RotateHalf(k) * s;
  const int64_t past = cache == nullptr ? 0 : cache->length();
  if (cache != nullptr) {
    cache->keys = past == 0 ? k : at::cat({cache->keys, k}, 2);
    cache->values = past == 0 ? v : at::cat({cache->values, v}, 2);
    k = cache->keys;
    v = cache->values;
  }
  const int64_t n_rep = heads_ / kv_heads_;
  std::optional<at::Tensor> mask;
  bool causal = T > 1;
  if (past > 0 && T > 1) {  // new queries see every cached key and the new ones up to their own position
    mask = at::ones({T, past + T}, x.options().dtype(at::kBool)).tril(past);
    causal = false;
  }
  at::Tensor y = at::scaled_dot_product_attention(q, RepeatKv(k, n_rep), RepeatKv(v, n_rep), mask, 0.0, causal,
                                                  1.0 / std::sqrt(static_cast<double>(head_dim_)));
  return o_proj_->forward(y.transpose(1, 2).reshape({B, T, -1}));
}

LlamaMlpImpl::LlamaMlpImpl(const LlamaConfig& c) {
  const double std = c.initializer_range;
  const int64_t h = c.hidden_size, i = c.intermediate_size;
  gate_proj_ = MakeLinear(*this, "gate_proj", h, i, c.mlp_bias, std, LinearStyle::kColwise);
  up_proj_ = MakeLinear(*this, "up_proj", h, i, c.mlp_bias, std, LinearStyle::kColwise);
  down_proj_ = MakeLinear(*this, "down_proj", i, h, c.mlp_bias, std, LinearStyle::kRowwise);
}

at::Tensor LlamaMlpImpl::forward(const at::Tensor& x) {
  return down_proj_->forward(at::silu(gate_proj_->forward(x)) * up_proj_->forward(x));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c) {
  self_attn_ = register_module("self_attn", std::make_shared<LlamaAttentionImpl>(c));
  mlp_ = register_module("mlp", std::make_shared<LlamaMlpImpl>(c));
  input_layernorm_ = MakeNorm(*this, "input_layernorm", c);
  post_attention_layernorm_ = MakeNorm(*this, "post_attention_layernorm", c);
}

at::Tensor LlamaDecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                          LayerKvCache* cache) {
  at::Tensor h = x + self_attn_->forward(input_layernorm_->forward(x), cos, sin, cache);
  return h + mlp_->forward(post_attention_layernorm_->forward(h));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c)
    : config_(c),
      inv_freq_(RopeInverseFrequencies(c)),
      tp_group_(TensorParallelScope::CurrentGroup()),
      sequence_parallel_(TensorParallelScope::CurrentSequenceParallel()) {
  embed_tokens_ = register_module("embed_tokens", std::make_shared<tensor_parallel::ParallelEmbeddingImpl>(
                                                      InitialWeight(c.vocab_size, c.hidden_size, c.initializer_range)));
  layers_holder_ = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    auto layer = std::make_shared<sharding::Sharded<LlamaDecoderLayerImpl>>(c);
    layers_holder_->push_back(layer);
    layers_.push_back(layer);
  }
  norm_ = MakeNorm(*this, "norm", c);
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& ids, std::vector<LayerKvCache>* cache) {
  ST_CHECK_ARG(ids.dim() == 2, "Llama: input ids must be [batch, length], got ", ids.sizes());
  ST_CHECK_ARG(cache == nullptr || !tp_group_,
               "Llama: decoding with a key/value cache needs the whole model; this one "
               "is split over ",
               tp_group_ ? tp_group_->size() : 1,
               " tensor-parallel ranks (load its full checkpoint into a model built without model_parallel)");
  if (cache != nullptr && cache->empty()) cache->resize(layers_.size());
  const int64_t past = cache == nullptr ? 0 : cache->front().length();
  ST_CHECK_ARG(past + ids.size(1) <= config_.max_position_embeddings, "Llama: ", past + ids.size(1),
               " positions exceed max_position_embeddings ", config_.max_position_embeddings);
  // Under sequence parallelism the sequence splits over the group: padded at
  // its end to a multiple of it (causal attention: no earlier position changes).
  const int64_t pad =
      sequence_parallel_ ? (tp_group_->size() - ids.size(1) % tp_group_->size()) % tp_group_->size() : 0;
  const at::Tensor padded = pad > 0 ? at::constant_pad_nd(ids, {0, pad}, 0) : ids;
  const int64_t T = padded.size(1);
  at::Tensor x = embed_tokens_->forward(padded);
  // cos/sin of every position ([B, T, head_dim]), as Hugging Face computes them.
  at::Tensor positions = at::arange(past, past + T, ids.options().dtype(at::kFloat)).expand({ids.size(0), T});
  // (The attention gathers the whole sequence before it uses them.)
  at::Tensor freqs = positions.unsqueeze(-1) * inv_freq_.to(x.device());
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
  for (size_t i = 0; i < layers_.size(); ++i) {
    x = layers_[i]->forward(x, cos, sin, cache == nullptr ? nullptr : &(*cache)[i]);
  }
  return norm_->forward(x);
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c)
    : config_(c), tp_group_(TensorParallelScope::CurrentGroup()) {
  c.Validate();
  model_ = register_module("model", std::make_shared<LlamaModelImpl>(c));
  if (!c.tie_word_embeddings) {
    lm_head_ =
        MakeLinear(*this, "lm_head", c.hidden_size, c.vocab_size, false, c.initializer_range, LinearStyle::kColwise);
  }
}

at::Tensor LlamaForCausalLMImpl::Head(const at::Tensor& hidden) {
  return lm_head_ ? lm_head_->forward(hidden) : model_->embed_tokens().TiedLogits(hidden);
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& ids) {
  at::Tensor logits = Head(model_->forward(ids));
  return logits.size(1) > ids.size(1) ? logits.slice(1, 0, ids.size(1)) : logits;  // sequence parallel: padded
}

std::pair<int64_t, int64_t> LlamaForCausalLMImpl::vocab_range() const {
  return lm_head_ ? lm_head_->output_range() : model_->embed_tokens().vocab_range();
}

at::Tensor LlamaForCausalLMImpl::GatherLogits(const at::Tensor& logits) const {
  return tensor_parallel::GatherVocabulary(logits, config_.vocab_size, tp_group_);
}

at::Tensor LlamaForCausalLMImpl::LossOf(const at::Tensor& logits, const at::Tensor& targets) const {
  if (!tp_group_) return Loss(logits, targets);
  return tensor_parallel::VocabParallelCrossEntropy(logits, targets, vocab_range().first, tp_group_, -100);
}

at::Tensor LlamaForCausalLMImpl::ForwardWithCache(const at::Tensor& ids, std::vector<LayerKvCache>& cache) {
  return Head(model_->forward(ids, &cache));
}

at::Tensor LlamaForCausalLMImpl::Loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}), {},
                                at::Reduction::Mean, /*ignore_index=*/-100);
}

at::Tensor LlamaForCausalLMImpl::Generate(const at::Tensor& prompt, const GenerateOptions& o) {
  ST_CHECK_ARG(prompt.dim() == 2 && prompt.size(1) > 0, "Llama: prompt must be [batch, length>0], got ",
               prompt.sizes());
  ST_CHECK_ARG(o.greedy || o.temperature > 0, "Llama: temperature must be positive, got ", o.temperature);
  ST_CHECK_ARG(o.top_p > 0 && o.top_p <= 1, "Llama: top_p must be in (0, 1], got ", o.top_p);
  ST_CHECK_ARG(o.top_k >= 0, "Llama: top_k must be >= 0 (0: all), got ", o.top_k);
  at::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::vector<LayerKvCache> cache;
  at::Tensor ids = prompt, input = prompt;
  at::Tensor eos = at::tensor(config_.eos_token_ids, prompt.options().dtype(at::kLong));
  at::Tensor done = at::zeros({prompt.size(0)}, prompt.options().dtype(at::kBool));
  const int64_t fill =
      config_.pad_token_id >= 0 ? config_.pad_token_id : (config_.eos_token_ids.empty() ? 0 : config_.eos_token_ids[0]);
  const bool use_eos = o.stop_at_eos && !config_.eos_token_ids.empty();
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    at::Tensor hidden = model_->forward(input, &cache);
    at::Tensor logits = Head(hidden.select(1, hidden.size(1) - 1)).to(at::kFloat);
    at::Tensor next = PickNextToken(logits.cpu(), o, gen).to(ids.device());
    if (use_eos) {
      next = at::where(done, at::full_like(next, fill), next);
      done = done.logical_or(at::isin(next, eos));
    }
    ids = at::cat({ids, next.unsqueeze(1)}, 1);
    input = next.unsqueeze(1);
    if (use_eos && done.all().item<bool>()) break;
  }
  return ids;
}

}  // namespace shardtrain::examples::llama
