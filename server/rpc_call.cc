#include "server/rpc_call.h"

#include <time.h>

#include <chrono>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "spdlog/spdlog.h"

namespace flce {

std::string LogSafe(absl::string_view text, size_t max) {
  std::string out;
  const size_t shown = std::min(text.size(), max);
  out.reserve(shown);
  for (size_t i = 0; i < shown; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "\\x%02x", c);
    }
  }
  if (shown < text.size()) absl::StrAppend(&out, "…(+", text.size() - shown, " bytes)");
  return out;
}

namespace {

absl::Status Unparsable(size_t bytes, const google::protobuf::Message& message) {
  return absl::InvalidArgumentError(absl::StrCat("request: ", bytes, " bytes that do not parse as ",
                                                 message.GetDescriptor()->full_name()));
}

}  // namespace

absl::Status ParseMessage(const grpc::ByteBuffer& bytes, google::protobuf::Message* message) {
  grpc::ByteBuffer copy(bytes);  // shares the slices; the reader consumes its buffer
  grpc::ProtoBufferReader reader(&copy);
  if (!reader.status().ok() || !message->ParseFromZeroCopyStream(&reader)) {
    return Unparsable(bytes.Length(), *message);
  }
  return absl::OkStatus();
}

absl::Status ParseMessage(absl::string_view bytes, google::protobuf::Message* message) {
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      !message->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return Unparsable(bytes.size(), *message);
  }
  return absl::OkStatus();
}

absl::Status SerializeMessage(const google::protobuf::Message& message, int64_t max_bytes,
                              absl::string_view what, grpc::ByteBuffer* out) {
  const size_t size = message.ByteSizeLong();
  if (static_cast<int64_t>(size) > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": ", size, " bytes, over the server's message limit of ", max_bytes,
        " (--max_message_bytes); use the streaming RPC"));
  }
  bool own_buffer = false;
  grpc::Status status =
      grpc::SerializationTraits<google::protobuf::Message>::Serialize(message, out, &own_buffer);
  return FromGrpcStatus(status);
}

int64_t CallRecord::MonotonicNanos() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

absl::Time DeadlineOf(const grpc::CallbackServerContext* context) {
  const std::chrono::system_clock::time_point deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

absl::StatusCode CallRecord::Over(const grpc::CallbackServerContext* context) {
  const bool cancelled = context != nullptr && context->IsCancelled();
  for (auto& f : hooks_) f(answered_.ok() && !cancelled);
  hooks_.clear();
  absl::StatusCode code = answered_.code();
  std::string note;
  if (cancelled) {
    const bool late = std::chrono::system_clock::now() > context->deadline();
    code = late ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kCancelled;
    if (answered_.code() != code) {
      note = absl::StrCat("answered=", absl::StatusCodeToString(answered_.code()),
                          " not_delivered ");
    }
  }
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start_);
  // A failure's line ends with what the handler answered, quoted.
  std::string error;
  if (!answered_.ok() && !answered_.message().empty()) {
    error = absl::StrCat(" error=\"",
                         absl::StrReplaceAll(LogSafe(answered_.message(), 240), {{"\"", "\\x22"}}),
                         "\"");
  }
  SPDLOG_INFO("rpc={} {}{}{}code={} ms={:.1f}{}", rpc_,
              via_ != nullptr ? absl::StrCat("via=", via_, " ") : std::string(), detail_, note,
              absl::StatusCodeToString(code), ms, error);
  if (stamps_ > 0 && spdlog::should_log(spdlog::level::debug)) {
    std::string marks;
    for (int i = 0; i < stamps_; ++i) {
      absl::StrAppendFormat(&marks, " %s=+%d", marks_[i].stage,
                            (marks_[i].ns - start_mono_ns_) / 1000);
    }
    spdlog::debug("rpc={} timeline start_mono_us={}{} over=+{}", rpc_, start_mono_ns_ / 1000, marks,
                  (MonotonicNanos() - start_mono_ns_) / 1000);
  }
  if (metrics_ != nullptr) {
    metrics_->RecordRpc(rpc_, code, ms / 1e3);
    metrics_->AddBytes(rpc_, received_, sent_);
  }
  return code;
}

}  // namespace flce
