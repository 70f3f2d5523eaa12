// Image tensors of decoded image buffers, for the encoder.
#ifndef HETPAR_COMMON_TRAIN_BATCH_H_
#define HETPAR_COMMON_TRAIN_BATCH_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace hetpar::train {

// [n, channels, size, size] in `dtype` from n CHW float buffers of channels*size*size values.
// InvalidArgument naming the image when a buffer has the wrong size.
absl::StatusOr<at::Tensor> ImagesTensor(const std::vector<const std::vector<float>*>& images,
                                        int64_t channels, int64_t size, at::ScalarType dtype);

}  // namespace hetpar::train

#endif  // HETPAR_COMMON_TRAIN_BATCH_H_
