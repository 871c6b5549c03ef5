#include "client/stats_summary.h"

#include <cmath>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flce {
namespace {

using ::testing::HasSubstr;

v1::Histogram MakeHistogram(std::vector<double> bounds, std::vector<int64_t> counts) {
  v1::Histogram h;
  double sum = 0;
  int64_t n = 0;
  for (double b : bounds) h.add_upper_bounds(b);
  for (size_t i = 0; i < counts.size(); ++i) {
    h.add_counts(counts[i]);
    n += counts[i];
    sum += counts[i] * (i < bounds.size() ? bounds[i] : bounds.back());
  }
  h.set_sum(sum);
  h.set_count(n);
  return h;
}

TEST(HistogramQuantileTest, InterpolatesWithinTheBucket) {
  // 10 in (0, 0.01], 10 in (0.01, 0.02], none above.
  const v1::Histogram h = MakeHistogram({0.01, 0.02}, {10, 10, 0});
  EXPECT_DOUBLE_EQ(HistogramQuantile(h, 0.5), 0.01);
  EXPECT_DOUBLE_EQ(HistogramQuantile(h, 0.25), 0.005);
  EXPECT_DOUBLE_EQ(HistogramQuantile(h, 0.75), 0.015);
  // In the +Inf bucket: the last finite bound.
  EXPECT_DOUBLE_EQ(HistogramQuantile(MakeHistogram({0.01}, {0, 3}), 0.5), 0.01);
  EXPECT_TRUE(std::isnan(HistogramQuantile(MakeHistogram({0.01}, {0, 0}), 0.5)));
}

TEST(HumanBytesTest, Units) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(512), "512 B");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(double{int64_t{16} << 30}), "16.0 GiB");
}

TEST(StatsSummaryTest, ShowsRequestsErrorsLatencyTokensAndMemory) {
  v1::GetStatsResponse s;
  s.set_serving(true);
  s.set_uptime_seconds(3725);
  auto add = [&](const char* rpc, const char* code, int64_t n) {
    auto* r = s.add_requests();
    r->set_rpc(rpc);
    r->set_code(code);
    r->set_count(n);
  };
  add("Forward", "OK", 20);
  add("Forward", "RESOURCE_EXHAUSTED", 2);
  add("Backward", "OK", 20);
  (*s.mutable_request_duration())["Forward"] = MakeHistogram({0.01, 0.05}, {0, 22, 0});
  (*s.mutable_engine_duration())["Forward"] = MakeHistogram({0.01, 0.05}, {0, 20, 0});
  (*s.mutable_tokens())["Forward"] = 20 * 8192;  // over 20 × 0.05 s of engine time
  (*s.mutable_received_bytes())["Forward"] = int64_t{3} << 30;
  s.set_live_sessions(4);
  s.set_session_memory_bytes(int64_t{2} << 30);
  s.set_queued_requests(1);
  s.set_forwards_staged(7);
  const std::string text = StatsSummary(s);
  EXPECT_THAT(text, HasSubstr("SERVING, up 1h02m"));
  EXPECT_THAT(text, HasSubstr("errors of Forward: RESOURCE_EXHAUSTED 2"));
  EXPECT_THAT(text, HasSubstr("164k"));  // 163840 tokens / 1 s
  EXPECT_THAT(text,
              HasSubstr("30.0 ms"));  // Forward p50: the middle of (0.01, 0.05]
  EXPECT_THAT(text, HasSubstr("received 3.0 GiB"));
  EXPECT_THAT(text, HasSubstr("4 live holding 2.0 GiB"));
  EXPECT_THAT(text, HasSubstr("1 queued"));
  EXPECT_THAT(text, HasSubstr("7 Forward calls' X copied onto the device"));
  // One line per RPC with its counts.
  EXPECT_THAT(text, ::testing::ContainsRegex("Forward +20 +2 "));
  EXPECT_THAT(text, ::testing::ContainsRegex("Backward +20 +0 "));
  EXPECT_LT(std::count(text.begin(), text.end(), '\n'), 30);
}

TEST(StatsSummaryTest, AFreshServer) {
  v1::GetStatsResponse s;
  s.set_serving(false);
  const std::string text = StatsSummary(s);
  EXPECT_THAT(text, HasSubstr("NOT_SERVING"));
  EXPECT_THAT(text, HasSubstr("no requests yet"));
}

}  // namespace
}  // namespace flce
