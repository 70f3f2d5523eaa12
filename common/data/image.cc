#include "common/data/image.h"

// clang-format off
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <jpeglib.h>
// After jpeglib.h: the message codes (JWRN_*).
#include <jerror.h>
#include <png.h>
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/data/file_util.h"

namespace hetpar::data {
namespace {

constexpr unsigned char kPngMagic[] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
constexpr unsigned char kJpegMagic[] = {0xff, 0xd8, 0xff};

absl::Status CheckDimensions(int64_t width, int64_t height, std::string_view source) {
  if (width <= 0 || height <= 0 || width > kMaxImageSide || height > kMaxImageSide ||
      width * height > kMaxImagePixels) {
    return absl::InvalidArgumentError(absl::StrCat(
        "image ", std::string(source), " is ", width, "x", height, " pixels; expected sides in 1..",
        kMaxImageSide, " and at most ", kMaxImagePixels, " pixels"));
  }
  return absl::OkStatus();
}

// ---- libpng (simplified API: it reports errors through png_image::message, no longjmp) ----

uint32_t BigEndian32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// The PNG without its gAMA chunks (an empty string when it has none). libpng's simplified API
// converts samples from a gAMA's gamma to sRGB's (a file marked gamma 1.0 has mid-grey 128 read as
// 188); PIL, which the Hugging Face image processors read images with, ignores gAMA and returns
// the stored samples, and so does hetpar. A chunk list that does not parse is left to libpng to
// report.
std::string WithoutGammaChunks(std::string_view bytes) {
  constexpr size_t kSignature = sizeof(kPngMagic);
  std::vector<std::pair<size_t, size_t>> gamma;  // [offset, end) of each gAMA chunk
  size_t at = kSignature;
  while (at + 12 <= bytes.size()) {
    const auto* chunk = reinterpret_cast<const unsigned char*>(bytes.data()) + at;
    const uint64_t end = at + uint64_t{12} + BigEndian32(chunk);
    if (end > bytes.size()) break;
    if (std::memcmp(chunk + 4, "gAMA", 4) == 0) gamma.emplace_back(at, end);
    if (std::memcmp(chunk + 4, "IDAT", 4) == 0 || std::memcmp(chunk + 4, "IEND", 4) == 0) break;
    at = end;
  }
  if (gamma.empty()) return {};
  std::string out;
  out.reserve(bytes.size());
  size_t kept = 0;
  for (const auto& [begin, end] : gamma) {
    out.append(bytes.substr(kept, begin - kept));
    kept = end;
  }
  out.append(bytes.substr(kept));
  return out;
}

absl::StatusOr<RgbImage> DecodePng(std::string_view bytes, std::string_view source) {
  const std::string without_gamma = WithoutGammaChunks(bytes);
  if (!without_gamma.empty()) bytes = without_gamma;
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&png, bytes.data(), bytes.size())) {
    std::string reason = png.message;
    png_image_free(&png);
    return absl::DataLossError(absl::StrCat("corrupt PNG ", std::string(source), ": ", reason));
  }
  if (absl::Status s = CheckDimensions(png.width, png.height, source); !s.ok()) {
    png_image_free(&png);
    return s;
  }
  // 16-bit samples are sRGB-encoded like 8-bit ones (as PIL reads them), not linear: without the
  // flag libpng applies the sRGB curve on the way to 8 bits, and mid-grey 0x8080 becomes 186.
  png.flags |= PNG_IMAGE_FLAG_16BIT_sRGB;
  const bool alpha = (png.format & PNG_FORMAT_FLAG_ALPHA) != 0;
  // Alpha is dropped, keeping each pixel's colour (PIL's convert("RGB")): 8-bit output with alpha
  // is not premultiplied.
  png.format = alpha ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB;
  RgbImage image(static_cast<int>(png.width), static_cast<int>(png.height));
  std::vector<uint8_t> rgba(alpha ? image.pixels.size() / 3 * 4 : 0);
  if (!png_image_finish_read(&png, nullptr, alpha ? rgba.data() : image.pixels.data(), 0,
                             nullptr)) {
    std::string reason = png.message;
    png_image_free(&png);
    return absl::DataLossError(absl::StrCat("corrupt PNG ", std::string(source), ": ", reason));
  }
  for (size_t i = 0, o = 0; i < rgba.size(); i += 4, o += 3) {
    image.pixels[o] = rgba[i];
    image.pixels[o + 1] = rgba[i + 1];
    image.pixels[o + 2] = rgba[i + 2];
  }
  return image;
}

// ---- libjpeg: errors longjmp back to the frame of DecodeJpegInto, which owns no C++ objects ----

struct JpegErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool corrupt = false;  // a warning that the pixels are not all the file's (see JpegEmitMessage)
};

void JpegErrorExit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// libjpeg reports lost data as warnings, among harmless ones. Lost data: the file ends early, a
// segment is cut by a marker, entropy-coded data does not decode, restart markers are out of
// step; the image is then partly grey. Harmless (the file decodes in full, as Pillow, which the
// LLaVA pipelines use, also takes it): stray bytes before a marker, an unknown JFIF revision, an
// odd Adobe transform, a bad ICC profile, a baseline file with zeroed scan parameters ("Invalid
// SOS parameters for sequential JPEG"). Keeps the text of the first lost-data warning.
void JpegEmitMessage(j_common_ptr cinfo, int msg_level) {
  if (msg_level >= 0) return;  // trace messages
  auto* err = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  ++err->pub.num_warnings;
  switch (err->pub.msg_code) {
    case JWRN_JPEG_EOF:
    case JWRN_HIT_MARKER:
    case JWRN_HUFF_BAD_CODE:
    case JWRN_ARITH_BAD_CODE:
    case JWRN_MUST_RESYNC:
    case JWRN_BOGUS_PROGRESSION:
      if (!err->corrupt) (*cinfo->err->format_message)(cinfo, err->message);
      err->corrupt = true;
      break;
    default:
      break;
  }
}

// A progressive JPEG may hold any number of scans, each a pass over the whole image: a file of a
// few kilobytes can keep the decoder busy for minutes (libjpeg-turbo's LJT-01-003). Real encoders
// write at most a few dozen; more than this is refused while the file is read.
constexpr int kMaxJpegScans = 500;

void JpegProgressMonitor(j_common_ptr cinfo) {
  if (!cinfo->is_decompressor) return;
  const auto* decompress = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (decompress->input_scan_number <= kMaxJpegScans) return;
  auto* err = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  std::snprintf(err->message, sizeof(err->message),
                "more than %d progressive scans (refused: each is a pass over the whole image)",
                kMaxJpegScans);
  std::longjmp(err->jump, 1);
}

// Returns 0 on success, 1 on a decoder error, 2 on bad dimensions (message in err->message).
// `allocate` is called once with the dimensions and returns the RGB destination buffer.
using JpegAllocate = uint8_t* (*)(void* context, int width, int height);
int DecodeJpegInto(const uint8_t* data, size_t size, JpegErrorManager* err, JpegAllocate allocate,
                   void* context) {
  jpeg_decompress_struct cinfo;
  cinfo.err = jpeg_std_error(&err->pub);
  err->pub.error_exit = JpegErrorExit;
  err->pub.emit_message = JpegEmitMessage;
  err->message[0] = '\0';
  err->corrupt = false;
  if (setjmp(err->jump)) {
    jpeg_destroy_decompress(&cinfo);
    return 1;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_progress_mgr progress;
  std::memset(&progress, 0, sizeof(progress));
  progress.progress_monitor = JpegProgressMonitor;
  cinfo.progress = &progress;
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  // Before jpeg_start_decompress, which allocates whole-image buffers for the declared size (a
  // progressive JPEG of a few hundred bytes can declare 65500 x 65500).
  if (cinfo.image_width == 0 || cinfo.image_height == 0 || cinfo.image_width > kMaxImageSide ||
      cinfo.image_height > kMaxImageSide ||
      static_cast<int64_t>(cinfo.image_width) * cinfo.image_height > kMaxImagePixels) {
    std::snprintf(err->message, sizeof(err->message),
                  "%ux%u pixels; expected sides in 1..%d and at most %lld pixels",
                  cinfo.image_width, cinfo.image_height, kMaxImageSide,
                  static_cast<long long>(kMaxImagePixels));
    jpeg_destroy_decompress(&cinfo);
    return 2;
  }
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    std::snprintf(err->message, sizeof(err->message),
                  "CMYK/YCCK JPEG is not supported; expected greyscale or YCbCr/RGB");
    jpeg_destroy_decompress(&cinfo);
    return 2;
  }
  cinfo.out_color_space = JCS_RGB;
  jpeg_start_decompress(&cinfo);  // output size = the header's (no scaling), checked above
  uint8_t* out = allocate(context, static_cast<int>(cinfo.output_width),
                          static_cast<int>(cinfo.output_height));
  const size_t stride = static_cast<size_t>(cinfo.output_width) * 3;
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = out + stride * cinfo.output_scanline;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return 0;
}

absl::StatusOr<RgbImage> DecodeJpeg(std::string_view bytes, std::string_view source) {
  RgbImage image;
  JpegErrorManager err;
  const int rc = DecodeJpegInto(
      reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &err,
      [](void* context, int width, int height) -> uint8_t* {
        auto* target = static_cast<RgbImage*>(context);
        *target = RgbImage(width, height);
        return target->pixels.data();
      },
      &image);
  if (rc == 1) {
    return absl::DataLossError(
        absl::StrCat("corrupt JPEG ", std::string(source), ": ", err.message));
  }
  if (rc == 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("JPEG ", std::string(source), ": ", err.message));
  }
  if (err.corrupt) {
    return absl::DataLossError(absl::StrCat("corrupt JPEG ", std::string(source), ": ",
                                            err.message[0] ? err.message : "corrupt data"));
  }
  return image;
}

// ---- resampling ----

struct Taps {
  int first = 0;
  std::vector<float> weights;
};

std::vector<Taps> ComputeTaps(int in, int out) {
  const double scale = static_cast<double>(in) / out;
  const double support = std::max(1.0, scale);
  std::vector<Taps> taps(static_cast<size_t>(out));
  for (int o = 0; o < out; ++o) {
    const double center = (o + 0.5) * scale;
    const int lo = std::max(0, static_cast<int>(std::floor(center - support)));
    const int hi = std::min(in, static_cast<int>(std::ceil(center + support)));
    Taps& t = taps[static_cast<size_t>(o)];
    t.first = lo;
    double sum = 0;
    std::vector<double> w;
    for (int i = lo; i < hi; ++i) {
      const double x = std::abs((i + 0.5 - center) / support);
      const double v = x < 1.0 ? 1.0 - x : 0.0;
      w.push_back(v);
      sum += v;
    }
    for (double v : w) t.weights.push_back(static_cast<float>(sum > 0 ? v / sum : 0.0));
  }
  return taps;
}

uint8_t ClampToByte(float v) {
  const float r = std::round(v);
  return static_cast<uint8_t>(r < 0.f ? 0.f : (r > 255.f ? 255.f : r));
}

}  // namespace

absl::StatusOr<ImageFormat> DetectImageFormat(std::string_view bytes, std::string_view source) {
  if (bytes.size() >= sizeof(kPngMagic) &&
      std::memcmp(bytes.data(), kPngMagic, sizeof(kPngMagic)) == 0) {
    return ImageFormat::kPng;
  }
  if (bytes.size() >= sizeof(kJpegMagic) &&
      std::memcmp(bytes.data(), kJpegMagic, sizeof(kJpegMagic)) == 0) {
    return ImageFormat::kJpeg;
  }
  return absl::InvalidArgumentError(absl::StrCat("image ", std::string(source), " (", bytes.size(),
                                                 " bytes) is neither PNG nor JPEG (magic bytes)"));
}

absl::StatusOr<RgbImage> DecodeImage(std::string_view bytes, std::string_view source) {
  absl::StatusOr<ImageFormat> format = DetectImageFormat(bytes, source);
  if (!format.ok()) return format.status();
  switch (*format) {
    case ImageFormat::kPng:
      return DecodePng(bytes, source);
    case ImageFormat::kJpeg:
      return DecodeJpeg(bytes, source);
  }
  return absl::InternalError("unreachable image format");
}

absl::StatusOr<RgbImage> ReadImageFile(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFileToString(path, kMaxImageFileBytes);
  if (!bytes.ok()) return bytes.status();
  return DecodeImage(*bytes, path);
}

absl::StatusOr<std::string> EncodePng(const RgbImage& image) {
  if (absl::Status s = CheckDimensions(image.width, image.height, "to encode"); !s.ok()) return s;
  if (image.pixels.size() != static_cast<size_t>(image.width) * image.height * 3) {
    return absl::InvalidArgumentError(absl::StrCat("image to encode has ", image.pixels.size(),
                                                   " bytes; expected ", image.width, "x",
                                                   image.height, "x3"));
  }
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  png.width = static_cast<png_uint_32>(image.width);
  png.height = static_cast<png_uint_32>(image.height);
  png.format = PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&png, nullptr, &size, 0, image.pixels.data(), 0, nullptr)) {
    return absl::InternalError(absl::StrCat("PNG encoder: ", png.message));
  }
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&png, out.data(), &size, 0, image.pixels.data(), 0, nullptr)) {
    return absl::InternalError(absl::StrCat("PNG encoder: ", png.message));
  }
  out.resize(size);
  return out;
}

namespace {

// Returns 0 on success, 1 on an encoder error (message in err->message). Owns no C++ objects.
int EncodeJpegInto(const uint8_t* pixels, int width, int height, int quality, JpegErrorManager* err,
                   unsigned char** out, unsigned long* out_size) {
  jpeg_compress_struct cinfo;
  cinfo.err = jpeg_std_error(&err->pub);
  err->pub.error_exit = JpegErrorExit;
  err->pub.emit_message = JpegEmitMessage;
  err->message[0] = '\0';
  err->corrupt = false;
  if (setjmp(err->jump)) {
    jpeg_destroy_compress(&cinfo);
    return 1;
  }
  jpeg_create_compress(&cinfo);
  jpeg_mem_dest(&cinfo, out, out_size);
  cinfo.image_width = static_cast<JDIMENSION>(width);
  cinfo.image_height = static_cast<JDIMENSION>(height);
  cinfo.input_components = 3;
  cinfo.in_color_space = JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  for (int c = 0; c < cinfo.num_components; ++c) {
    cinfo.comp_info[c].h_samp_factor = 1;
    cinfo.comp_info[c].v_samp_factor = 1;
  }
  jpeg_start_compress(&cinfo, TRUE);
  const size_t stride = static_cast<size_t>(width) * 3;
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(pixels) + stride * cinfo.next_scanline;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  return 0;
}

}  // namespace

absl::StatusOr<std::string> EncodeJpeg(const RgbImage& image, int quality) {
  if (absl::Status s = CheckDimensions(image.width, image.height, "to encode"); !s.ok()) return s;
  if (quality < 1 || quality > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("JPEG quality ", quality, " is out of range; expected 1..100"));
  }
  JpegErrorManager err;
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  const int rc =
      EncodeJpegInto(image.pixels.data(), image.width, image.height, quality, &err, &buffer, &size);
  std::string out;
  if (rc == 0 && buffer != nullptr) out.assign(reinterpret_cast<const char*>(buffer), size);
  std::free(buffer);
  if (rc != 0) return absl::InternalError(absl::StrCat("JPEG encoder: ", err.message));
  return out;
}

RgbImage ResizeImage(const RgbImage& image, int width, int height) {
  if (image.width == width && image.height == height) return image;
  const std::vector<Taps> htaps = ComputeTaps(image.width, width);
  const std::vector<Taps> vtaps = ComputeTaps(image.height, height);
  // Horizontal pass into floats (image.height x width), then vertical pass into bytes.
  std::vector<float> rows(static_cast<size_t>(image.height) * width * 3);
  for (int y = 0; y < image.height; ++y) {
    for (int x = 0; x < width; ++x) {
      const Taps& t = htaps[static_cast<size_t>(x)];
      float acc[3] = {0, 0, 0};
      for (size_t k = 0; k < t.weights.size(); ++k) {
        const uint8_t* p = image.at(y, t.first + static_cast<int>(k));
        for (int c = 0; c < 3; ++c) acc[c] += t.weights[k] * p[c];
      }
      float* dst = &rows[(static_cast<size_t>(y) * width + x) * 3];
      for (int c = 0; c < 3; ++c) dst[c] = acc[c];
    }
  }
  RgbImage out(width, height);
  for (int y = 0; y < height; ++y) {
    const Taps& t = vtaps[static_cast<size_t>(y)];
    for (int x = 0; x < width; ++x) {
      float acc[3] = {0, 0, 0};
      for (size_t k = 0; k < t.weights.size(); ++k) {
        const float* p =
            &rows[(static_cast<size_t>(t.first + static_cast<int>(k)) * width + x) * 3];
        for (int c = 0; c < 3; ++c) acc[c] += t.weights[k] * p[c];
      }
      uint8_t* dst = out.at(y, x);
      for (int c = 0; c < 3; ++c) dst[c] = ClampToByte(acc[c]);
    }
  }
  return out;
}

std::vector<float> ToNormalizedChw(const RgbImage& image, const Normalization& normalization) {
  const size_t plane = static_cast<size_t>(image.width) * image.height;
  std::vector<float> out(plane * 3);
  for (int c = 0; c < 3; ++c) {
    float table[256];
    for (int v = 0; v < 256; ++v) {
      table[v] = (static_cast<float>(v) / 255.0f - normalization.mean[c]) / normalization.stddev[c];
    }
    float* dst = &out[plane * c];
    for (size_t i = 0; i < plane; ++i) dst[i] = table[image.pixels[i * 3 + c]];
  }
  return out;
}

absl::StatusOr<std::vector<float>> LoadImageForEncoder(const std::string& path, int size,
                                                       const Normalization& normalization) {
  absl::StatusOr<RgbImage> image = ReadImageFile(path);
  if (!image.ok()) return image.status();
  return ToNormalizedChw(ResizeImage(*image, size, size), normalization);
}

}  // namespace hetpar::data
