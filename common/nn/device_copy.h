// Copies between the host and a rank's device that do not make the host wait for the device.
//
// A plain `host.to(cuda)` from pageable memory synchronises the stream before it returns (CUDA
// stages pageable memory, and ATen's blocking copy waits), so every index or token tensor built
// on the host and moved that way is a host sync. These helpers copy through pinned memory with a
// non-blocking copy instead: the host goes on queueing work, and ATen's caching host allocator
// keeps the pinned block until the copy that reads it is done. On a CPU device they return what
// a plain copy would, without pinning (pinned memory needs a CUDA runtime).
#ifndef HETPAR_COMMON_NN_DEVICE_COPY_H_
#define HETPAR_COMMON_NN_DEVICE_COPY_H_

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace hetpar::nn {

// `host` (a CPU tensor) on `device`. On CUDA the copy is queued on the device's current stream
// and the call returns without waiting for it. A pageable `host` is first copied into pinned
// memory, so it may be changed or freed at once, and so is a tensor over memory it does not own
// (at::from_blob), pinned or not; a pinned `host` of ATen's pinned allocator is read by the copy
// itself: it may be freed at once (the caching host allocator keeps it until the copy is done)
// but not written until the stream has passed the copy.
at::Tensor ToDevice(const at::Tensor& host, const c10::Device& device);

// `values` as an int64 tensor on `device`, as ToDevice copies it.
at::Tensor IndexTensor(const std::vector<int64_t>& values, const c10::Device& device);

// `size` bytes on `device` for a transport to write into outside the current stream's order (a
// received message). On CUDA they come from a side stream's pool: the caching allocator hands a
// block freed on the current stream straight to the next tensor of that stream, even while
// kernels queued before still use it, which is safe for kernels on that stream and not for a
// transport writing whenever the data arrives. Once the current stream's work that reads the
// tensor is queued, RecordStreamUse(tensor) keeps the block from the side stream's next tensors
// until that work is done. On the CPU a plain tensor.
at::Tensor EmptyForTransport(int64_t size, const c10::Device& device);

// Marks `tensor` (a CUDA tensor from EmptyForTransport) as used by its device's current stream:
// once freed, its block is reused only after the work queued on that stream by then (the caching
// allocator's record_stream), so a call before the reading copies are queued covers them too.
// Nothing on the CPU.
void RecordStreamUse(const at::Tensor& tensor);

// A host tensor of `size` bytes that a non-blocking device-to-host copy may write into: pinned
// when `device` is a GPU (a pageable destination would make the copy blocking), else plain.
at::Tensor HostBytesFor(int64_t size, const c10::Device& device);

// Makes `device` this thread's current device and, on CUDA, its primary context current on this
// thread, for threads that use the device through the CUDA driver API (UCX's progress thread) or
// query its events (StreamOrderedSender). Nothing on the CPU. Throws c10::Error as libtorch does.
void MakeDeviceCurrent(const c10::Device& device);

// A point in a device's current stream: the work queued there before it was taken. Lets a
// thread other than the one that queued the work learn when it is done (StreamOrderedSender)
// and lets the queuing thread check it without waiting. On a CPU device the work is done when
// it returns, so a mark there is always reached. Copyable (copies share the CUDA event).
class StreamMark {
 public:
  static StreamMark After(const c10::Device& device);
  // True once the device has done the marked work. Never waits.
  bool Reached() const;
  // Blocks this thread until Reached() (a host sync; nothing when already reached).
  void Wait() const;

 private:
  std::shared_ptr<c10::Event> event_;  // null on a CPU device
};

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_DEVICE_COPY_H_
