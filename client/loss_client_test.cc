#include "client/loss_client.h"

#include "gtest/gtest.h"

namespace flce {
namespace {

TEST(WithDefaultPortTest, AHostAloneMeans50051) {
  EXPECT_EQ(WithDefaultPort("localhost"), "localhost:50051");
  EXPECT_EQ(WithDefaultPort("10.0.0.7"), "10.0.0.7:50051");
  EXPECT_EQ(WithDefaultPort("[::1]"), "[::1]:50051");
  EXPECT_EQ(WithDefaultPort("::1"), "[::1]:50051");
  EXPECT_EQ(WithDefaultPort("dns:///flce.ml.svc"), "dns:///flce.ml.svc:50051");
}

TEST(WithDefaultPortTest, PortsAndOtherSchemesAreKept) {
  EXPECT_EQ(WithDefaultPort("localhost:7"), "localhost:7");
  EXPECT_EQ(WithDefaultPort("[::1]:7"), "[::1]:7");
  EXPECT_EQ(WithDefaultPort("dns:///flce.ml.svc:7"), "dns:///flce.ml.svc:7");
  EXPECT_EQ(WithDefaultPort("unix:/run/flce.sock"), "unix:/run/flce.sock");
  EXPECT_EQ(WithDefaultPort("dns://8.8.8.8/flce.ml.svc:7"), "dns://8.8.8.8/flce.ml.svc:7");
  EXPECT_EQ(WithDefaultPort(""), "");
}

}  // namespace
}  // namespace flce
