// Fashion-MNIST (Zalando, 70 000 28x28 grey images of 10 clothing classes) as
// a trainer::Dataset, read from the IDX files of Debian's `dataset-fashion-mnist`
// package (/usr/share/datasets/fashion-mnist) or any directory holding
//   train-images-idx3-ubyte[.gz]  train-labels-idx1-ubyte[.gz]
//   t10k-images-idx3-ubyte[.gz]   t10k-labels-idx1-ubyte[.gz]
#ifndef SHARDTRAIN_EXAMPLES_FASHION_MNIST_FASHION_MNIST_H_
#define SHARDTRAIN_EXAMPLES_FASHION_MNIST_FASHION_MNIST_H_

#include <ATen/core/Tensor.h>

#include <array>
#include <string>
#include <vector>

#include "trainer/data/data.h"

namespace shardtrain::examples {

inline constexpr const char* kFashionMnistDebianDir = "/usr/share/datasets/fashion-mnist";
inline constexpr std::array<const char*, 10> kFashionMnistClasses = {
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};

// Images stay uint8 in memory (47 MB for the training split); batches are
// converted to float32 [B, 1, 28, 28], normalized with the training set's
// mean and standard deviation. Targets are int64 class indices [B].
class FashionMnist : public trainer::Dataset {
 public:
  static constexpr double kMean = 0.2860;
  static constexpr double kStd = 0.3530;

  // split: "train" (60 000) or "test" (10 000). A missing directory or file
  // throws InvalidArgumentError saying which package provides the data and
  // which flag (`flag_name`) points to another directory.
  static FashionMnist Load(const std::string& dir, const std::string& split,
                           const std::string& flag_name = "--data_dir");

  FashionMnist(at::Tensor images, at::Tensor labels);
  int64_t size() const override;
  trainer::Batch get_batch(const std::vector<int64_t>& indices) const override;

  const at::Tensor& images() const { return images_; }  // uint8 [N, 28, 28]
  const at::Tensor& labels() const { return labels_; }  // int64 [N]

 private:
  at::Tensor images_, labels_;
};

// The path of `<dir>/<stem>` or `<dir>/<stem>.gz`, whichever exists ("" if neither).
std::string FindIdxFile(const std::string& dir, const std::string& stem);

}  // namespace shardtrain::examples

#endif  // SHARDTRAIN_EXAMPLES_FASHION_MNIST_FASHION_MNIST_H_
