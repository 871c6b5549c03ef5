#ifndef FLCE_CLIENT_STATS_SUMMARY_H_
#define FLCE_CLIENT_STATS_SUMMARY_H_

// `flce stats`: GetStats as a page a person reads.

#include <string>

#include "proto/flce/v1/loss_service.pb.h"

namespace flce {

// Requests and errors by RPC and code, latency percentiles, engine time and
// tokens per second, queue, bytes, sessions, weights, streams and memory.
std::string StatsSummary(const v1::GetStatsResponse& stats);

// The q-quantile (0 < q < 1) of `h` in seconds, interpolated linearly within
// its bucket as Prometheus' histogram_quantile does; the last finite bound
// when it falls in the +Inf bucket; NaN for an empty histogram.
double HistogramQuantile(const v1::Histogram& h, double q);

// 1536 → "1.5 KiB"; below 1 KiB, "512 B".
std::string HumanBytes(double bytes);

}  // namespace flce

#endif  // FLCE_CLIENT_STATS_SUMMARY_H_
