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
                           std::string token, int64_t part_bytes, BulkHttpEndpoint http)
    : channels_(std::move(connections)),
      control_(control),
      timeout_(timeout),
      token_(std::move(token)),
      part_bytes_(part_bytes),
      http_where_(std::move(http)) {
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
  ticket_ = response.bulk_ticket();
  if (response.bulk_port() == 0 || http_where_.host.empty()) {
    http_.reset();
  } else if (http_ == nullptr || http_->endpoint().port != response.bulk_port()) {
    BulkHttpEndpoint where = http_where_;
    where.port = response.bulk_port();
    http_ = std::make_shared<BulkHttpClient>(std::move(where), timeout_);
  }
  return region_;
}

std::pair<int64_t, int64_t> BulkTransfer::Range(int i, int64_t bytes, int64_t unit) const {
  const int64_t units = std::max<int64_t>(1, (bytes + unit - 1) / unit);
  const int64_t per = (units + connections() - 1) / connections();
  const int64_t begin = std::min(bytes, i * per * unit);
  return {begin, std::min(bytes, (i + 1) * per * unit)};
}

absl::Status BulkTransfer::ForEachRange(
    int64_t bytes, int64_t unit, const std::function<absl::Status(int, int64_t, int64_t)>& f) {
  std::vector<absl::Status> statuses(stubs_.size());
  std::vector<std::thread> threads;
  for (int i = 0; i < connections(); ++i) {
    const auto [begin, end] = Range(i, bytes, unit);
    if (begin >= end) continue;
    threads.emplace_back([&, i, begin = begin, end = end] { statuses[i] = f(i, begin, end); });
  }
  for (std::thread& t : threads) t.join();
  return First(statuses);
}

bool BulkTransfer::over_http() const {
  absl::MutexLock lock(&mu_);
  return http_ != nullptr && !ticket_.empty() && absl::Now() >= http_off_until_;
}

absl::StatusOr<bool> BulkTransfer::OverHttp(
    const std::string& region, int64_t bytes,
    const std::function<absl::Status(BulkHttpClient&, const std::string&, int64_t, int64_t)>&
        f) {
  std::string ticket;
  std::shared_ptr<BulkHttpClient> http;
  bool pinned = false;
  {
    absl::MutexLock lock(&mu_);
    if (http_ == nullptr || region != region_ || ticket_.empty() ||
        absl::Now() < http_off_until_) {
      return false;
    }
    ticket = ticket_;
    http = http_;
    pinned = pinned_region_ == region;
  }
  if (bytes == 0) return true;
  if (!pinned) {
    // Which of the host's addresses holds the region (a name may resolve
    // to several servers).
    if (!http->Pin(region, ticket).ok()) {
      absl::MutexLock lock(&mu_);
      http_off_until_ = absl::Now() + absl::Minutes(1);  // over gRPC for now
      return false;
    }
    absl::MutexLock lock(&mu_);
    pinned_region_ = region;
  }
  // Ranges of at least 1 MiB, 4 KiB-aligned.
  const int64_t unit = 4096;
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(connections(), bytes >> 20));
  const int64_t per = ((bytes + ranges - 1) / ranges + unit - 1) / unit * unit;
  absl::Status status = ForEachRange(bytes, per, [&](int, int64_t begin, int64_t end) {
    return f(*http, ticket, begin, end);
  });
  if (BulkHttpClient::IsUnreachable(status)) {
    absl::MutexLock lock(&mu_);
    http_off_until_ = absl::Now() + absl::Minutes(1);
    return false;
  }
  FLCE_RETURN_IF_ERROR(status);
  return true;
}

absl::Status BulkTransfer::Write(const std::string& region, int64_t offset, const char* data,
                                 int64_t bytes) {
  FLCE_ASSIGN_OR_RETURN(
      const bool done,
      OverHttp(region, bytes,
               [&](BulkHttpClient& http, const std::string& ticket, int64_t begin, int64_t end) {
                 return http.Put(region, ticket, offset + begin, data + begin, end - begin);
               }));
  if (done) return absl::OkStatus();
  return ForEachRange(bytes, part_bytes_, [&](int i, int64_t begin, int64_t end) {
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
  FLCE_ASSIGN_OR_RETURN(
      const bool done,
      OverHttp(region, bytes,
               [&](BulkHttpClient& http, const std::string& ticket, int64_t begin, int64_t end) {
                 return http.Get(region, ticket, offset + begin, out + begin, end - begin);
               }));
  if (done) return absl::OkStatus();
  return ForEachRange(bytes, part_bytes_, [&](int i, int64_t begin, int64_t end) {
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
