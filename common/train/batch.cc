#include "common/train/batch.h"

#include <ATen/ATen.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace hetpar::train {

absl::StatusOr<at::Tensor> ImagesTensor(const std::vector<const std::vector<float>*>& images,
                                        int64_t channels, int64_t size, at::ScalarType dtype) {
  const int64_t n = static_cast<int64_t>(images.size());
  const int64_t per_image = channels * size * size;
  at::Tensor out = at::empty({n, channels, size, size}, at::kFloat);
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<int64_t>(images[i]->size()) != per_image) {
      return absl::InvalidArgumentError(
          absl::StrCat("image ", i, " of the job has ", images[i]->size(), " values; expected ",
                       channels, "x", size, "x", size, " = ", per_image));
    }
    std::memcpy(dst + i * per_image, images[i]->data(), per_image * sizeof(float));
  }
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace hetpar::train
