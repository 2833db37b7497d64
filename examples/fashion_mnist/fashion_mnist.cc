#include "examples/fashion_mnist/fashion_mnist.h"

#include <ATen/ATen.h>

#include <filesystem>

#include "base/errors.h"
#include "examples/fashion_mnist/idx.h"

namespace shardtrain::examples {
namespace fs = std::filesystem;

std::string FindIdxFile(const std::string& dir, const std::string& stem) {
  for (const std::string& name : {stem, stem + ".gz"}) {
    const fs::path p = fs::path(dir) / name;
    std::error_code ec;
    if (fs::is_regular_file(p, ec)) return p.string();
  }
  return "";
}

FashionMnist FashionMnist::Load(const std::string& dir, const std::string& split, const std::string& flag_name) {
  ST_CHECK_ARG(split == "train" || split == "test", "Fashion-MNIST split '", split, "' is not valid; valid: train, test");
  const std::string prefix = split == "train" ? "train" : "t10k";
  const std::string how = std::string("install Debian's `dataset-fashion-mnist` package (sudo apt-get install "
                                      "dataset-fashion-mnist; tools/bootstrap.sh does), which puts the files in ") +
                          kFashionMnistDebianDir + ", or pass " + flag_name + "=DIR";
  std::error_code ec;
  ST_CHECK_ARG(fs::is_directory(dir, ec), "no Fashion-MNIST data: directory '", dir, "' does not exist; ", how);
  const std::string images_path = FindIdxFile(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = FindIdxFile(dir, prefix + "-labels-idx1-ubyte");
  ST_CHECK_ARG(!images_path.empty() && !labels_path.empty(), "no Fashion-MNIST ", split, " data in '", dir,
               "': expected ", prefix, "-images-idx3-ubyte[.gz] and ", prefix, "-labels-idx1-ubyte[.gz]; ", how);
  at::Tensor images = ReadIdxFile(images_path, 3);
  at::Tensor labels = ReadIdxFile(labels_path, 1);
  ST_CHECK_ARG(images.size(0) == labels.size(0), "Fashion-MNIST ", split, ": ", images.size(0), " images in '",
               images_path, "' but ", labels.size(0), " labels in '", labels_path, "'");
  ST_CHECK_ARG(images.size(1) == 28 && images.size(2) == 28, "Fashion-MNIST images in '", images_path,
               "' are ", images.size(1), "x", images.size(2), ", expected 28x28");
  ST_CHECK_ARG(labels.max().item<int64_t>() < static_cast<int64_t>(kFashionMnistClasses.size()),
               "Fashion-MNIST labels in '", labels_path, "' exceed the 10 classes");
  return FashionMnist(images, labels.to(at::kLong));
}

FashionMnist::FashionMnist(at::Tensor images, at::Tensor labels)
    : images_(std::move(images)), labels_(std::move(labels)) {
  ST_CHECK_ARG(images_.dim() == 3 && labels_.dim() == 1 && images_.size(0) == labels_.size(0),
               "FashionMnist: images [N, H, W] and labels [N] expected");
}

int64_t FashionMnist::size() const { return images_.size(0); }

trainer::Batch FashionMnist::get_batch(const std::vector<int64_t>& indices) const {
  at::Tensor idx = at::tensor(indices, at::kLong);
  at::Tensor x = images_.index_select(0, idx).to(at::kFloat).div_(255.0).sub_(kMean).div_(kStd).unsqueeze(1);
  return {x, labels_.index_select(0, idx)};
}

}  // namespace shardtrain::examples
