// LossServiceImpl's handlers of regions of the server's own memory:
// WriteRegion and ReadRegion (their parts on the wire: server/region_parts.h).

#include <zlib.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/status_macros.h"
#include "server/handler_support.h"
#include "server/loss_service.h"
#include "server/region_parts.h"
#include "server/stream_call.h"

namespace flce {
namespace {

// `principal`'s region of server memory `id`: NOT_FOUND, or
// INVALID_ARGUMENT for another kind of region.
absl::StatusOr<std::shared_ptr<SharedRegion>> ServerRegion(const SharedMemoryRegistry& registry,
                                                           const std::string& id,
                                                           const std::string& principal) {
  absl::StatusOr<std::shared_ptr<SharedRegion>> region = registry.Find(id, principal);
  if (!region.ok()) {
    return absl::NotFoundError(absl::StrCat("region_id: ", region.status().message()));
  }
  if (!(*region)->server_memory()) {
    return absl::InvalidArgumentError(
        "region_id: not a region of server memory (RegisterSharedMemory with server_memory); "
        "a client's own memory is written by the client");
  }
  return region;
}

absl::Status CheckRange(int64_t offset, int64_t bytes, const SharedRegion& region) {
  if (offset < 0 || bytes < 0 || offset > region.bytes() - bytes) {
    return absl::InvalidArgumentError(absl::StrCat("offset: ", bytes, " bytes at offset ", offset,
                                                   " do not lie inside the region's ",
                                                   region.bytes(), " bytes"));
  }
  return absl::OkStatus();
}

// WriteRegion: each part's data is copied once, from gRPC's slices into the
// region, its CRC-32 computed on the way when the part carries one.
class WriteRegionReactor final : public ReadStream {
 public:
  WriteRegionReactor(grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
                     ServiceMetrics* metrics, int64_t max_message_bytes,
                     const SharedMemoryRegistry* regions)
      : ReadStream(context, response, metrics, "WriteRegion", max_message_bytes),
        regions_(regions) {}

 private:
  const google::protobuf::Message& response() override { return response_; }

  absl::Status Consume(grpc::ByteBuffer& in) override {
    FLCE_ASSIGN_OR_RETURN(const RegionPartView part, RegionPartView::Parse(in));
    if (!part.region_id().empty() && part.region_id() != region_id_) {
      FLCE_ASSIGN_OR_RETURN(region_, ServerRegion(*regions_, part.region_id(), principal()));
      region_id_ = part.region_id();
      record().SetDetail(absl::StrCat("region=", LogSafe(region_id_, 8), " "));
    }
    if (region_ == nullptr)
      return absl::InvalidArgumentError("region_id: required on the first part");
    FLCE_RETURN_IF_ERROR(CheckRange(part.offset(), part.data_bytes(), *region_));
    const uint32_t crc =
        part.CopyData(region_->base() + part.offset(), /*with_crc=*/part.crc32().has_value());
    in.Clear();
    if (part.crc32() && crc != *part.crc32()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "crc32: the %d bytes at offset %d have CRC-32 %08x, the part says %08x (the range "
          "holds what arrived; write it again)",
          part.data_bytes(), part.offset(), crc, *part.crc32()));
    }
    written_ += part.data_bytes();
    return absl::OkStatus();
  }

  absl::Status End() override {
    response_.set_bytes(written_);
    record().PrependDetail(absl::StrCat("bytes=", written_, " "));
    return absl::OkStatus();
  }

  const SharedMemoryRegistry* const regions_;
  std::shared_ptr<SharedRegion> region_;
  std::string region_id_;
  int64_t written_ = 0;
  v1::WriteRegionResponse response_;
};

// ReadRegion: parts whose data gRPC sends straight from the region's memory
// (which the parts hold until they are sent).
class ReadRegionReactor final : public WriteStream {
 public:
  ReadRegionReactor(grpc::CallbackServerContext* context, ServiceMetrics* metrics,
                    int64_t max_message_bytes, int64_t default_part_bytes)
      : WriteStream(context, metrics, "ReadRegion", max_message_bytes),
        max_part_bytes_(max_message_bytes - 1024),
        default_part_bytes_(default_part_bytes) {}

  absl::Status Prepare(const SharedMemoryRegistry& regions, const v1::ReadRegionRequest& r,
                       const std::string& principal) {
    record().SetDetail(absl::StrCat("region=", LogSafe(r.region_id(), 8), " "));
    FLCE_ASSIGN_OR_RETURN(region_, ServerRegion(regions, r.region_id(), principal));
    FLCE_RETURN_IF_ERROR(CheckRange(r.offset(), r.length(), *region_));
    if (r.part_bytes() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("part_bytes: ", r.part_bytes(), " < 0"));
    }
    part_bytes_ = r.part_bytes() == 0 ? default_part_bytes_
                                      : std::min<int64_t>(r.part_bytes(), max_part_bytes_);
    position_ = r.offset();
    end_ = r.offset() + r.length();
    with_crc_ = r.crc32();
    record().PrependDetail(absl::StrCat("bytes=", r.length(), " "));
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<bool> NextBytes(grpc::ByteBuffer* out) override {
    if (position_ >= end_) return false;
    const int64_t n = std::min(part_bytes_, end_ - position_);
    const char* data = region_->base() + position_;
    std::optional<uint32_t> crc;
    if (with_crc_) {
      crc = static_cast<uint32_t>(
          crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(data), static_cast<uInt>(n)));
    }
    *out = RegionPartMessage(position_, data, n, crc, region_);
    position_ += n;
    return true;
  }

  const int64_t max_part_bytes_, default_part_bytes_;
  std::shared_ptr<SharedRegion> region_;
  int64_t part_bytes_ = 0, position_ = 0, end_ = 0;
  bool with_crc_ = false;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* LossServiceImpl::WriteRegion(Context* context,
                                                                        Bytes* response) {
  auto* reactor = new WriteRegionReactor(context, response, metrics_, limits_.max_message_bytes,
                                         shared_memory_);
  reactor->Begin(Authenticate(context), admission_);
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LossServiceImpl::ReadRegion(Context* context,
                                                                        const Bytes* in) {
  auto* reactor = new ReadRegionReactor(context, metrics_, limits_.max_message_bytes,
                                        limits_.stream_chunk_bytes());
  v1::ReadRegionRequest request;
  reactor->BeginWriting(Authenticate(context), *in, *admission_, &request,
                        [&](const std::string& principal) {
                          return reactor->Prepare(*shared_memory_, request, principal);
                        });
  return reactor;
}

}  // namespace flce
