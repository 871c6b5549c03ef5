#ifndef FLCE_SERVER_REGION_PARTS_H_
#define FLCE_SERVER_REGION_PARTS_H_

// flce.v1.RegionPart on the wire without protobuf's copies: WriteRegion's
// parts are parsed in place, their data copied once, straight from gRPC's
// slices to where it goes in the region; ReadRegion's parts are gRPC byte
// buffers whose data slice is the region's memory itself. (A protobuf
// parse would copy the data into the message and again into the region; a
// serialization, into the message and again into gRPC's buffer.)

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace flce {

class RegionPartView {
 public:
  // The fields of a serialized RegionPart; INVALID_ARGUMENT for bytes that
  // are not one. Keeps (references to) the message's slices.
  static absl::StatusOr<RegionPartView> Parse(const grpc::ByteBuffer& message);

  const std::string& region_id() const { return region_id_; }  // "" when absent
  int64_t offset() const { return offset_; }
  int64_t data_bytes() const { return data_bytes_; }
  const std::optional<uint32_t>& crc32() const { return crc32_; }

  // Copies the data to `out` (data_bytes() of room) and returns its CRC-32
  // (zlib's), computed on the way when `with_crc`, else 0.
  uint32_t CopyData(char* out, bool with_crc) const;

 private:
  std::vector<grpc::Slice> slices_;
  std::string region_id_;
  int64_t offset_ = 0;
  std::optional<uint32_t> crc32_;
  // Where the data field's bytes start: slice and offset in it.
  size_t data_slice_ = 0, data_start_ = 0;
  int64_t data_bytes_ = 0;
};

// A serialized RegionPart with `offset`, the `bytes` at `data` and, when
// given, their CRC-32, without copying the data: gRPC sends it from
// `data`, and `owner` lives until it has.
grpc::ByteBuffer RegionPartMessage(int64_t offset, const char* data, int64_t bytes,
                                   std::optional<uint32_t> crc32,
                                   std::shared_ptr<const void> owner);

}  // namespace flce

#endif  // FLCE_SERVER_REGION_PARTS_H_
