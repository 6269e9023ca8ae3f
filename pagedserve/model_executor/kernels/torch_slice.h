// The part of torch the kernel files use: ATen's Tensor with its methods, the two factory functions they call, and
// the torch:: names over at:: (as torch/types.h declares them). torch/types.h itself includes every ATen operator:
// ~11 s of each kernel file's compile time, against ~2 s for these (bindings.cpp alone needs pybind11's casters).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

namespace torch {
using namespace at;  // NOLINT (torch::Tensor, torch::kFloat, torch::empty ... are at::'s, as in torch/types.h)
}  // namespace torch
