#include "client/bulk_transfer.h"

#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "proto/codec.h"

namespace flce {
namespace {

uint32_t Crc(const char* data, size_t n) {
  return static_cast<uint32_t>(
      crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(data), static_cast<uInt>(n)));
}

// The first error of several, or OK.
absl::Status First(const std::vector<absl::Status>& statuses) {
  for (const absl::Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

BulkTransfer::BulkTransfer(std::vector<std::shared_ptr<grpc::Channel>> connections,
                           v1::LossService::Stub* control, absl::Duration timeout,
                           std::string token, int64_t part_bytes)
    : channels_(std::move(connections)),
      control_(control),
      timeout_(timeout),
      token_(std::move(token)),
      part_bytes_(part_bytes) {
  for (const auto& channel : channels_) stubs_.push_back(v1::LossService::NewStub(channel));
}

BulkTransfer::~BulkTransfer() {
  absl::MutexLock lock(&mu_);
  UnregisterLocked();
}

void BulkTransfer::UnregisterLocked() {
  if (region_.empty()) return;
  grpc::ClientContext context;
  Prepare(context);
  v1::UnregisterSharedMemoryRequest request;
  request.set_region_id(region_);
  v1::UnregisterSharedMemoryResponse response;
  (void)control_->UnregisterSharedMemory(&context, request, &response);  // the server's to keep
  region_.clear();
  region_bytes_ = 0;
}

void BulkTransfer::Prepare(grpc::ClientContext& context) const {
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout_));
  if (!token_.empty()) context.AddMetadata("authorization", "Bearer " + token_);
}

absl::StatusOr<std::string> BulkTransfer::Region(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (!region_.empty() && region_bytes_ >= bytes) return region_;
  UnregisterLocked();  // too small: a larger one
  grpc::ClientContext context;
  Prepare(context);
  v1::RegisterSharedMemoryRequest request;
  request.set_server_memory(true);
  request.set_bytes(std::max<int64_t>(bytes, int64_t{1} << 20));
  v1::RegisterSharedMemoryResponse response;
  FLCE_RETURN_IF_ERROR(
      FromGrpcStatus(control_->RegisterSharedMemory(&context, request, &response)));
  region_ = response.region_id();
  region_bytes_ = response.bytes();
  return region_;
}

std::pair<int64_t, int64_t> BulkTransfer::Range(int i, int64_t bytes) const {
  const int64_t parts = std::max<int64_t>(1, (bytes + part_bytes_ - 1) / part_bytes_);
  const int64_t per = (parts + connections() - 1) / connections();
  const int64_t begin = std::min(bytes, i * per * part_bytes_);
  return {begin, std::min(bytes, (i + 1) * per * part_bytes_)};
}

absl::Status BulkTransfer::ForEachRange(
    int64_t bytes, const std::function<absl::Status(int, int64_t, int64_t)>& f) {
  std::vector<absl::Status> statuses(stubs_.size());
  std::vector<std::thread> threads;
  for (int i = 0; i < connections(); ++i) {
    const auto [begin, end] = Range(i, bytes);
    if (begin >= end) continue;
    threads.emplace_back([&, i, begin = begin, end = end] { statuses[i] = f(i, begin, end); });
  }
  for (std::thread& t : threads) t.join();
  return First(statuses);
}

absl::Status BulkTransfer::Write(const std::string& region, int64_t offset, const char* data,
                                 int64_t bytes) {
  return ForEachRange(bytes, [&](int i, int64_t begin, int64_t end) {
    grpc::ClientContext context;
    Prepare(context);
    v1::WriteRegionResponse response;
    auto writer = stubs_[i]->WriteRegion(&context, &response);
    v1::RegionPart part;
    part.set_region_id(region);
    for (int64_t at = begin; at < end; at += part_bytes_) {
      const int64_t n = std::min(part_bytes_, end - at);
      part.set_offset(offset + at);
      part.set_data(data + at, static_cast<size_t>(n));
      part.set_crc32(Crc(data + at, static_cast<size_t>(n)));
      if (!writer->Write(part)) break;
      part.clear_region_id();
    }
    writer->WritesDone();
    return FromGrpcStatus(writer->Finish());
  });
}

absl::Status BulkTransfer::Read(const std::string& region, int64_t offset, char* out,
                                int64_t bytes) {
  return ForEachRange(bytes, [&](int i, int64_t begin, int64_t end) {
    grpc::ClientContext context;
    Prepare(context);
    v1::ReadRegionRequest request;
    request.set_region_id(region);
    request.set_offset(offset + begin);
    request.set_length(end - begin);
    request.set_part_bytes(part_bytes_);
    request.set_crc32(true);
    auto reader = stubs_[i]->ReadRegion(&context, request);
    v1::RegionPart part;
    int64_t got = 0;
    absl::Status status;
    while (reader->Read(&part)) {
      const int64_t at = part.offset() - offset;
      const int64_t n = static_cast<int64_t>(part.data().size());
      if (!status.ok()) continue;
      if (at < begin || at + n > end) {
        status = absl::InternalError(
            absl::StrCat("ReadRegion: a part at offset ", part.offset(), " outside the range"));
      } else if (part.has_crc32() && part.crc32() != Crc(part.data().data(), part.data().size())) {
        status = absl::DataLossError(absl::StrCat("ReadRegion: the part at offset ", part.offset(),
                                                  " does not match its CRC-32"));
      } else {
        std::memcpy(out + at, part.data().data(), static_cast<size_t>(n));
        got += n;
      }
    }
    absl::Status finished = FromGrpcStatus(reader->Finish());
    if (status.ok()) status = finished;
    if (status.ok() && got != end - begin) {
      status = absl::DataLossError(
          absl::StrCat("ReadRegion: ", got, " of ", end - begin, " bytes arrived"));
    }
    return status;
  });
}

}  // namespace flce
