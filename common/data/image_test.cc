#include "common/data/image.h"

#include <png.h>
#include <sys/resource.h>
#include <jpeglib.h>
#include <stdlib.h>
#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "common/data/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

RgbImage Pattern(int w, int h) {
  RgbImage image(w, h);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      uint8_t* p = image.at(y, x);
      p[0] = static_cast<uint8_t>((x * 37 + y * 11) & 0xff);
      p[1] = static_cast<uint8_t>((x * 5 + y * 91 + 13) & 0xff);
      p[2] = static_cast<uint8_t>((x ^ y) * 3 & 0xff);
    }
  }
  return image;
}

void ExpectSamePixels(const RgbImage& a, const RgbImage& b, int tolerance) {
  ASSERT_EQ(a.width, b.width);
  ASSERT_EQ(a.height, b.height);
  ASSERT_EQ(a.pixels.size(), b.pixels.size());
  for (size_t i = 0; i < a.pixels.size(); ++i) {
    ASSERT_LE(std::abs(int{a.pixels[i]} - int{b.pixels[i]}), tolerance)
        << "mismatch at byte " << i << " (pixel " << i / 3 << ", channel " << i % 3 << ")";
  }
}

TEST(ImageTest, PngRoundTripIsExact) {
  const RgbImage image = Pattern(37, 23);
  absl::StatusOr<std::string> png = EncodePng(image);
  ASSERT_TRUE(png.ok()) << png.status();
  EXPECT_EQ(*DetectImageFormat(*png, "mem"), ImageFormat::kPng);
  absl::StatusOr<RgbImage> decoded = DecodeImage(*png, "mem");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSamePixels(image, *decoded, 0);
}

TEST(ImageTest, JpegRoundTripIsClose) {
  // Smooth content: JPEG at quality 100 with 4:4:4 chroma stays within a few levels.
  RgbImage image(32, 24);
  for (int y = 0; y < 24; ++y) {
    for (int x = 0; x < 32; ++x) {
      uint8_t* p = image.at(y, x);
      p[0] = static_cast<uint8_t>(60 + 4 * x);
      p[1] = static_cast<uint8_t>(40 + 6 * y);
      p[2] = 128;
    }
  }
  absl::StatusOr<std::string> jpeg = EncodeJpeg(image, 100);
  ASSERT_TRUE(jpeg.ok()) << jpeg.status();
  EXPECT_EQ(*DetectImageFormat(*jpeg, "mem"), ImageFormat::kJpeg);
  absl::StatusOr<RgbImage> decoded = DecodeImage(*jpeg, "mem");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSamePixels(image, *decoded, 4);
}

// Alpha is dropped and each pixel keeps its colour, as PIL's convert("RGB") (LLaVA's loader)
// does: black line art on a transparent white background stays visible.
TEST(ImageTest, RgbaPngKeepsTheColourOfTransparentPixels) {
  // Two pixels: opaque orange and fully transparent white.
  const uint8_t rgba[] = {250, 120, 10, 255, 255, 255, 255, 0};
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  png.width = 2;
  png.height = 1;
  png.format = PNG_FORMAT_RGBA;
  png_alloc_size_t size = 0;
  ASSERT_TRUE(png_image_write_to_memory(&png, nullptr, &size, 0, rgba, 0, nullptr));
  std::string bytes(size, '\0');
  ASSERT_TRUE(png_image_write_to_memory(&png, bytes.data(), &size, 0, rgba, 0, nullptr));
  bytes.resize(size);
  absl::StatusOr<RgbImage> decoded = DecodeImage(bytes, "rgba");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ASSERT_EQ(decoded->width, 2);
  EXPECT_EQ(decoded->pixels, (std::vector<uint8_t>{250, 120, 10, 255, 255, 255}));
}

// 16-bit samples are sRGB values scaled to 8 bits (PIL, torchvision): 0x8080 is 128, not the
// 186 of a linear-to-sRGB conversion.
TEST(ImageTest, SixteenBitPngIsScaledNotGammaCorrected) {
  // A 2x1 RGB PNG of bit depth 16 with no colour-space chunk (as numpy or OpenCV write one):
  // IHDR (2, 1, depth 16, colour type 2), one IDAT holding the zlib stream of filter byte 0 and
  // the big-endian samples 0x8080 0x8080 0x8080 (grey) and 0xffff 0x0000 0x4000, IEND.
  const uint8_t file[] = {
      0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44,
      0x52, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x01, 0x10, 0x02, 0x00, 0x00, 0x00, 0x2b,
      0xd0, 0x34, 0x9e, 0x00, 0x00, 0x00, 0x11, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0x68,
      0x00, 0x83, 0xff, 0xff, 0x19, 0x18, 0x1c, 0x18, 0x00, 0x28, 0x02, 0x05, 0x3f, 0xa3, 0xdf,
      0x3a, 0x88, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82};
  const std::string bytes(reinterpret_cast<const char*>(file), sizeof(file));
  absl::StatusOr<RgbImage> decoded = DecodeImage(bytes, "sixteen");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->pixels, (std::vector<uint8_t>{128, 128, 128, 255, 0, 64}));
}

// The PNG `png` with a gAMA chunk of `gamma` (in units of 1/100000) after its IHDR, and without
// the sRGB chunk libpng's writer adds (an sRGB chunk overrides gAMA).
std::string WithGammaChunk(const std::string& png, uint32_t gamma) {
  const auto u32 = [](const std::string& b, size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(b[at + i]);
    return v;
  };
  const auto put32 = [](std::string* out, uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out->push_back(static_cast<char>(v >> shift));
  };
  std::string out = png.substr(0, 8);
  for (size_t at = 8; at + 12 <= png.size();) {
    const size_t end = at + 12 + u32(png, at);
    const std::string type = png.substr(at + 4, 4);
    if (type != "sRGB") out.append(png, at, end - at);
    if (type == "IHDR") {
      std::string chunk = "gAMA";
      put32(&chunk, gamma);
      put32(&out, 4);
      out += chunk;
      put32(&out, static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(chunk.data()),
                                              static_cast<uInt>(chunk.size()))));
    }
    at = end;
  }
  return out;
}

// PIL (the Hugging Face image processors' reader) ignores gAMA and returns the stored samples; so
// does hetpar, for the common 1/2.2 and for the linear 1.0 or 0.5 some tools write.
TEST(ImageTest, APngGammaChunkDoesNotChangeItsSamples) {
  const RgbImage image = Pattern(19, 7);
  const std::string png = *EncodePng(image);
  for (uint32_t gamma : {45455u, 100000u, 50000u, 220000u}) {
    SCOPED_TRACE(gamma);
    const std::string marked = WithGammaChunk(png, gamma);
    absl::StatusOr<RgbImage> decoded = DecodeImage(marked, "gamma");
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ExpectSamePixels(image, *decoded, 0);
  }
}

TEST(ImageTest, GreyPngExpandsToRgb) {
  const uint8_t grey[] = {0, 77, 255};
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  png.width = 3;
  png.height = 1;
  png.format = PNG_FORMAT_GRAY;
  png_alloc_size_t size = 0;
  ASSERT_TRUE(png_image_write_to_memory(&png, nullptr, &size, 0, grey, 0, nullptr));
  std::string bytes(size, '\0');
  ASSERT_TRUE(png_image_write_to_memory(&png, bytes.data(), &size, 0, grey, 0, nullptr));
  bytes.resize(size);
  absl::StatusOr<RgbImage> decoded = DecodeImage(bytes, "grey");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->pixels, (std::vector<uint8_t>{0, 0, 0, 77, 77, 77, 255, 255, 255}));
}

TEST(ImageTest, CorruptPngIsDataLossNamingTheSource) {
  std::string png = *EncodePng(Pattern(16, 16));
  // Flip a byte inside the IDAT payload: the CRC (or the zlib stream) no longer checks out.
  const size_t idat = png.find("IDAT");
  ASSERT_NE(idat, std::string::npos);
  png[idat + 10] = static_cast<char>(png[idat + 10] ^ 0x5a);
  absl::StatusOr<RgbImage> decoded = DecodeImage(png, "images/bad.png");
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << decoded.status();
  EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("corrupt PNG images/bad.png"));
}

TEST(ImageTest, TruncatedFilesAreDataLoss) {
  const std::string png = *EncodePng(Pattern(16, 16));
  absl::StatusOr<RgbImage> p = DecodeImage(png.substr(0, png.size() / 2), "half.png");
  EXPECT_EQ(p.status().code(), absl::StatusCode::kDataLoss) << p.status();
  const std::string jpeg = *EncodeJpeg(Pattern(64, 64), 90);
  absl::StatusOr<RgbImage> j = DecodeImage(jpeg.substr(0, jpeg.size() / 2), "half.jpg");
  EXPECT_EQ(j.status().code(), absl::StatusCode::kDataLoss) << j.status();
  EXPECT_THAT(std::string(j.status().message()), HasSubstr("corrupt JPEG half.jpg"));
}

// A JPEG with stray bytes before its end marker (libjpeg warns "N extraneous bytes before marker
// 0xd9") decodes in full, as Pillow takes it; one cut short or with its entropy-coded data
// damaged is still refused.
TEST(ImageTest, AJpegWithHarmlessWarningsDecodesAndOneWithLostDataDoesNot) {
  const RgbImage pattern = Pattern(64, 64);
  const std::string jpeg = *EncodeJpeg(pattern, 90);
  ASSERT_EQ(jpeg.substr(jpeg.size() - 2), "\xff\xd9");
  std::string stray = jpeg;
  stray.insert(stray.size() - 2, "\x01\x02\x03");
  absl::StatusOr<RgbImage> clean = DecodeImage(jpeg, "clean.jpg");
  ASSERT_TRUE(clean.ok()) << clean.status();
  absl::StatusOr<RgbImage> decoded = DecodeImage(stray, "stray.jpg");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->pixels, clean->pixels);
  // The entropy-coded data cut before its end, the end marker kept: lost data.
  std::string cut = jpeg.substr(0, jpeg.size() * 3 / 4) + "\xff\xd9";
  absl::StatusOr<RgbImage> lost = DecodeImage(cut, "cut.jpg");
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kDataLoss) << lost.status();
  EXPECT_THAT(std::string(lost.status().message()), HasSubstr("corrupt JPEG cut.jpg"));
}

TEST(ImageTest, OversizedImagesAreRejectedBeforeDecoding) {
  std::string png = *EncodePng(Pattern(4, 4));
  // IHDR starts at byte 8: length (4), "IHDR", width (4), height (4), ..., CRC over type+data.
  auto put32 = [&](size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) png[at + i] = static_cast<char>((v >> (24 - 8 * i)) & 0xff);
  };
  put32(16, 20000);
  put32(20, 20000);
  put32(29, static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(png.data() + 12), 17)));
  absl::StatusOr<RgbImage> decoded = DecodeImage(png, "huge.png");
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument) << decoded.status();
  EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("huge.png is 20000x20000"));
}

// In a child: limits the address space to 1 GiB and decodes `bytes` as huge.jpg; 0 when it is
// refused as InvalidArgument with `expected` in the message.
int DecodeWithOneGiB(const std::string& bytes, const std::string& expected) {
  rlimit limit;
  limit.rlim_cur = limit.rlim_max = rlim_t{1} << 30;
  if (::setrlimit(RLIMIT_AS, &limit) != 0) return 3;
  absl::StatusOr<RgbImage> decoded = DecodeImage(bytes, "huge.jpg");
  if (decoded.status().code() == absl::StatusCode::kInvalidArgument &&
      absl::StrContains(decoded.status().message(), expected)) {
    return 0;
  }
  std::fprintf(stderr, "%s\n", decoded.status().ToString().c_str());
  return 1;
}

// `image` as a progressive JPEG (jpeg_simple_progression: 10 scans).
std::string ProgressiveJpeg(const RgbImage& image) {
  std::string jpeg;
  {
    jpeg_compress_struct cinfo;
    jpeg_error_mgr err;
    cinfo.err = jpeg_std_error(&err);
    jpeg_create_compress(&cinfo);
    unsigned char* out = nullptr;
    unsigned long out_size = 0;
    jpeg_mem_dest(&cinfo, &out, &out_size);
    cinfo.image_width = 64;
    cinfo.image_height = 64;
    cinfo.input_components = 3;
    cinfo.in_color_space = JCS_RGB;
    jpeg_set_defaults(&cinfo);
    jpeg_simple_progression(&cinfo);
    jpeg_start_compress(&cinfo, TRUE);
    while (cinfo.next_scanline < cinfo.image_height) {
      JSAMPROW row = const_cast<uint8_t*>(image.pixels.data()) + cinfo.next_scanline * 64 * 3;
      jpeg_write_scanlines(&cinfo, &row, 1);
    }
    jpeg_finish_compress(&cinfo);
    jpeg_destroy_compress(&cinfo);
    jpeg.assign(reinterpret_cast<char*>(out), out_size);
    std::free(out);
  }
  return jpeg;
}

// A progressive JPEG of a few hundred bytes declaring 40000 x 40000 pixels: refused from its
// header, before libjpeg allocates whole-image coefficient buffers (about 9 GB here). The check
// runs in a child with 1 GiB of address space, where an allocation that size fails.
TEST(ImageTest, AnOversizedProgressiveJpegIsRefusedBeforeItsBuffersAreAllocated) {
  std::string jpeg = ProgressiveJpeg(Pattern(64, 64));
  // SOF2: FF C2, length (2), precision (1), height (2), width (2).
  const size_t sof = jpeg.find("\xff\xc2");
  ASSERT_NE(sof, std::string::npos) << "not progressive";
  for (size_t at : {sof + 5, sof + 7}) {
    jpeg[at] = static_cast<char>(40000 >> 8);
    jpeg[at + 1] = static_cast<char>(40000 & 0xff);
  }
  EXPECT_EXIT(std::_Exit(DecodeWithOneGiB(jpeg, "huge.jpg: 40000x40000")),
              ::testing::ExitedWithCode(0), "");
}

// A progressive JPEG whose last scan comes 600 times: each scan is a pass over the whole image,
// so such a file of a few kilobytes could keep a decoder busy for minutes; refused past 500.
TEST(ImageTest, AJpegOfTooManyScansIsRefused) {
  const std::string jpeg = ProgressiveJpeg(Pattern(64, 64));
  const size_t last_scan = jpeg.rfind("\xff\xda");
  const size_t end = jpeg.rfind("\xff\xd9");
  ASSERT_NE(last_scan, std::string::npos);
  ASSERT_NE(end, std::string::npos);
  ASSERT_LT(last_scan, end);
  std::string many = jpeg.substr(0, end);
  for (int i = 0; i < 600; ++i) many += jpeg.substr(last_scan, end - last_scan);
  many += jpeg.substr(end);
  const absl::StatusOr<RgbImage> decoded = DecodeImage(many, "scans.jpg");
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << decoded.status();
  EXPECT_THAT(std::string(decoded.status().message()),
              HasSubstr("scans.jpg: more than 500 progressive scans"));
  // The file itself, with its 10 scans, decodes.
  EXPECT_TRUE(DecodeImage(jpeg, "ten.jpg").ok());
}

TEST(ImageTest, UnknownFormatIsInvalidArgument) {
  absl::StatusOr<RgbImage> decoded = DecodeImage("GIF89a....", "x.gif");
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("x.gif"));
  EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("neither PNG nor JPEG"));
}

TEST(ImageTest, ResizeIdentityAndTriangleFilterDownscale) {
  const RgbImage image = Pattern(8, 6);
  ExpectSamePixels(image, ResizeImage(image, 8, 6), 0);
  // Halving: each output pixel is the triangle-filter average of its 4x4 source neighbourhood.
  const RgbImage half = ResizeImage(image, 4, 3);
  ASSERT_EQ(half.width, 4);
  ASSERT_EQ(half.height, 3);
  for (int y = 0; y < 3; ++y) {
    for (int x = 0; x < 4; ++x) {
      for (int c = 0; c < 3; ++c) {
        // The triangle filter at scale 2 weights the 4 covered source pixels of each axis as
        // 1/8, 3/8, 3/8, 1/8 (clipped at the borders): compute the expectation the same way.
        double acc = 0, wsum = 0;
        for (int sy = 2 * y - 1; sy <= 2 * y + 2; ++sy) {
          for (int sx = 2 * x - 1; sx <= 2 * x + 2; ++sx) {
            if (sy < 0 || sy >= 6 || sx < 0 || sx >= 8) continue;
            const double wy = 1 - std::abs((sy + 0.5 - (y + 0.5) * 2) / 2);
            const double wx = 1 - std::abs((sx + 0.5 - (x + 0.5) * 2) / 2);
            acc += wy * wx * image.at(sy, sx)[c];
            wsum += wy * wx;
          }
        }
        EXPECT_NEAR(half.at(y, x)[c], acc / wsum, 1.0) << y << "," << x << "," << c;
      }
    }
  }
}

TEST(ImageTest, ResizeKeepsConstantImagesConstant) {
  RgbImage flat(5, 7);
  for (size_t i = 0; i < flat.pixels.size(); i += 3) {
    flat.pixels[i] = 10;
    flat.pixels[i + 1] = 200;
    flat.pixels[i + 2] = 99;
  }
  for (auto [w, h] : {std::pair{32, 32}, std::pair{3, 2}, std::pair{11, 4}}) {
    const RgbImage out = ResizeImage(flat, w, h);
    ASSERT_EQ(out.pixels.size(), static_cast<size_t>(w * h * 3));
    for (size_t i = 0; i < out.pixels.size(); i += 3) {
      ASSERT_EQ(out.pixels[i], 10);
      ASSERT_EQ(out.pixels[i + 1], 200);
      ASSERT_EQ(out.pixels[i + 2], 99);
    }
  }
}

TEST(ImageTest, NormalizedChwHasEveryElementInPlace) {
  const RgbImage image = Pattern(5, 4);
  Normalization norm;
  norm.mean = {0.1f, 0.2f, 0.3f};
  norm.stddev = {0.5f, 0.25f, 2.0f};
  const std::vector<float> chw = ToNormalizedChw(image, norm);
  ASSERT_EQ(chw.size(), 3u * 5 * 4);
  for (int c = 0; c < 3; ++c) {
    for (int y = 0; y < 4; ++y) {
      for (int x = 0; x < 5; ++x) {
        const float expected =
            (static_cast<float>(image.at(y, x)[c]) / 255.0f - norm.mean[c]) / norm.stddev[c];
        ASSERT_EQ(chw[static_cast<size_t>(c * 20 + y * 5 + x)], expected) << c << y << x;
      }
    }
  }
}

TEST(ImageTest, LoadImageForEncoderReadsResizesAndNormalises) {
  std::string dir = (fs::temp_directory_path() / "hetpar_image_XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const RgbImage image = Pattern(64, 64);
  ASSERT_TRUE(WriteFileAtomically(dir + "/a.png", *EncodePng(image)).ok());
  absl::StatusOr<std::vector<float>> loaded =
      LoadImageForEncoder(dir + "/a.png", 32, Normalization());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, ToNormalizedChw(ResizeImage(image, 32, 32), Normalization()));
  absl::StatusOr<std::vector<float>> missing =
      LoadImageForEncoder(dir + "/missing.png", 32, Normalization());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("missing.png"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace hetpar::data
