// FLOP counts of small shapes against counts written out by hand, term by term (not computed
// by the functions under test).
#include "common/plan/flops.h"

#include <gtest/gtest.h>

namespace hetpar::plan {
namespace {

v1::EncoderModel SmallVit() {
  // 16 x 16 images, 8 x 8 patches: P = 4 patches of 3 * 64 = 192 inputs; h 8, MLP 16, out 6.
  v1::EncoderModel m;
  m.set_image_size(16);
  m.set_patch(8);
  m.set_channels(3);
  m.set_hidden(8);
  m.set_layers(2);
  m.set_heads(2);
  m.set_mlp(16);
  m.set_out_hidden(6);
  return m;
}

v1::LlmModel SmallLlm() {
  // h 8, 4 heads of 2, 2 kv heads, SwiGLU 12, vocabulary 10, 3 layers.
  v1::LlmModel m;
  m.set_hidden(8);
  m.set_layers(3);
  m.set_heads(4);
  m.set_kv_heads(2);
  m.set_ffn(12);
  m.set_vocab(10);
  m.set_seq_len(32);
  return m;
}

TEST(FlopsTest, VitImageByHand) {
  // Patch embedding: 2 * 4 patches * 192 * 8 = 12288.
  // One layer: qkv 2*4*8*24 = 1536; scores 2*4*4*8 = 256; weighted values 256;
  //   out proj 2*4*8*8 = 512; fc1 2*4*8*16 = 1024; fc2 1024. Sum 4608; two layers 9216.
  // Projector: 2*4*8*6 = 384; 2*4*6*6 = 288. Sum 672.
  const FlopCount f = EncoderImageFlops(SmallVit());
  EXPECT_DOUBLE_EQ(f.forward, 12288.0 + 9216.0 + 672.0);
  // Backward: the patch embedding once (weight gradient), the rest twice.
  EXPECT_DOUBLE_EQ(f.backward, 12288.0 + 2 * (9216.0 + 672.0));
  EXPECT_DOUBLE_EQ(f.total(), f.forward + f.backward);
}

TEST(FlopsTest, FrozenEncoderBackwardByHand) {
  // Frozen: no backward. With a trainable projector: fc1's weight gradient only (its input, the
  // frozen tower's output, needs none), 384; fc2's input and weight gradients, 2 * 288.
  EXPECT_DOUBLE_EQ(EncoderImageFlops(SmallVit(), EncoderTraining::kNone).backward, 0.0);
  EXPECT_DOUBLE_EQ(EncoderImageFlops(SmallVit(), EncoderTraining::kProjectorOnly).backward,
                   384.0 + 2 * 288.0);
  EXPECT_DOUBLE_EQ(EncoderImageFlops(SmallVit(), EncoderTraining::kNone).forward,
                   12288.0 + 9216.0 + 672.0);
  v1::EncoderSpec encoder;
  EXPECT_EQ(EncoderTrainingOf(encoder), EncoderTraining::kAll);
  encoder.set_frozen(true);
  EXPECT_EQ(EncoderTrainingOf(encoder), EncoderTraining::kNone);
  encoder.set_train_projector(true);
  EXPECT_EQ(EncoderTrainingOf(encoder), EncoderTraining::kProjectorOnly);
}

TEST(FlopsTest, LlmSampleByHand) {
  // s = 5 positions, 2 with a label.
  // One layer: qkv 2*5*8*(8 + 2*2*2) = 1280; scores 2*25*8 = 400; weighted values 400;
  //   out proj 2*5*8*8 = 640; gate, up, down 3 * 2*5*8*12 = 2880. Sum 5600; three layers 16800.
  // Output head: 2 * 2 * 8 * 10 = 320.
  const FlopCount f = LlmSampleFlops(SmallLlm(), 5, 2);
  EXPECT_DOUBLE_EQ(f.forward, 16800.0 + 320.0);
  EXPECT_DOUBLE_EQ(f.backward, 2 * (16800.0 + 320.0));
}

TEST(FlopsTest, AttentionGrowsWithTheSquareOfEachSampleLength) {
  // Two samples of 5 cost less than one of 10: the s^2 terms are per sample.
  // s = 10, per layer: qkv 2560 + scores 1600 + values 1600 + proj 1280 + MLP 5760 = 12800.
  const FlopCount ten = LlmSampleFlops(SmallLlm(), 10, 0);
  EXPECT_DOUBLE_EQ(ten.forward, 3 * 12800.0);
  const FlopCount five = LlmSampleFlops(SmallLlm(), 5, 0);
  EXPECT_DOUBLE_EQ(2 * five.forward, 2 * 3 * 5600.0);
  EXPECT_LT(2 * five.forward, ten.forward);
}

TEST(FlopsTest, BatchAddsEveryImageAndEverySample) {
  v1::RunSpec spec;
  *spec.mutable_encoder()->mutable_model() = SmallVit();
  *spec.mutable_llm()->mutable_model() = SmallLlm();
  // Sample 0: 2 images of 4 tokens + 3 text tokens (11 positions, 1 loss token); sample 1: text
  // only, 5 positions, 2 loss tokens.
  const std::vector<SampleDescriptor> samples = {MakeSample(0, 2, 4, 3, 1),
                                                 MakeSample(1, 0, 4, 5, 2)};
  const StepFlops f = BatchFlops(spec, samples);
  EXPECT_DOUBLE_EQ(f.encoder.forward, 2 * (12288.0 + 9216.0 + 672.0));
  // s = 11 per layer: qkv 2*11*8*16 = 2816; scores 2*121*8 = 1936; values 1936;
  //   proj 2*11*64 = 1408; MLP 3*2*11*96 = 6336. Sum 14432; three layers 43296; head 2*8*10 = 160.
  EXPECT_DOUBLE_EQ(f.llm.forward, (43296.0 + 160.0) + (16800.0 + 320.0));
}

TEST(FlopsTest, AchievedRatePerModuleAndRank) {
  // 6e12 FLOPs in 2 s on 3 ranks: 3 TFLOPS, 1 per rank; against a 4 TFLOPS peak, 25 %.
  const FlopRate r = AchievedRate(6e12, 2.0, 3, 4.0);
  EXPECT_DOUBLE_EQ(r.tflops, 3.0);
  EXPECT_DOUBLE_EQ(r.tflops_per_rank, 1.0);
  EXPECT_DOUBLE_EQ(r.utilization, 0.25);
  EXPECT_EQ(AchievedRate(6e12, 2.0, 3, 0).utilization, -1);
  EXPECT_EQ(AchievedRate(6e12, 0, 3, 4.0).tflops, 0);
}

}  // namespace
}  // namespace hetpar::plan
