#include "kernels/cuda/partial_sums.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/status_macros.h"

namespace flce {
namespace {

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

// A non-blocking stream on `device`, destroyed with this.
class Stream {
 public:
  static absl::StatusOr<Stream> On(int device) {
    Stream s;
    s.device_ = device;
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
    FLCE_RETURN_IF_ERROR(CudaStatus(
        cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    return s;
  }
  Stream() = default;
  Stream(Stream&& o) noexcept : device_(o.device_), stream_(std::exchange(o.stream_, nullptr)) {}
  Stream& operator=(Stream&&) = delete;
  ~Stream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  int device() const { return device_; }
  cudaStream_t get() const { return stream_; }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};

class LocalSum final : public PartialSum {
 public:
  explicit LocalSum(Stream stream) : stream_(std::move(stream)) {}
  absl::Status SumIntoFirst(const std::vector<float*>& parts, int64_t count) override {
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(stream_.device()), "cudaSetDevice"));
    for (size_t k = 1; k < parts.size(); ++k) {
      FLCE_RETURN_IF_ERROR(CudaStatus(
          internal_cuda::LaunchAccumulate(parts[k], DType::kFloat32, parts[0], DType::kFloat32,
                                          count, 1.0f, stream_.get()),
          "add partial sums"));
    }
    return CudaStatus(cudaStreamSynchronize(stream_.get()), "add partial sums");
  }

 private:
  Stream stream_;
};

// NCCL's entry points, loaded once.
struct Nccl {
  decltype(&ncclCommInitAll) comm_init_all = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclReduce) reduce = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;

  absl::Status Check(ncclResult_t result, const char* what) const {
    if (result == ncclSuccess) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(what, ": ", error_string(result)));
  }
};

absl::StatusOr<const Nccl*> LoadNccl() {
  static const absl::StatusOr<Nccl>* nccl = [] {
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      return new absl::StatusOr<Nccl>(absl::UnavailableError(
          absl::StrCat("NCCL is needed for several devices and did not load: ", dlerror())));
    }
    Nccl n;
    bool ok = true;
    auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      ok = ok && fn != nullptr;
    };
    bind(n.comm_init_all, "ncclCommInitAll");
    bind(n.comm_destroy, "ncclCommDestroy");
    bind(n.reduce, "ncclReduce");
    bind(n.group_start, "ncclGroupStart");
    bind(n.group_end, "ncclGroupEnd");
    bind(n.error_string, "ncclGetErrorString");
    if (!ok) {
      return new absl::StatusOr<Nccl>(
          absl::UnavailableError("libnccl.so.2 lacks an entry point flce uses"));
    }
    return new absl::StatusOr<Nccl>(n);
  }();
  if (!nccl->ok()) return nccl->status();
  return &nccl->value();
}

class NcclReduce final : public PartialSum {
 public:
  NcclReduce(const Nccl& nccl, std::vector<ncclComm_t> comms, std::vector<Stream> streams)
      : nccl_(nccl), comms_(std::move(comms)), streams_(std::move(streams)) {}
  ~NcclReduce() override {
    for (ncclComm_t comm : comms_) nccl_.comm_destroy(comm);
  }

  absl::Status SumIntoFirst(const std::vector<float*>& parts, int64_t count) override {
    if (parts.size() != comms_.size()) {
      return absl::InternalError("NCCL sum: one part per device of the communicator");
    }
    FLCE_RETURN_IF_ERROR(nccl_.Check(nccl_.group_start(), "ncclGroupStart"));
    absl::Status queued;
    for (size_t k = 0; k < parts.size() && queued.ok(); ++k) {
      queued = CudaStatus(cudaSetDevice(streams_[k].device()), "cudaSetDevice");
      if (queued.ok()) {
        queued = nccl_.Check(nccl_.reduce(parts[k], parts[0], static_cast<size_t>(count),
                                          ncclFloat32, ncclSum, /*root=*/0, comms_[k],
                                          streams_[k].get()),
                             "ncclReduce");
      }
    }
    FLCE_RETURN_IF_ERROR(nccl_.Check(nccl_.group_end(), "ncclGroupEnd"));
    FLCE_RETURN_IF_ERROR(queued);
    for (const Stream& s : streams_) {
      FLCE_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(s.device()), "cudaSetDevice"));
      FLCE_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(s.get()), "NCCL reduce"));
    }
    return absl::OkStatus();
  }

 private:
  const Nccl& nccl_;
  std::vector<ncclComm_t> comms_;
  std::vector<Stream> streams_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PartialSum>> DeviceLocalSum(int device) {
  FLCE_ASSIGN_OR_RETURN(Stream stream, Stream::On(device));
  return std::unique_ptr<PartialSum>(new LocalSum(std::move(stream)));
}

absl::StatusOr<std::unique_ptr<PartialSum>> NcclSum(const std::vector<int>& devices) {
  // NVLink multicast (NVLS) stays off: it can take a host's shared GPUs out
  // of service.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1);
  FLCE_ASSIGN_OR_RETURN(const Nccl* nccl, LoadNccl());
  std::vector<ncclComm_t> comms(devices.size());
  FLCE_RETURN_IF_ERROR(nccl->Check(
      nccl->comm_init_all(comms.data(), static_cast<int>(devices.size()), devices.data()),
      "ncclCommInitAll"));
  std::vector<Stream> streams;
  for (int d : devices) {
    absl::StatusOr<Stream> s = Stream::On(d);
    if (!s.ok()) {
      for (ncclComm_t comm : comms) nccl->comm_destroy(comm);
      return s.status();
    }
    streams.push_back(*std::move(s));
  }
  return std::unique_ptr<PartialSum>(new NcclReduce(*nccl, std::move(comms), std::move(streams)));
}

}  // namespace flce
