#include "server/region_parts.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace flce {
namespace {

// Field numbers and wire types of flce.v1.RegionPart.
constexpr uint32_t kRegionId = 1, kOffset = 2, kData = 3, kCrc32 = 4;
constexpr uint32_t kVarint = 0, kFixed64 = 1, kDelimited = 2, kFixed32 = 5;

// Reads bytes in order across a message's slices.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) { Skip0(); }

  bool done() const { return slice_ == slices_.size(); }
  size_t slice() const { return slice_; }
  size_t position() const { return pos_; }

  bool Byte(uint8_t* b) {
    if (done()) return false;
    *b = slices_[slice_].begin()[pos_];
    Advance(1);
    return true;
  }

  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;  // over ten bytes
  }

  // Copies `n` bytes to `out` (null: skips them).
  bool Take(uint64_t n, char* out) {
    while (n > 0) {
      if (done()) return false;
      const size_t here = std::min<uint64_t>(n, slices_[slice_].size() - pos_);
      if (out != nullptr) {
        std::memcpy(out, slices_[slice_].begin() + pos_, here);
        out += here;
      }
      Advance(here);
      n -= here;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    pos_ += n;
    Skip0();
  }
  // Moves past exhausted (and empty) slices.
  void Skip0() {
    while (slice_ < slices_.size() && pos_ >= slices_[slice_].size()) {
      ++slice_;
      pos_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0, pos_ = 0;
};

absl::Status Malformed(const char* what) {
  return absl::InvalidArgumentError(
      absl::StrCat("request: does not parse as flce.v1.RegionPart (", what, ")"));
}

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

}  // namespace

absl::StatusOr<RegionPartView> RegionPartView::Parse(const grpc::ByteBuffer& message) {
  RegionPartView part;
  if (!message.Dump(&part.slices_).ok()) return Malformed("unreadable");
  SliceReader in(part.slices_);
  bool has_data = false;
  while (!in.done()) {
    uint64_t tag;
    if (!in.Varint(&tag)) return Malformed("a tag");
    const uint32_t field = static_cast<uint32_t>(tag >> 3), type = tag & 7;
    if (field == kRegionId && type == kDelimited) {
      uint64_t n;
      if (!in.Varint(&n) || n > 4096) return Malformed("region_id");
      part.region_id_.resize(n);
      if (!in.Take(n, &part.region_id_[0])) return Malformed("region_id");
    } else if (field == kOffset && type == kVarint) {
      uint64_t v;
      if (!in.Varint(&v)) return Malformed("offset");
      part.offset_ = static_cast<int64_t>(v);
    } else if (field == kData && type == kDelimited) {
      uint64_t n;
      if (!in.Varint(&n) || n > (uint64_t{1} << 40)) return Malformed("data");
      // Where the data starts; copied later, to where it goes. (A repeated
      // field: the last one counts, as protobuf has it.)
      part.data_slice_ = in.slice();
      part.data_start_ = in.position();
      part.data_bytes_ = static_cast<int64_t>(n);
      has_data = true;
      if (!in.Take(n, nullptr)) return Malformed("data");
    } else if (field == kCrc32 && type == kFixed32) {
      uint32_t v = 0;
      for (int i = 0; i < 4; ++i) {
        uint8_t b;
        if (!in.Byte(&b)) return Malformed("crc32");
        v |= static_cast<uint32_t>(b) << (8 * i);
      }
      part.crc32_ = v;
    } else {
      // Unknown fields are skipped, as protobuf does.
      uint64_t n = 0;
      bool ok = true;
      switch (type) {
        case kVarint: ok = in.Varint(&n); break;
        case kFixed64: ok = in.Take(8, nullptr); break;
        case kDelimited: ok = in.Varint(&n) && in.Take(n, nullptr); break;
        case kFixed32: ok = in.Take(4, nullptr); break;
        default: ok = false;
      }
      if (!ok || field == 0) return Malformed("an unknown field");
    }
  }
  if (!has_data) part.data_slice_ = part.slices_.size();
  return part;
}

uint32_t RegionPartView::CopyData(char* out, bool with_crc) const {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  int64_t left = data_bytes_;
  size_t start = data_start_;
  for (size_t i = data_slice_; i < slices_.size() && left > 0; ++i, start = 0) {
    const size_t here = std::min<int64_t>(left, static_cast<int64_t>(slices_[i].size() - start));
    const char* from = reinterpret_cast<const char*>(slices_[i].begin()) + start;
    std::memcpy(out, from, here);
    if (with_crc) crc = ::crc32(crc, reinterpret_cast<const Bytef*>(out), static_cast<uInt>(here));
    out += here;
    left -= static_cast<int64_t>(here);
  }
  return with_crc ? static_cast<uint32_t>(crc) : 0;
}

grpc::ByteBuffer RegionPartMessage(int64_t offset, const char* data, int64_t bytes,
                                   std::optional<uint32_t> crc32,
                                   std::shared_ptr<const void> owner) {
  std::string head;
  AppendVarint(kOffset << 3 | kVarint, &head);
  AppendVarint(static_cast<uint64_t>(offset), &head);
  if (crc32) {
    AppendVarint(kCrc32 << 3 | kFixed32, &head);
    for (int i = 0; i < 4; ++i) head.push_back(static_cast<char>(*crc32 >> (8 * i)));
  }
  AppendVarint(kData << 3 | kDelimited, &head);
  AppendVarint(static_cast<uint64_t>(bytes), &head);
  grpc::Slice slices[2] = {
      grpc::Slice(head),
      grpc::Slice(const_cast<char*>(data), static_cast<size_t>(bytes),
                  [](void* held) { delete static_cast<std::shared_ptr<const void>*>(held); },
                  new std::shared_ptr<const void>(std::move(owner)))};
  return grpc::ByteBuffer(slices, bytes > 0 ? 2 : 1);
}

}  // namespace flce
