// LossServiceImpl's handlers of registered weights: PutWeight,
// TakeWeightGrad, DeleteWeight, ListWeights.

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/status_macros.h"
#include "kernels/tensor.h"
#include "proto/codec.h"
#include "proto/crc32c.h"
#include "server/handler_support.h"
#include "server/loss_service.h"
#include "server/stream_call.h"

namespace flce {

// --- Registered weights ----------------------------------------------------

namespace {

void FillWeightInfo(const RegisteredWeight& w, v1::WeightInfo* info) {
  info->set_name(w.name());
  info->set_version(w.version());
  info->set_dtype(ToProto(w.weight().dtype));
  info->mutable_shape()->Assign(w.weight().shape.begin(), w.weight().shape.end());
  info->set_has_bias(w.bias().has_value());
  info->set_bytes(w.bytes());
  info->set_accumulated_backwards(w.accumulated_backwards());
}

// PutWeight: the header chunk names and sizes the weight and takes its bytes
// from the weight budget; the data is stored as it arrives, and the end of
// the stream checks the length and CRC-32C before the weight is registered.
// Nothing is registered from a broken stream.
// A slice of a registered region in host memory holding `bytes` (a
// weight's source, a gradient's destination), kept mapped by `resolver`.
absl::StatusOr<char*> HostSlice(SliceResolver& resolver, const v1::SharedMemorySlice& slice,
                                int64_t bytes, const std::string& field) {
  FLCE_ASSIGN_OR_RETURN(SliceMemory memory, resolver.Resolve(ToSliceRef(slice), bytes, field));
  if (memory.space != MemorySpace::kHost) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": a region in host memory (server memory or POSIX), not CUDA IPC"));
  }
  return static_cast<char*>(memory.data);
}

class PutWeightReactor final : public ReadStream {
 public:
  PutWeightReactor(grpc::CallbackServerContext* context, WeightRegistry* weights,
                   const SharedMemoryRegistry* regions, grpc::ByteBuffer* response,
                   ServiceMetrics* metrics, int64_t max_message_bytes)
      : ReadStream(context, response, metrics, "PutWeight", max_message_bytes),
        weights_(weights),
        regions_(regions) {}

 private:
  google::protobuf::Message* message() override { return &chunk_; }
  const google::protobuf::Message& response() override { return response_; }

  absl::Status Take() override {
    if (!started_) {
      if (!chunk_.has_header()) {
        return absl::InvalidArgumentError("header: required on the first chunk");
      }
      FLCE_RETURN_IF_ERROR(Start(chunk_.header()));
    } else if (chunk_.has_header()) {
      return absl::InvalidArgumentError("header: only the first chunk carries one");
    }
    const std::string& data = chunk_.data();
    if (from_source_ && !data.empty()) {
      return absl::InvalidArgumentError(
          "data: the header names a source (header.source); no data follows it");
    }
    if (static_cast<int64_t>(payload_.size() + data.size()) > total_) {
      return absl::InvalidArgumentError(absl::StrCat("data: more bytes than the header's ", total_,
                                                     " (", payload_.size() + data.size(),
                                                     " so far)"));
    }
    // Reserved (not touched) with the first bytes, so it never reallocates.
    if (!data.empty() && payload_.capacity() < static_cast<size_t>(total_)) Reserve();
    payload_.append(data);
    crc_ = ieee_crc_
               ? static_cast<uint32_t>(crc32(crc_, reinterpret_cast<const Bytef*>(data.data()),
                                             static_cast<uInt>(data.size())))
               : Crc32c(crc_, data.data(), data.size());
    return absl::OkStatus();
  }

  absl::Status Start(const v1::WeightHeader& h) {
    started_ = true;
    name_ = h.name();
    if (!WeightRegistry::ValidName(name_)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.name: '", LogSafe(name_, 128), "' must be 1-128 characters of [A-Za-z0-9_.-]"));
    }
    record().SetDetail(absl::StrCat("weight=", name_, " "));
    ieee_crc_ = h.has_crc32();
    expected_crc_ = ieee_crc_ ? h.crc32() : h.crc32c();
    FLCE_ASSIGN_OR_RETURN(dtype_, FromProto(h.dtype(), "header.dtype"));
    if (!IsFloating(dtype_)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.dtype: ", DTypeName(dtype_), " not supported; expected bf16, fp16 or fp32"));
    }
    shape_.assign(h.shape().begin(), h.shape().end());
    if (shape_.size() != 2 || shape_[0] < 1 || shape_[1] < 1 ||
        shape_[0] > (int64_t{1} << 40) / shape_[1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.shape: expected [V, H] with V, H >= 1, got ", ShapeString(shape_)));
    }
    has_bias_ = h.has_bias();
    const int64_t elem = DTypeSize(dtype_);
    total_ = (shape_[0] * shape_[1] + (has_bias_ ? shape_[0] : 0)) * elem;
    // The memory of a version gone, where there is one: no fresh pages.
    SpareWeights::HostMemory spare = weights_->TakeSpare(name_, principal(), total_);
    payload_locked_ = std::move(spare.locked);
    payload_ = std::move(spare.storage);
    FLCE_ASSIGN_OR_RETURN(hold_, weights_->Reserve(name_, total_));
    if (h.has_source()) FLCE_RETURN_IF_ERROR(TakeSource(h));
    return absl::OkStatus();
  }

  // The whole payload from a region at once (its CRC checked only when the
  // header gives zlib's: the parts that filled a region of server memory
  // were checked as they came).
  absl::Status TakeSource(const v1::WeightHeader& h) {
    from_source_ = true;
    std::shared_ptr<SliceResolver> resolver = regions_->ResolverFor(principal());
    FLCE_ASSIGN_OR_RETURN(const char* source,
                          HostSlice(*resolver, h.source(), total_, "header.source"));
    Reserve();
    payload_.assign(source, static_cast<size_t>(total_));
    FLCE_RETURN_IF_ERROR(resolver->CheckIntact());
    if (ieee_crc_) {
      crc_ = static_cast<uint32_t>(crc32(crc32(0L, Z_NULL, 0),
                                         reinterpret_cast<const Bytef*>(payload_.data()),
                                         static_cast<uInt>(payload_.size())));
    } else {
      crc_ = expected_crc_ = 0;  // nothing to check
    }
    return absl::OkStatus();
  }

  // The payload's memory, in huge pages where the kernel gives them (a
  // gigabyte weight faults in 512 times fewer pages).
  void Reserve() {
    // (Memory that moves is unlocked first; a spare's never moves.)
    if (payload_.capacity() < static_cast<size_t>(total_)) payload_locked_.reset();
    payload_.reserve(static_cast<size_t>(total_));
    AdviseHugePages(&payload_[0], static_cast<size_t>(total_));
  }

  absl::Status End() override {
    if (!started_) return absl::InvalidArgumentError("header: the stream carried no chunk");
    if (static_cast<int64_t>(payload_.size()) != total_) {
      return absl::InvalidArgumentError(
          absl::StrCat("data: received ", payload_.size(), " of the header's ", total_, " bytes"));
    }
    if (crc_ != expected_crc_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "header.%s: the bytes received have %s %08x, the header says %08x",
          ieee_crc_ ? "crc32" : "crc32c", ieee_crc_ ? "CRC-32" : "CRC-32C", crc_, expected_crc_));
    }
    // W's bytes first, then b's.
    const size_t w_bytes = static_cast<size_t>(shape_[0] * shape_[1] * DTypeSize(dtype_));
    std::optional<HostTensor> bias;
    if (has_bias_) {
      bias.emplace();
      bias->dtype = dtype_;
      bias->shape = {shape_[0]};
      bias->data = payload_.substr(w_bytes);
    }
    HostTensor weight;
    weight.dtype = dtype_;
    weight.shape = shape_;
    payload_.resize(w_bytes);
    weight.data = std::move(payload_);
    FLCE_ASSIGN_OR_RETURN(std::shared_ptr<RegisteredWeight> registered,
                          weights_->Put(name_, principal(), std::move(weight), std::move(bias),
                                        std::move(hold_), std::move(payload_locked_)));
    FillWeightInfo(*registered, response_.mutable_weight());
    record().SetDetail(
        absl::StrCat("weight=", name_, " version=", registered->version(), " bytes=", total_, " "));
    return absl::OkStatus();
  }

  WeightRegistry* const weights_;
  const SharedMemoryRegistry* const regions_;
  bool from_source_ = false;
  v1::PutWeightChunk chunk_;
  v1::PutWeightResponse response_;
  bool started_ = false;
  std::string name_;
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_;
  bool has_bias_ = false;
  BudgetHold hold_;
  std::string payload_;
  // payload_'s page lock (a spare's), unlocked before payload_ is freed.
  std::shared_ptr<DeviceBlock> payload_locked_;
  int64_t total_ = 0;
  uint32_t crc_ = 0, expected_crc_ = 0;
  bool ieee_crc_ = false;  // header.crc32 (zlib's) instead of crc32c
};

// TakeWeightGrad: takes the accumulated gradient, narrows it to the asked
// dtype, and streams it in chunks; unless the whole stream reached the
// client, the gradient goes back into the accumulator.
class TakeGradReactor final : public WriteStream {
 public:
  TakeGradReactor(grpc::CallbackServerContext* context, ServiceMetrics* metrics,
                  int64_t max_message_bytes, int64_t chunk_bytes)
      : WriteStream(context, metrics, "TakeWeightGrad", max_message_bytes),
        chunk_bytes_(chunk_bytes) {}

  absl::Status Prepare(const WeightRegistry& weights, const SharedMemoryRegistry& regions,
                       const v1::TakeWeightGradRequest& r, const std::string& principal) {
    record().SetDetail(absl::StrCat("weight=", LogSafe(r.weight().name()), " "));
    FLCE_ASSIGN_OR_RETURN(weight_, weights.Get(r.weight().name(), r.weight().version(), principal));
    DType dtype = DType::kFloat32;
    if (r.dtype() != v1::DTYPE_UNSPECIFIED) {
      FLCE_ASSIGN_OR_RETURN(dtype, FromProto(r.dtype(), "dtype"));
    }
    // Refused before anything is taken.
    FLCE_RETURN_IF_ERROR(weight_->CheckGradDType(dtype, "dtype"));
    FLCE_ASSIGN_OR_RETURN(RegisteredWeight::Grad grad,
                          weight_->TakeGrad(/*pending=*/true, r.resume_take()));
    grad_ = std::move(grad);
    // Put back unless delivered; kept for a resume if asked.
    WhenOver([this, hold = r.hold_until_acknowledged()](bool delivered) {
      if (!delivered) {
        weight_->RestoreGrad(*std::move(grad_));
      } else {
        weight_->ConfirmTake(*std::move(grad_), hold);
      }
    });
    if (r.has_into()) {
      // Narrowed straight into the caller's region; the stream carries the
      // header alone.
      std::shared_ptr<SliceResolver> resolver = regions.ResolverFor(principal);
      FLCE_ASSIGN_OR_RETURN(
          char* into,
          HostSlice(*resolver, r.into(), RegisteredWeight::GradSize(*grad_, dtype), "into"));
      FLCE_RETURN_IF_ERROR(weight_->GradBytesInto(*grad_, dtype, "dtype", into));
      FLCE_RETURN_IF_ERROR(resolver->CheckIntact());
    } else {
      FLCE_ASSIGN_OR_RETURN(payload_, weight_->GradBytes(*grad_, dtype, "dtype"));
    }
    v1::WeightGradHeader* header = chunk_.mutable_header();
    FillWeightInfo(*weight_, header->mutable_weight());
    header->set_dtype(ToProto(dtype));
    header->set_accumulated_backwards(grad_->backwards);
    if (r.hold_until_acknowledged()) header->set_take_id(grad_->take_id);
    record().SetDetail(absl::StrCat("weight=", weight_->name(), " version=", weight_->version(),
                                    " backwards=", grad_->backwards, " "));
    return absl::OkStatus();
  }

 private:
  const google::protobuf::Message* Next() override {
    if (sent_header_ && offset_ >= payload_.size()) return nullptr;
    if (sent_header_) chunk_.clear_header();
    const size_t n = std::min(payload_.size() - offset_, static_cast<size_t>(chunk_bytes_));
    chunk_.set_data(payload_.data() + offset_, n);
    offset_ += n;
    sent_header_ = true;
    return &chunk_;
  }

  const int64_t chunk_bytes_;
  std::shared_ptr<RegisteredWeight> weight_;
  std::optional<RegisteredWeight::Grad> grad_;
  std::string payload_;
  size_t offset_ = 0;
  bool sent_header_ = false;
  v1::WeightGradChunk chunk_;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* LossServiceImpl::PutWeight(Context* context,
                                                                      Bytes* response) {
  auto* reactor = new PutWeightReactor(context, &core_->weights(), shared_memory_, response,
                                       metrics_, limits_.max_message_bytes);
  reactor->Begin(Admit(context), admission_);
  return reactor;
}

LossServiceImpl::Unary* LossServiceImpl::DeleteWeight(Context* context, const Bytes* in,
                                                      Bytes* out) {
  auto* call =
      NewUnary<v1::DeleteWeightRequest, v1::DeleteWeightResponse>(context, in, out, "DeleteWeight");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/false)) {
    call->record().SetDetail(absl::StrCat("weight=", LogSafe(call->request().name()), " "));
    call->response()->set_deleted(core_->weights().Delete(call->request().name(), *principal));
    call->Reply(absl::OkStatus());
  }
  return call;
}

LossServiceImpl::Unary* LossServiceImpl::ListWeights(Context* context, const Bytes* in,
                                                     Bytes* out) {
  auto* call =
      NewUnary<v1::ListWeightsRequest, v1::ListWeightsResponse>(context, in, out, "ListWeights");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/false)) {
    for (const auto& weight : core_->weights().List(*principal)) {
      FillWeightInfo(*weight, call->response()->add_weights());
    }
    call->Reply(absl::OkStatus());
  }
  return call;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LossServiceImpl::TakeWeightGrad(Context* context,
                                                                            const Bytes* in) {
  auto* reactor = new TakeGradReactor(context, metrics_, limits_.max_message_bytes,
                                      limits_.stream_chunk_bytes());
  v1::TakeWeightGradRequest request;
  reactor->BeginWriting(
      Authenticate(context), *in, *admission_, &request, [&](const std::string& principal) {
        return reactor->Prepare(core_->weights(), *shared_memory_, request, principal);
      });
  return reactor;
}

}  // namespace flce
