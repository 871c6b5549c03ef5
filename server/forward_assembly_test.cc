#include "server/forward_assembly.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

MATCHER_P(IsOkAndHolds, value, "is OK and holds the value") { return arg.ok() && *arg == value; }

v1::Tensor* Announce(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  return t;
}

// X [3, 2] fp32 (24 bytes) and t [3] int64 (24 bytes) announced; W's bytes
// inline (not streamed).
v1::ForwardRequestChunk First() {
  v1::ForwardRequestChunk m;
  v1::ForwardRequest* r = m.mutable_request();
  Announce(r->mutable_hidden(), v1::DTYPE_FLOAT32, {3, 2});
  Announce(r->mutable_target(), v1::DTYPE_INT64, {3});
  Announce(r->mutable_weight(), v1::DTYPE_FLOAT32, {1, 2})->set_data(std::string(8, 'w'));
  return m;
}

v1::ForwardRequestChunk Piece(v1::TensorField field, const std::string& data) {
  v1::ForwardRequestChunk m;
  m.mutable_chunk()->set_field(field);
  m.mutable_chunk()->set_data(data);
  return m;
}

TEST(ForwardAssemblyTest, PutsTheTensorsBackTogetherInPieces) {
  ForwardAssembly a(1 << 20);
  v1::ForwardRequestChunk m = First();
  EXPECT_THAT(a.Take(&m), IsOkAndHolds(48));  // X and t; W came inline
  for (const auto& [field, data] :
       {std::pair<v1::TensorField, std::string>{v1::TENSOR_FIELD_HIDDEN, std::string(10, 'x')},
        {v1::TENSOR_FIELD_TARGET, std::string(24, 't')},
        {v1::TENSOR_FIELD_HIDDEN, std::string(14, 'y')}}) {
    v1::ForwardRequestChunk piece = Piece(field, data);
    EXPECT_THAT(a.Take(&piece), IsOkAndHolds(0));
  }
  EXPECT_TRUE(a.End().ok());
  EXPECT_EQ(a.request().hidden().data(), std::string(10, 'x') + std::string(14, 'y'));
  EXPECT_EQ(a.request().target().data(), std::string(24, 't'));
  EXPECT_EQ(a.request().weight().data(), std::string(8, 'w'));
}

TEST(ForwardAssemblyTest, EveryMisstepNamesTheField) {
  {
    ForwardAssembly a(1 << 20);
    v1::ForwardRequestChunk piece = Piece(v1::TENSOR_FIELD_HIDDEN, "x");
    EXPECT_THAT(a.Take(&piece), StatusIs(Code::kInvalidArgument,
                                         HasSubstr("request: required on the first message")));
    EXPECT_THAT(a.End(), StatusIs(Code::kInvalidArgument, HasSubstr("carried no message")));
  }
  ForwardAssembly a(1 << 20);
  v1::ForwardRequestChunk m = First();
  ASSERT_TRUE(a.Take(&m).ok());
  v1::ForwardRequestChunk again = First();
  EXPECT_THAT(a.Take(&again),
              StatusIs(Code::kInvalidArgument, HasSubstr("only the first message carries one")));
  v1::ForwardRequestChunk inline_w = Piece(v1::TENSOR_FIELD_WEIGHT, "w");
  EXPECT_THAT(a.Take(&inline_w),
              StatusIs(Code::kInvalidArgument,
                       HasSubstr("TENSOR_FIELD_WEIGHT is not a tensor the request announced")));
  v1::ForwardRequestChunk bias = Piece(v1::TENSOR_FIELD_BIAS, "b");
  EXPECT_THAT(a.Take(&bias), StatusIs(Code::kInvalidArgument, HasSubstr("chunk.field")));
  v1::ForwardRequestChunk too_much = Piece(v1::TENSOR_FIELD_TARGET, std::string(25, 't'));
  EXPECT_THAT(a.Take(&too_much),
              StatusIs(Code::kInvalidArgument, HasSubstr("target: more bytes than its 24")));
  v1::ForwardRequestChunk part = Piece(v1::TENSOR_FIELD_HIDDEN, std::string(20, 'x'));
  ASSERT_TRUE(a.Take(&part).ok());
  EXPECT_THAT(a.End(),
              StatusIs(Code::kInvalidArgument, HasSubstr("hidden: received 20 of 24 bytes")));
}

TEST(ForwardAssemblyTest, TheAnnouncedBytesAreBounded) {
  ForwardAssembly a(47);
  v1::ForwardRequestChunk m = First();
  EXPECT_THAT(a.Take(&m),
              StatusIs(Code::kResourceExhausted, HasSubstr("need 48 bytes, over the limit of 47")));
  ForwardAssembly bad(1 << 20);
  v1::ForwardRequestChunk negative;
  Announce(negative.mutable_request()->mutable_hidden(), v1::DTYPE_FLOAT32, {-1, 2});
  EXPECT_THAT(bad.Take(&negative), StatusIs(Code::kInvalidArgument, HasSubstr("hidden")));
}

}  // namespace
}  // namespace flce
