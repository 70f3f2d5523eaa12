// Sends of memory that the device is still writing, posted once it is written, without the
// training thread waiting for the device.
//
// The boundary packs a message with device copies (queued on the current stream, not done when
// the call returns) and the pipeline link copies rows to pinned host memory the same way; the
// transport reads the memory outside the stream's order, so the send may only be posted once
// the copies are done. Waiting for them on the training thread would stall it until the device
// has caught up with everything queued before, once per message. Instead the caller marks the
// stream (nn::StreamMark) and hands the message here: Post returns an Operation at once, and a
// poster thread posts the send when the mark is reached. The Operation then reports that send.
//
//   StreamOrderedSender sender(&transport);
//   const nn::StreamMark packed = nn::StreamMark::After(device);
//   std::unique_ptr<transport::Operation> op =
//       sender.Post(peer, tag, buffer, message_tensor, [packed] { return packed.Reached(); });
//   ...
//   op->Wait(deadline);  // waits for the post, then for the send
//
// Threading: Post and the Operations are thread-safe. Sends are posted in the order Post was
// called (a later send waits for an earlier one's mark). The poster polls a pending mark with a
// backoff from 10 µs to 200 µs, and sleeps while nothing is pending.
//
// Lifetime: the transport must outlive the sender. Destroying an Operation before its send is
// posted withdraws it (it is never posted); after, it is cancelled as the transport's
// Operations are. Destroying the sender withdraws every send not posted yet (their Operations
// complete with kCancelled) and joins the poster.
#ifndef HETPAR_COMMON_TRAIN_STREAM_ORDERED_SENDER_H_
#define HETPAR_COMMON_TRAIN_STREAM_ORDERED_SENDER_H_

#include <ATen/ATen.h>

#include <deque>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/transport/transport.h"

namespace hetpar::train {

class StreamOrderedSender {
 public:
  // `device`: where the marks are recorded. On CUDA the poster thread makes it its current device
  // before anything else (a new thread's current device is 0, and querying an event or freeing
  // a tensor there would create a context on GPU 0 for this process).
  explicit StreamOrderedSender(transport::Transport* transport,
                               c10::Device device = c10::Device(c10::kCPU));
  ~StreamOrderedSender();
  StreamOrderedSender(const StreamOrderedSender&) = delete;
  StreamOrderedSender& operator=(const StreamOrderedSender&) = delete;

  // Posts `buffer` to `peer` with `tag` once `ready()` returns true (polled on the poster
  // thread; it must not block). `owner` keeps the buffer's memory alive until the send is done
  // and the Operation destroyed. A send the transport refuses completes with the refusal; one
  // whose `ready()` throws (a CUDA event query after a device fault) is never posted and
  // completes with the error.
  std::unique_ptr<transport::Operation> Post(transport::PeerId peer, transport::Tag tag,
                                             transport::ConstBuffer buffer, at::Tensor owner,
                                             std::function<bool()> ready);

  // Sends handed over and not posted yet (tests, progress output).
  size_t pending() const;

  struct Send;  // one handed-over send, shared by its Operation and the poster

 private:
  void Run();

  transport::Transport* const transport_;
  const c10::Device device_;
  mutable absl::Mutex mu_;
  std::deque<std::shared_ptr<Send>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread poster_;
};

}  // namespace hetpar::train

#endif  // HETPAR_COMMON_TRAIN_STREAM_ORDERED_SENDER_H_
