#include "server/region_parts.h"

#include <zlib.h>

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "proto/flce/v1/loss_service.pb.h"

namespace flce {
namespace {

uint32_t Crc(const std::string& s) {
  return static_cast<uint32_t>(
      crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(s.data()), s.size()));
}

// A serialized message cut into slices of `piece` bytes (as gRPC may hand
// it over).
grpc::ByteBuffer Sliced(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += piece) {
    slices.emplace_back(bytes.data() + at, std::min(piece, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Random(size_t n, int seed) {
  std::mt19937 gen(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(gen());
  return s;
}

TEST(RegionPartsTest, AProtobufPartParsesInPlaceWhateverItsSlices) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{127}, size_t{128}, size_t{70001}}) {
    for (size_t piece : {size_t{1}, size_t{3}, size_t{4096}, size_t{1} << 20}) {
      v1::RegionPart part;
      part.set_region_id("0123456789abcdef0123456789abcdef");
      part.set_offset(int64_t{1} << 33);
      part.set_data(Random(n, static_cast<int>(n)));
      part.set_crc32(Crc(part.data()));
      absl::StatusOr<RegionPartView> view = RegionPartView::Parse(Sliced(part.SerializeAsString(),
                                                                         piece));
      ASSERT_TRUE(view.ok()) << view.status();
      EXPECT_EQ(view->region_id(), part.region_id());
      EXPECT_EQ(view->offset(), part.offset());
      ASSERT_EQ(view->data_bytes(), static_cast<int64_t>(n));
      ASSERT_TRUE(view->crc32().has_value());
      std::string out(n, '\xee');
      EXPECT_EQ(view->CopyData(&out[0], true), *view->crc32());
      EXPECT_EQ(out, part.data()) << n << " bytes in slices of " << piece;
    }
  }
}

TEST(RegionPartsTest, FieldsInAnyOrderAndUnknownOnesAreRead) {
  v1::RegionPart part;
  part.set_data("payload");
  std::string bytes = part.SerializeAsString();
  v1::RegionPart tail;
  tail.set_offset(42);
  bytes += tail.SerializeAsString();  // offset after data: a merge
  bytes += std::string("\x78\x05", 2);  // field 15, a varint nobody knows
  absl::StatusOr<RegionPartView> view = RegionPartView::Parse(Sliced(bytes, 2));
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->offset(), 42);
  EXPECT_TRUE(view->region_id().empty());
  EXPECT_FALSE(view->crc32().has_value());
  std::string out(7, '\0');
  view->CopyData(&out[0], false);
  EXPECT_EQ(out, "payload");
}

TEST(RegionPartsTest, BytesThatAreNotAPartAreInvalidArgument) {
  for (const std::string& bad : {std::string("\x1a\x10short", 7), std::string("\x0a\xff", 2),
                                 std::string("\x07", 1), std::string("\x12\x80\x80", 3)}) {
    absl::StatusOr<RegionPartView> view = RegionPartView::Parse(Sliced(bad, 1));
    EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(view.status().message().find("flce.v1.RegionPart"), absl::string_view::npos);
  }
}

TEST(RegionPartsTest, AnOutgoingPartIsARegionPartAroundTheRegionsOwnBytes) {
  const std::string data = Random(9000, 7);
  auto owner = std::make_shared<int>(0);
  std::weak_ptr<int> watch = owner;
  grpc::ByteBuffer message =
      RegionPartMessage(123456789, data.data(), static_cast<int64_t>(data.size()), Crc(data),
                        std::move(owner));
  grpc::Slice whole;
  ASSERT_TRUE(message.DumpToSingleSlice(&whole).ok());
  v1::RegionPart part;
  ASSERT_TRUE(part.ParseFromArray(whole.begin(), static_cast<int>(whole.size())));
  EXPECT_EQ(part.offset(), 123456789);
  EXPECT_EQ(part.data(), data);
  EXPECT_EQ(part.crc32(), Crc(data));
  EXPECT_FALSE(watch.expired());  // the message still sends from the region
  message.Clear();
  EXPECT_TRUE(watch.expired());
}

}  // namespace
}  // namespace flce
