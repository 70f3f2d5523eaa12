#include "common/transport/factory.h"

#include "absl/strings/str_cat.h"
#include "common/transport/inproc/inproc_transport.h"
#include "common/transport/nccl/nccl_transport.h"
#include "common/transport/ucx/ucx_transport.h"

namespace hetpar::transport {

std::string_view BackendName(Backend backend) {
  switch (backend) {
    case Backend::kInproc:
      return "inproc";
    case Backend::kUcx:
      return "ucx";
    case Backend::kNccl:
      return "nccl";
  }
  return "unknown";
}

absl::StatusOr<Backend> ParseBackend(std::string_view name) {
  if (name == "ucx") return Backend::kUcx;
  if (name == "inproc") return Backend::kInproc;
  if (name == "nccl") return Backend::kNccl;
  return absl::InvalidArgumentError(
      absl::StrCat("transport backend '", std::string(name),
                   "' is not known; expected 'ucx', 'inproc' or 'nccl'"));
}

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(Backend backend,
                                                           const std::string& name) {
  switch (backend) {
    case Backend::kInproc: {
      inproc::InprocTransport::Options options;
      options.name = name;
      auto transport = inproc::InprocTransport::Create(options);
      if (!transport.ok()) return transport.status();
      return std::unique_ptr<Transport>(std::move(transport).value());
    }
    case Backend::kUcx: {
      ucx::UcxTransport::Options options;
      options.name = name;
      auto transport = ucx::UcxTransport::Create(options);
      if (!transport.ok()) return transport.status();
      return std::unique_ptr<Transport>(std::move(transport).value());
    }
    case Backend::kNccl: {
      ucx::UcxTransport::Options options;
      options.name = name;
      auto ucx = ucx::UcxTransport::Create(options);
      if (!ucx.ok()) return ucx.status();
      auto transport =
          nccl::NcclTransport::Wrap(std::move(ucx).value(), nccl::NcclTransport::Options());
      if (!transport.ok()) return transport.status();
      return std::unique_ptr<Transport>(std::move(transport).value());
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("transport backend ", static_cast<int>(backend), " is not known"));
}

}  // namespace hetpar::transport
