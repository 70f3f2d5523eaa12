#include "common/nn/device_copy.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstring>
#include <map>
#include <mutex>

namespace hetpar::nn {

at::Tensor ToDevice(const at::Tensor& host, const c10::Device& device) {
  if (!device.is_cuda() || !host.is_cpu()) return host.to(device);
  // pin_memory() copies pageable memory into a pinned block on the host (no device work); a
  // pinned tensor of an allocator (the caching host allocator's, which keeps the block until the
  // copy is done) is used as it is. A tensor over memory it does not own (from_blob) is staged
  // even where that memory reads as pinned (a range some library registered with the driver):
  // its owner may free it as soon as this returns.
  const bool owned_pinned = host.storage().allocator() != nullptr && host.is_pinned();
  const at::Tensor pinned = owned_pinned ? host : host.pin_memory();
  return pinned.to(device, /*non_blocking=*/true);
}

at::Tensor IndexTensor(const std::vector<int64_t>& values, const c10::Device& device) {
  const int64_t n = static_cast<int64_t>(values.size());
  at::Tensor host =
      at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda()));
  if (n > 0) std::memcpy(host.data_ptr<int64_t>(), values.data(), sizeof(int64_t) * values.size());
  return ToDevice(host, device);
}

at::Tensor EmptyForTransport(int64_t size, const c10::Device& device) {
  const at::TensorOptions options = at::TensorOptions().dtype(at::kByte).device(device);
  if (!device.is_cuda()) return at::empty({size}, options);
  // One stream per device from the global pool, kept for every receive: its pool holds only
  // transport buffers, and no kernel of hetpar's runs on it. A high-priority one: c10d's NCCL
  // groups take their streams from the low-priority pool (the default), so none of them is this
  // stream and allocates from its pool.
  static std::mutex mu;
  static std::map<c10::DeviceIndex, c10::Stream>* const side_streams =
      new std::map<c10::DeviceIndex, c10::Stream>();
  c10::Stream side(c10::Stream::DEFAULT, device);
  {
    const std::lock_guard<std::mutex> lock(mu);
    auto it = side_streams->find(device.index());
    if (it == side_streams->end()) {
      const c10::impl::VirtualGuardImpl guard(device.type());
      it = side_streams
               ->emplace(device.index(),
                         guard.getStreamFromGlobalPool(device, /*isHighPriority=*/true))
               .first;
    }
    side = it->second;
  }
  const c10::StreamGuard on_side(side);
  return at::empty({size}, options);
}

void RecordStreamUse(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.is_cuda()) return;
  const c10::impl::VirtualGuardImpl guard(tensor.device().type());
  tensor.record_stream(guard.getStream(tensor.device()));
}

at::Tensor HostBytesFor(int64_t size, const c10::Device& device) {
  return at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(device.is_cuda()));
}

void MakeDeviceCurrent(const c10::Device& device) {
  if (!device.is_cuda()) return;
  const c10::impl::VirtualGuardImpl guard(device.type());
  guard.setDevice(device);
  // c10 skips cudaSetDevice when the thread's device already has that index, as device 0 has on
  // a new thread, and then no CUDA context is current on the thread yet: the runtime binds one at
  // its first call that needs it, the driver API never does. Recording an event is such a call.
  c10::Event bind(device.type());
  bind.record(guard.getStream(device));
}

StreamMark StreamMark::After(const c10::Device& device) {
  StreamMark mark;
  if (!device.is_cuda()) return mark;
  const c10::impl::VirtualGuardImpl guard(device.type());
  mark.event_ = std::make_shared<c10::Event>(device.type());
  mark.event_->record(guard.getStream(device));
  return mark;
}

bool StreamMark::Reached() const { return event_ == nullptr || event_->query(); }

void StreamMark::Wait() const {
  if (!Reached()) event_->synchronize();
}

}  // namespace hetpar::nn
