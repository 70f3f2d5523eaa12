// Images for the encoder: PNG and JPEG decoding (libpng, libjpeg-turbo), resizing and
// normalisation into the float CHW buffers the encoder workers turn into tensors.
//
// Decoding errors from libpng and libjpeg are translated into absl::Status here and nowhere else;
// every message names the file (or the `source` a caller passes for in-memory bytes).
#ifndef HETPAR_COMMON_DATA_IMAGE_H_
#define HETPAR_COMMON_DATA_IMAGE_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace hetpar::data {

// An 8-bit RGB image: rows top to bottom, pixels left to right, channels interleaved (HWC).
struct RgbImage {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> pixels;  // height * width * 3 bytes

  RgbImage() = default;
  RgbImage(int w, int h) : width(w), height(h), pixels(static_cast<size_t>(w) * h * 3, 0) {}
  uint8_t* at(int y, int x) { return &pixels[(static_cast<size_t>(y) * width + x) * 3]; }
  const uint8_t* at(int y, int x) const {
    return &pixels[(static_cast<size_t>(y) * width + x) * 3];
  }
};

enum class ImageFormat { kPng, kJpeg };

// The largest side and pixel count a decoded image may have; larger files are rejected before
// any pixel buffer is allocated.
inline constexpr int kMaxImageSide = 16384;
inline constexpr int64_t kMaxImagePixels = int64_t{1} << 26;
// The largest image file read: an uncompressed 16-bit RGBA PNG of kMaxImagePixels (512 MiB) and
// a little more.
inline constexpr int64_t kMaxImageFileBytes = int64_t{520} << 20;

// The format from the file's magic bytes; InvalidArgument (naming `source`) for anything else.
absl::StatusOr<ImageFormat> DetectImageFormat(std::string_view bytes, std::string_view source);

// Decodes PNG or JPEG bytes to RGB. Grey is expanded to RGB; an alpha channel is dropped, each
// pixel keeping its colour (as PIL's convert("RGB")); 16-bit PNG samples are reduced to 8 bits; a
// PNG's gAMA chunk is ignored (as PIL does).
// A corrupt or truncated file (for a JPEG, one whose data is lost, not one with libjpeg's
// harmless warnings) is DataLoss naming `source` and the decoder's reason.
absl::StatusOr<RgbImage> DecodeImage(std::string_view bytes, std::string_view source);

// Reads and decodes a PNG or JPEG file (NotFound when it is missing).
absl::StatusOr<RgbImage> ReadImageFile(const std::string& path);

// Lossless PNG bytes of `image`.
absl::StatusOr<std::string> EncodePng(const RgbImage& image);

// JPEG bytes of `image` at `quality` (1..100), 4:4:4 chroma.
absl::StatusOr<std::string> EncodeJpeg(const RgbImage& image, int quality);

// Resamples to width x height with a linear (triangle) filter widened by the shrink factor:
// bilinear when enlarging, area-like (no aliasing) when shrinking. Identity when sizes match.
// Non-square inputs are stretched to the target aspect ratio.
RgbImage ResizeImage(const RgbImage& image, int width, int height);

// Per-channel normalisation: value = (pixel / 255 - mean[c]) / stddev[c].
struct Normalization {
  std::array<float, 3> mean = {0.5f, 0.5f, 0.5f};
  std::array<float, 3> stddev = {0.5f, 0.5f, 0.5f};
};

// The image as floats in CHW order (channel planes, then rows, then columns), normalised.
std::vector<float> ToNormalizedChw(const RgbImage& image, const Normalization& normalization);

// ReadImageFile + ResizeImage to size x size + ToNormalizedChw: what the encoder consumes.
absl::StatusOr<std::vector<float>> LoadImageForEncoder(const std::string& path, int size,
                                                       const Normalization& normalization);

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_IMAGE_H_
