#include "tensor_parallel/collectives.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "base/errors.h"

namespace shardtrain::tensor_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool Active(const comm::CommunicatorPtr& group) { return group && group->size() > 1; }

void SaveGroup(AutogradContext* ctx, const comm::Communicator* group, int64_t dim) {
  ctx->saved_data["group"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(group));
  ctx->saved_data["dim"] = dim;
}
comm::Communicator* GroupOf(AutogradContext* ctx) {
  return reinterpret_cast<comm::Communicator*>(static_cast<intptr_t>(ctx->saved_data["group"].toInt()));
}
int64_t DimOf(AutogradContext* ctx) { return ctx->saved_data["dim"].toInt(); }

// Plain collectives along a dimension (no autograd).
at::Tensor AllReduce(const at::Tensor& x, comm::Communicator* group) {
  at::Tensor out = x.contiguous().clone();
  group->AllReduce(out)->Wait();
  return out;
}

at::Tensor AllGatherDim(const at::Tensor& x, int64_t dim, comm::Communicator* group) {
  at::Tensor front = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = front.sizes().vec();
  shape[0] *= group->size();
  at::Tensor out = at::empty(shape, front.options());
  group->AllGather(front, out)->Wait();
  return out.movedim(0, dim).contiguous();
}

// Splitting `dim` over the group needs equal blocks.
void CheckDivides(const at::Tensor& x, int64_t dim, const comm::Communicator* group) {
  ST_CHECK_ARG(x.size(dim) % group->size() == 0, "tensor parallel: dimension ", dim, " of a tensor of shape ",
               x.sizes(), " must divide by the tensor-parallel size ", group->size(),
               " (sequence parallel: the sequence length)");
}

at::Tensor ReduceScatterDim(const at::Tensor& x, int64_t dim, comm::Communicator* group) {
  CheckDivides(x, dim, group);
  at::Tensor front = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = front.sizes().vec();
  shape[0] /= group->size();
  at::Tensor out = at::empty(shape, front.options());
  group->ReduceScatter(front, out)->Wait();
  return out.movedim(0, dim).contiguous();
}

at::Tensor BlockOf(const at::Tensor& x, int64_t dim, comm::Communicator* group) {
  CheckDivides(x, dim, group);
  const int64_t n = x.size(dim) / group->size();
  return x.narrow(dim, group->rank() * n, n).contiguous();
}

struct CopyFn : torch::autograd::Function<CopyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::Communicator* g) {
    SaveGroup(ctx, g, 0);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {AllReduce(grad[0], GroupOf(ctx)), at::Tensor()};
  }
};

struct ReduceFn : torch::autograd::Function<ReduceFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::Communicator* g) {
    return AllReduce(x, g);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) { return {grad[0], at::Tensor()}; }
};

struct GatherFn : torch::autograd::Function<GatherFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, comm::Communicator* g) {
    SaveGroup(ctx, g, dim);
    return AllGatherDim(x, dim, g);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {BlockOf(grad[0], DimOf(ctx), GroupOf(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct GatherSequenceFn : torch::autograd::Function<GatherSequenceFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, comm::Communicator* g) {
    SaveGroup(ctx, g, dim);
    return AllGatherDim(x, dim, g);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {ReduceScatterDim(grad[0], DimOf(ctx), GroupOf(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterFn : torch::autograd::Function<ReduceScatterFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, comm::Communicator* g) {
    SaveGroup(ctx, g, dim);
    return ReduceScatterDim(x, dim, g);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {AllGatherDim(grad[0], DimOf(ctx), GroupOf(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct SplitFn : torch::autograd::Function<SplitFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, comm::Communicator* g) {
    SaveGroup(ctx, g, dim);
    return BlockOf(x, dim, g);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {AllGatherDim(grad[0], DimOf(ctx), GroupOf(ctx)), at::Tensor(), at::Tensor()};
  }
};

int64_t WrapDim(const at::Tensor& x, int64_t dim) { return dim < 0 ? dim + x.dim() : dim; }

}  // namespace

at::Tensor CopyToRegion(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  return Active(group) ? CopyFn::apply(x, group.get()) : x;
}

at::Tensor ReduceFromRegion(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  return Active(group) ? ReduceFn::apply(x, group.get()) : x;
}

at::Tensor GatherFromRegion(const at::Tensor& x, int64_t dim, const comm::CommunicatorPtr& group) {
  return Active(group) ? GatherFn::apply(x, WrapDim(x, dim), group.get()) : x;
}

at::Tensor GatherSequence(const at::Tensor& x, int64_t dim, const comm::CommunicatorPtr& group) {
  return Active(group) ? GatherSequenceFn::apply(x, WrapDim(x, dim), group.get()) : x;
}

at::Tensor ReduceScatterSequence(const at::Tensor& x, int64_t dim, const comm::CommunicatorPtr& group) {
  return Active(group) ? ReduceScatterFn::apply(x, WrapDim(x, dim), group.get()) : x;
}

at::Tensor SplitSequence(const at::Tensor& x, int64_t dim, const comm::CommunicatorPtr& group) {
  return Active(group) ? SplitFn::apply(x, WrapDim(x, dim), group.get()) : x;
}

}  // namespace shardtrain::tensor_parallel
