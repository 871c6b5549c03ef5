#include "server/metrics.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flce {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(MetricsTest, CountsAndHistogramsInTheTextFormat) {
  ServiceMetrics m;
  m.RecordRpc("Forward", absl::StatusCode::kOk, 0.003);
  m.RecordRpc("Forward", absl::StatusCode::kOk, 0.2);
  m.RecordRpc("Forward", absl::StatusCode::kInvalidArgument, 0.0001);
  m.RecordEngine("Forward", 0.002, 4096);
  m.RecordEngine("Forward", 0.001, 0);  // failed: no tokens
  m.RecordQueueWait(100.0);  // beyond the last bound: only +Inf
  m.AddBytes("Forward", 1000, 20);
  Gauges g;
  g.live_sessions = 3;
  g.serving = false;
  g.sessions_expired = 7;
  g.engine_forward_reruns = 3;
  g.weight_device_memory_bytes = 48;
  const std::string text = PrometheusText(m.Snapshot(g));
  EXPECT_THAT(text, HasSubstr("# TYPE flce_requests_total counter\n"));
  EXPECT_THAT(text, HasSubstr("flce_requests_total{rpc=\"Forward\",code=\"OK\"} 2\n"));
  EXPECT_THAT(text,
              HasSubstr("flce_requests_total{rpc=\"Forward\",code=\"INVALID_ARGUMENT\"} 1\n"));
  // Cumulative buckets: 0.0001 ≤ 0.0005; 0.003 ≤ 0.005; 0.2 ≤ 0.25.
  EXPECT_THAT(text, HasSubstr("flce_request_duration_seconds_bucket{rpc=\"Forward\",le=\"0.0005\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("flce_request_duration_seconds_bucket{rpc=\"Forward\",le=\"0.0025\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("flce_request_duration_seconds_bucket{rpc=\"Forward\",le=\"0.005\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("flce_request_duration_seconds_bucket{rpc=\"Forward\",le=\"0.25\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("flce_request_duration_seconds_bucket{rpc=\"Forward\",le=\"+Inf\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("flce_request_duration_seconds_count{rpc=\"Forward\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("flce_request_duration_seconds_sum{rpc=\"Forward\"} 0.2031\n"));
  EXPECT_THAT(text, HasSubstr("flce_queue_wait_seconds_bucket{le=\"60\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("flce_queue_wait_seconds_bucket{le=\"+Inf\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("flce_queue_wait_seconds_count 1\n"));
  EXPECT_THAT(text, HasSubstr("flce_engine_duration_seconds_count{rpc=\"Forward\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("flce_tokens_total{rpc=\"Forward\"} 4096\n"));
  EXPECT_THAT(text, HasSubstr("flce_received_bytes_total{rpc=\"Forward\"} 1000\n"));
  EXPECT_THAT(text, HasSubstr("flce_sent_bytes_total{rpc=\"Forward\"} 20\n"));
  EXPECT_THAT(text, HasSubstr("flce_live_sessions 3\n"));
  EXPECT_THAT(text, HasSubstr("flce_serving 0\n"));
  EXPECT_THAT(text, HasSubstr("flce_sessions_expired_total 7\n"));
  EXPECT_THAT(text, HasSubstr("flce_engine_forward_reruns_total 3\n"));
  EXPECT_THAT(text, HasSubstr("flce_weight_device_memory_bytes 48\n"));
  // Every family is announced once, before its samples.
  EXPECT_THAT(text, HasSubstr("# HELP flce_serving "));
  EXPECT_THAT(text, Not(HasSubstr("nan")));
}

TEST(MetricsTest, LabelValuesAreEscaped) {
  EXPECT_EQ(EscapeLabelValue("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  ServiceMetrics m;
  m.RecordRpc("we\"ird", absl::StatusCode::kOk, 0.001);
  EXPECT_THAT(PrometheusText(m.Snapshot(Gauges())),
              HasSubstr("flce_requests_total{rpc=\"we\\\"ird\",code=\"OK\"} 1\n"));
}

}  // namespace
}  // namespace flce
