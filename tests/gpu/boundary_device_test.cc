// The boundary in device memory (label gpu): an encoder rank's rows on cuda:0 cross to an LLM
// rank's buffer on cuda:0 and the gradients come back, through two UCX transports of this process
// with no copy through the host but the headers', and with no host sync on the calling thread
// (the headers are checked after it reads the results). Needs a GPU and a UCX whose CUDA transport
// loads (the libucx-cu13 wheel, with the GPU driver); skips, saying which is missing, otherwise.
// The same checks run on every machine with the messages as CPU tensors (UseDevice's
// tensor_messages): the packing, header checks and placing of the device path, in host memory.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/config/config.h"
#include "common/nn/ucx_progress_device.h"
#include "common/plan/layout.h"
#include "common/plan/sample.h"
#include "common/plan/step_plan.h"
#include "common/train/boundary.h"
#include "common/transport/factory.h"

#if HETPAR_GPU_HAS_C10_CUDA
#include "tests/gpu/host_sync_counter.h"
#include "tests/gpu/require_cuda_ucx.h"
#endif

namespace hetpar {
namespace {

constexpr char kSpec[] = R"(
run: {name: t, steps: 1, global_batch: 4, micro_batch: 2, dtype: float32, seed: 5}
placement: non_colocated
encoder:
  model: {image_size: 16, patch: 8, hidden: 16, layers: 1, heads: 2, mlp: 32, out_hidden: 32}
  layout: {dp: 1, tp: 1}
llm:
  model: {hidden: 32, layers: 1, heads: 4, kv_heads: 2, ffn: 64, vocab: 256, seq_len: 128}
  layout: {dp: 1, tp: 1}
data: {manifest: unused.jsonl, tokenizer: unused.model}
)";

// Rows whose values name their row and column.
at::Tensor Pattern(int64_t rows, int64_t hidden, double base) {
  return (at::arange(rows, at::kFloat).unsqueeze(1) * 100 +
          at::arange(hidden, at::kFloat).unsqueeze(0) + base)
      .contiguous();
}

// One wave's rows forward and gradients back between two UCX transports of this process, the
// messages packed and received as tensors on `device`. On a GPU, neither side waits for the
// device on this thread (no host sync from the sends and receives); the headers are checked by
// CheckDeviceHeaders after the test reads the results. `sender_generation` other than the plan's
// makes the encoder's headers disagree with what the LLM expects.
void CrossAndCompare(transport::Transport* enc_t, transport::Transport* llm_t,
                     const c10::Device& gpu, int64_t sender_generation = -1) {
  config::LoadOptions load;
  load.check_files = false;
  auto loaded = config::LoadRunSpecFromString(kSpec, "boundary_device_test.yaml", load);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const v1::RunSpec& spec = loaded->spec;
  auto placement = plan::PlacementFromRunSpec(spec);
  ASSERT_TRUE(placement.ok()) << placement.status();
  // Four samples of one or two images of 4 patches each.
  std::vector<plan::SampleDescriptor> samples;
  for (int64_t i = 0; i < 4; ++i) samples.push_back(plan::MakeSample(i, 1 + i % 2, 4, 40, 20));
  auto options = plan::StepPlanOptionsFromRunSpec(spec, 0, 0);
  ASSERT_TRUE(options.ok()) << options.status();
  auto step_plan = plan::BuildStepPlan(*placement, samples, *options);
  ASSERT_TRUE(step_plan.ok()) << step_plan.status();
  auto enc_plan = plan::ExtractRankPlan(*step_plan, 0);
  auto llm_plan = plan::ExtractRankPlan(*step_plan, 1);
  ASSERT_TRUE(enc_plan.ok() && llm_plan.ok());
  if (sender_generation >= 0) enc_plan->generation = sender_generation;

  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  auto to_llm = enc_t->Connect(llm_t->LocalAddress(), deadline);
  auto to_enc = llm_t->Connect(enc_t->LocalAddress(), deadline);
  ASSERT_TRUE(to_llm.ok() && to_enc.ok());
  train::BoundaryCommunicator enc(enc_t, {{1, *to_llm}}, absl::Seconds(30));
  train::BoundaryCommunicator llm(llm_t, {{0, *to_enc}}, absl::Seconds(30));
  enc.UseDevice(gpu, /*tensor_messages=*/true);
  llm.UseDevice(gpu, /*tensor_messages=*/true);
  ASSERT_TRUE(enc.device_direct() && llm.device_direct());

  const plan::EncoderJob* job = nullptr;
  for (const auto& j : enc_plan->encoder_jobs) {
    if (j.rows > 0) {
      job = &j;
      break;
    }
  }
  ASSERT_NE(job, nullptr);
  const int64_t wave = job->wave;
  const int64_t hidden = spec.llm().model().hidden();
  const int64_t buffer_rows = llm_plan->image_rows[wave];
  const at::Tensor job_rows = Pattern(job->rows, hidden, 0.5);
  const at::Tensor grad = Pattern(buffer_rows, hidden, 0.25);
  const at::Tensor device_job_rows = job_rows.to(gpu);
  const at::Tensor device_grad = grad.to(gpu);
  at::Tensor buffer = at::full({buffer_rows, hidden}, -1.0, at::TensorOptions().device(gpu));
  at::Tensor job_grad = at::ones({job->rows, hidden}, at::TensorOptions().device(gpu));

  int syncs = 0;
  std::vector<std::string> where;
  {
#if HETPAR_GPU_HAS_C10_CUDA
    std::optional<testing::HostSyncCounter> counter;
    if (gpu.is_cuda()) counter.emplace();
#endif
    // Forward: the job's rows land at their places in the LLM's buffer; nothing else is written.
    ASSERT_TRUE(llm.PostForwardReceives(*llm_plan, wave, buffer).ok());
    auto sent = enc.SendForward(*enc_plan, wave, device_job_rows);
    ASSERT_TRUE(sent.ok()) << sent.status();
    absl::Status received = llm.ReceiveForward(*llm_plan, wave, buffer);
    ASSERT_TRUE(received.ok()) << received;
    ASSERT_TRUE(sent->Wait(absl::Now() + absl::Seconds(30)).ok());
    // Backward: the LLM's gradient rows are added into the encoder's gradient on the device.
    ASSERT_TRUE(enc.PostBackwardReceives(*enc_plan, wave).ok());
    auto back = llm.SendBackward(*llm_plan, wave, device_grad);
    ASSERT_TRUE(back.ok()) << back.status();
    absl::Status got = enc.ReceiveBackward(*enc_plan, wave, job_grad);
    ASSERT_TRUE(got.ok()) << got;
    ASSERT_TRUE(back->Wait(absl::Now() + absl::Seconds(30)).ok());
#if HETPAR_GPU_HAS_C10_CUDA
    if (counter.has_value()) {
      syncs = counter->syncs();
      where = counter->where();
    }
#endif
  }
  EXPECT_EQ(syncs, 0) << "host syncs on the training thread: " << ::testing::PrintToString(where);
  // The headers are checked once the device has caught up (here: the reads of the results).
  EXPECT_EQ(llm.Stats(plan::Direction::kForward).messages, 0);
  const at::Tensor buffer_on_host = buffer.cpu();
  const at::Tensor job_grad_on_host = job_grad.cpu();
  const absl::Status forward_headers = llm.CheckDeviceHeaders();
  if (sender_generation >= 0) {
    EXPECT_EQ(forward_headers.code(), absl::StatusCode::kFailedPrecondition) << forward_headers;
    EXPECT_THAT(std::string(forward_headers.message()),
                ::testing::HasSubstr(absl::StrCat("generation is ", sender_generation,
                                                  " in the header but 0 in the plan")));
    EXPECT_THAT(std::string(forward_headers.message()), ::testing::HasSubstr("from rank 0"));
    return;
  }
  ASSERT_TRUE(forward_headers.ok()) << forward_headers;
  ASSERT_TRUE(enc.CheckDeviceHeaders().ok());
  EXPECT_EQ(llm.Stats(plan::Direction::kForward).messages, 1);
  EXPECT_EQ(enc.Stats(plan::Direction::kBackward).messages, 1);

  at::Tensor expected = at::full({buffer_rows, hidden}, -1.0);
  for (const plan::Transfer& t : llm_plan->forward_receives) {
    if (t.wave != wave) continue;
    for (const plan::BlockPiece& piece : t.pieces) {
      expected.narrow(0, piece.dst_offset, piece.rows)
          .copy_(job_rows.narrow(0, piece.src_offset, piece.rows));
    }
  }
  EXPECT_TRUE(at::equal(buffer_on_host, expected));
  at::Tensor expected_grad = at::ones({job->rows, hidden});
  for (const plan::Transfer& t : enc_plan->backward_receives) {
    if (t.wave != wave) continue;
    for (const plan::BlockPiece& piece : t.pieces) {
      expected_grad.narrow(0, piece.dst_offset, piece.rows)
          .add_(grad.narrow(0, piece.src_offset, piece.rows));
    }
  }
  EXPECT_TRUE(at::equal(job_grad_on_host, expected_grad));
}

TEST(BoundaryDeviceTest, RowsAndGradientsCrossAsTensorMessagesOnTheCpu) {
  auto enc_t = transport::CreateTransport(transport::Backend::kUcx, "enc");
  auto llm_t = transport::CreateTransport(transport::Backend::kUcx, "llm");
  ASSERT_TRUE(enc_t.ok() && llm_t.ok()) << enc_t.status() << llm_t.status();
  CrossAndCompare(enc_t->get(), llm_t->get(), c10::Device(c10::kCPU));
}

// A message whose header disagrees with the receiver's plan (another generation, same tag) is
// placed, as the device path does before its header is back on the host, and then refused by
// CheckDeviceHeaders, naming the field and the sender.
TEST(BoundaryDeviceTest, AHeaderOfAnotherGenerationFailsTheDeferredCheck) {
  auto enc_t = transport::CreateTransport(transport::Backend::kUcx, "enc");
  auto llm_t = transport::CreateTransport(transport::Backend::kUcx, "llm");
  ASSERT_TRUE(enc_t.ok() && llm_t.ok()) << enc_t.status() << llm_t.status();
  CrossAndCompare(enc_t->get(), llm_t->get(), c10::Device(c10::kCPU), /*sender_generation=*/7);
}

TEST(BoundaryDeviceTest, RowsAndGradientsCrossInDeviceMemory) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device: torch::cuda::is_available() is false";
  }
  auto enc_t = transport::CreateTransport(transport::Backend::kUcx, "enc");
  auto llm_t = transport::CreateTransport(transport::Backend::kUcx, "llm");
  ASSERT_TRUE(enc_t.ok() && llm_t.ok()) << enc_t.status() << llm_t.status();
  if (!(*enc_t)->CanMove(transport::MemoryKind::kCuda)) {
    const char* why = "this UCX moves no CUDA memory (its CUDA transport module did not load)";
    if (hetpar::testing::CudaUcxRequired()) FAIL() << why << " on a machine with a GPU";
    GTEST_SKIP() << why;
  }
  for (transport::Transport* t : {enc_t->get(), llm_t->get()}) {
    auto* ucx = dynamic_cast<transport::ucx::UcxTransport*>(t);
    ASSERT_NE(ucx, nullptr) << "the kUcx backend is not a UcxTransport";
    absl::Status selected = nn::SelectProgressThreadDevice(*ucx, c10::Device(c10::kCUDA, 0),
                                                           absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(selected.ok()) << selected;
  }
  CrossAndCompare(enc_t->get(), llm_t->get(), c10::Device(c10::kCUDA, 0));
}

}  // namespace
}  // namespace hetpar
