#include "client/loss_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/bulk_transfer.h"
#include "proto/codec.h"
#include "proto/crc32c.h"

namespace flce {

std::string WithDefaultPort(const std::string& target) {
  std::string prefix, host = target;
  if (absl::StartsWith(target, "dns:///")) {
    prefix = "dns:///";
    host = target.substr(prefix.size());
  } else if (absl::StrContains(target, ":/") || absl::StartsWith(target, "unix:") ||
             absl::StartsWith(target, "unix-abstract:") || absl::StartsWith(target, "vsock:")) {
    return target;
  }
  if (host.empty()) return target;
  const size_t colons = std::count(host.begin(), host.end(), ':');
  if (host.front() == '[') {  // [v6] or [v6]:port
    return host.back() == ']' ? absl::StrCat(prefix, host, ":", kDefaultPort) : target;
  }
  if (colons == 0) return absl::StrCat(prefix, host, ":", kDefaultPort);
  if (colons > 1) return absl::StrCat(prefix, "[", host, "]:", kDefaultPort);  // bare IPv6
  return target;
}

std::string TargetHost(const std::string& target) {
  std::string address = WithDefaultPort(target);
  if (absl::StartsWith(address, "dns:///")) {
    address = address.substr(7);
  } else if (absl::StrContains(address, ":/") || absl::StartsWith(address, "unix:") ||
             absl::StartsWith(address, "unix-abstract:") || absl::StartsWith(address, "vsock:")) {
    return "";
  }
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

std::unique_ptr<LossClient> LossClient::Create(const std::string& target,
                                               ClientOptions options) {
  grpc::ChannelArguments args;
  if (!options.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs;
    ssl.pem_cert_chain = options.tls_client_cert;
    ssl.pem_private_key = options.tls_client_key;
    credentials = grpc::SslCredentials(ssl);
  }
  const std::string address = WithDefaultPort(target);
  // Connection -1 is the control channel; bulk connections each get a TCP
  // connection of their own (gRPC would share one among channels to one
  // target).
  auto make_channel = [address, credentials, args](int connection) {
    grpc::ChannelArguments own = args;
    if (connection >= 0) {
      own.SetInt("grpc.use_local_subchannel_pool", 1);
      own.SetInt("flce.bulk_connection", connection);
    }
    return grpc::CreateCustomChannel(address, credentials, own);
  };
  return std::unique_ptr<LossClient>(new LossClient(make_channel, options, TargetHost(target)));
}

LossClient::LossClient(ChannelFactory channels, ClientOptions options, std::string host)
    : options_(options),
      make_channel_(std::move(channels)),
      host_(std::move(host)),
      channel_(make_channel_(-1)),
      stub_(v1::LossService::NewStub(channel_)),
      health_(grpc::health::v1::Health::NewStub(channel_)) {}

LossClient::~LossClient() = default;

BulkTransfer* LossClient::Bulk(int64_t bytes) {
  if (options_.bulk_connections <= 0 || bytes < options_.bulk_threshold_bytes) return nullptr;
  absl::MutexLock lock(&mu_);
  if (bulk_refused_) return nullptr;
  if (bulk_ == nullptr) {
    std::vector<std::shared_ptr<grpc::Channel>> connections;
    for (int i = 0; i < options_.bulk_connections; ++i) connections.push_back(make_channel_(i));
    BulkHttpEndpoint http;
    if (options_.bulk_http) {
      http.host = host_;
      http.tls = options_.tls;
      http.tls_root_certs = options_.tls_root_certs;
      http.tls_server_name = options_.tls_server_name;
    }
    bulk_ = std::make_unique<BulkTransfer>(std::move(connections), stub_.get(), options_.timeout,
                                           options_.token, ChunkBytes(), std::move(http));
  }
  absl::StatusOr<std::string> region = bulk_->Region(bytes);
  if (!region.ok()) {
    // No regions there (none allowed, or the budget spent): the one channel.
    if (region.status().code() == absl::StatusCode::kResourceExhausted ||
        region.status().code() == absl::StatusCode::kUnimplemented ||
        region.status().code() == absl::StatusCode::kInvalidArgument) {
      bulk_refused_ = true;
    }
    return nullptr;
  }
  return bulk_.get();
}

void LossClient::Prepare(grpc::ClientContext& context) const {
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(options_.timeout));
  if (!options_.token.empty()) context.AddMetadata("authorization", "Bearer " + options_.token);
}

template <typename Stub, typename Request, typename Response>
absl::StatusOr<Response> LossClient::Unary(
    Stub* stub, grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
    const Request& request) const {
  grpc::ClientContext context;
  Prepare(context);
  Response response;
  FLCE_RETURN_IF_ERROR(FromGrpcStatus((stub->*method)(&context, request, &response)));
  return response;
}

v1::ForwardRequest BuildForwardRequest(const ForwardArgs& args, bool with_data) {
  const LossProblem& p = args.problem;
  v1::ForwardRequest request;
  CopyToProto(p.hidden, request.mutable_hidden(), with_data);
  if (!args.weight_name.empty()) {
    request.mutable_weight_ref()->set_name(args.weight_name);
    request.mutable_weight_ref()->set_version(args.weight_version);
  } else {
    CopyToProto(p.weight, request.mutable_weight(), with_data);
    if (p.bias) CopyToProto(*p.bias, request.mutable_bias(), with_data);
  }
  CopyToProto(p.target, request.mutable_target(), with_data);
  v1::LossOptions* o = request.mutable_options();
  o->set_ignore_index(p.options.ignore_index);
  o->set_reduction(ToProto(p.options.reduction));
  o->set_label_smoothing(p.options.label_smoothing);
  if (p.class_weight) CopyToProto(*p.class_weight, o->mutable_class_weight(), with_data);
  if (p.options.logit_softcap) o->set_logit_softcap(*p.options.logit_softcap);
  o->set_z_loss_scale(p.options.z_loss_scale);
  request.set_need_backward(args.need_backward);
  request.set_backward_mode(ToProto(args.mode));
  request.mutable_outputs()->set_lse(args.want_lse);
  request.mutable_outputs()->set_per_row_loss(args.want_per_row_loss);
  return request;
}

namespace {

// Bytes of the tensors a Forward sends.
int64_t RequestBytes(const ForwardArgs& args) {
  const LossProblem& p = args.problem;
  int64_t total = p.hidden.bytes() + p.target.bytes();
  if (args.weight_name.empty()) {
    total += p.weight.bytes() + (p.bias ? p.bias->bytes() : 0);
  }
  if (p.class_weight) total += p.class_weight->bytes();
  return total;
}

}  // namespace

int64_t LossClient::ChunkBytes() const {
  // Room beside the data for the chunk's framing and a header.
  return std::max<int64_t>(
      4096, std::min(options_.stream_chunk_bytes, options_.max_message_bytes - (int64_t{16} << 10)));
}

int64_t LossClient::StreamAbove() const {
  return options_.stream_above_bytes >= 0 ? options_.stream_above_bytes
                                          : options_.max_message_bytes - (int64_t{1} << 20);
}

absl::StatusOr<v1::ForwardResponse> LossClient::ForwardStreamed(const ForwardArgs& args) {
  grpc::ClientContext context;
  Prepare(context);
  v1::ForwardResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::ForwardRequestChunk>> writer =
      stub_->ForwardStream(&context, &response);
  v1::ForwardRequestChunk message;
  *message.mutable_request() = BuildForwardRequest(args, /*with_data=*/false);
  bool ok = writer->Write(message);
  message.Clear();
  const LossProblem& p = args.problem;
  auto send = [&](const TensorView& view, v1::TensorField field) {
    const char* data = static_cast<const char*>(view.data);
    const int64_t total = view.bytes();
    const int64_t chunk = ChunkBytes();
    for (int64_t offset = 0; offset < total && ok; offset += chunk) {
      message.mutable_chunk()->set_field(field);
      message.mutable_chunk()->set_data(
          data + offset, static_cast<size_t>(std::min(chunk, total - offset)));
      ok = writer->Write(message);
    }
  };
  send(p.hidden, v1::TENSOR_FIELD_HIDDEN);
  if (args.weight_name.empty()) {
    send(p.weight, v1::TENSOR_FIELD_WEIGHT);
    if (p.bias) send(*p.bias, v1::TENSOR_FIELD_BIAS);
  }
  send(p.target, v1::TENSOR_FIELD_TARGET);
  if (p.class_weight) send(*p.class_weight, v1::TENSOR_FIELD_CLASS_WEIGHT);
  writer->WritesDone();
  FLCE_RETURN_IF_ERROR(FromGrpcStatus(writer->Finish()));
  return response;
}

absl::StatusOr<RemoteForward> LossClient::Forward(const ForwardArgs& args) {
  const absl::Time start = absl::Now();
  v1::ForwardResponse response;
  if (args.shm != nullptr) {
    FLCE_ASSIGN_OR_RETURN(response, ForwardThroughShm(args));
  } else if (RequestBytes(args) > StreamAbove()) {
    FLCE_ASSIGN_OR_RETURN(response, ForwardStreamed(args));
  } else {
    FLCE_ASSIGN_OR_RETURN(response,
                          Unary(stub_.get(), &v1::LossService::Stub::Forward, BuildForwardRequest(args)));
  }
  if (!response.session_id().empty()) {
    const LossProblem& p = args.problem;
    SessionShape shape;
    shape.rows = p.rows();
    shape.hidden = p.hidden_size();
    shape.vocab = p.weight.shape.size() == 2 ? p.vocab() : 0;  // a registered weight: unknown
    shape.has_bias = p.bias.has_value();
    shape.dtype = p.hidden.dtype;
    absl::MutexLock lock(&mu_);
    sessions_[response.session_id()] = shape;
  }
  RemoteForward out;
  out.times.rpc_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  out.times.queue_ms = response.stats().queue_ms();
  out.times.engine_ms = response.stats().engine_ms();
  FLCE_ASSIGN_OR_RETURN(out.loss, MoveFromProto(response.mutable_loss(), "loss"));
  FLCE_ASSIGN_OR_RETURN(out.z_loss, MoveFromProto(response.mutable_z_loss(), "z_loss"));
  if (response.has_lse()) {
    FLCE_ASSIGN_OR_RETURN(out.lse, MoveFromProto(response.mutable_lse(), "lse"));
  }
  if (response.has_per_row_loss()) {
    FLCE_ASSIGN_OR_RETURN(out.per_row_loss,
                          MoveFromProto(response.mutable_per_row_loss(), "per_row_loss"));
  }
  out.num_valid = response.num_valid();
  out.num_correct = response.num_correct();
  out.session_id = response.session_id();
  out.mode = FromProto(response.backward_mode());
  return out;
}

absl::StatusOr<v1::BackwardResponse> LossClient::BackwardStreamed(
    const v1::BackwardRequest& request) {
  grpc::ClientContext context;
  Prepare(context);
  std::unique_ptr<grpc::ClientReader<v1::BackwardResponseChunk>> reader =
      stub_->BackwardStream(&context, request);
  v1::BackwardResponse response;
  v1::BackwardResponseChunk message;
  bool first = true;
  while (reader->Read(&message)) {
    if (first) {
      response = std::move(*message.mutable_response());
      for (v1::Tensor* t : {response.has_grad_hidden() ? response.mutable_grad_hidden() : nullptr,
                            response.has_grad_weight() ? response.mutable_grad_weight() : nullptr,
                            response.has_grad_bias() ? response.mutable_grad_bias() : nullptr}) {
        if (t == nullptr) continue;
        absl::StatusOr<int64_t> bytes = TensorBytes(*t, "gradient");
        if (bytes.ok()) t->mutable_data()->reserve(static_cast<size_t>(*bytes));
      }
      first = false;
      continue;
    }
    v1::Tensor* t = nullptr;
    switch (message.chunk().field()) {
      case v1::TENSOR_FIELD_GRAD_HIDDEN:
        if (response.has_grad_hidden()) t = response.mutable_grad_hidden();
        break;
      case v1::TENSOR_FIELD_GRAD_WEIGHT:
        if (response.has_grad_weight()) t = response.mutable_grad_weight();
        break;
      case v1::TENSOR_FIELD_GRAD_BIAS:
        if (response.has_grad_bias()) t = response.mutable_grad_bias();
        break;
      default:
        break;
    }
    if (t == nullptr) {
      return absl::DataLossError("BackwardStream: a chunk of a field the header did not announce");
    }
    t->mutable_data()->append(message.chunk().data());
  }
  FLCE_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  return response;
}

absl::StatusOr<RemoteGradients> LossClient::Backward(const BackwardArgs& args) {
  v1::BackwardRequest request;
  request.set_session_id(args.session_id);
  if (args.grad_output) CopyToProto(*args.grad_output, request.mutable_grad_output());
  request.set_keep_session(args.keep_session);
  if (args.grad_dtype) request.set_grad_dtype(ToProto(*args.grad_dtype));
  request.set_accumulate_weight_grad(args.accumulate_weight_grad);
  request.set_gradients(args.gradients);
  std::optional<SessionShape> shape;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(args.session_id);
    if (it != sessions_.end()) {
      shape = it->second;
      if (!args.keep_session) sessions_.erase(it);
    }
  }
  // Gradients come back at most fp32-sized.
  const int64_t grad_bytes =
      shape ? (shape->rows * shape->hidden + shape->vocab * shape->hidden + shape->vocab) * 4
            : 0;
  // Gradients through shared memory: dX, then dW and db, 64-byte aligned.
  std::vector<std::pair<v1::Tensor*, int64_t>> from_shm;
  if (args.shm != nullptr) {
    if (!shape || (shape->vocab == 0 && !args.accumulate_weight_grad)) {
      return absl::FailedPreconditionError(
          "shm: gradients come through shared memory only for sessions this client made "
          "with the weight sent (or with accumulate_weight_grad)");
    }
    const int64_t elem = DTypeSize(args.grad_dtype.value_or(shape->dtype));
    auto align = [](int64_t x) { return (x + 63) / 64 * 64; };
    const int64_t dx = shape->rows * shape->hidden * elem;
    const int64_t dw = args.accumulate_weight_grad ? 0 : shape->vocab * shape->hidden * elem;
    const int64_t db = args.accumulate_weight_grad || !shape->has_bias ? 0 : shape->vocab * elem;
    if (align(dx) + align(dw) + db > args.shm->bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm: the gradients need ", align(dx) + align(dw) + db, " bytes, the region holds ",
          args.shm->bytes()));
    }
    auto slice = [&](v1::SharedMemorySlice* s, int64_t offset) {
      s->set_region_id(args.shm->region_id());
      s->set_offset(offset);
    };
    slice(request.mutable_grad_hidden_out(), 0);
    if (dw > 0) slice(request.mutable_grad_weight_out(), align(dx));
    if (db > 0) slice(request.mutable_grad_bias_out(), align(dx) + align(dw));
  }
  const absl::Time start = absl::Now();
  v1::BackwardResponse response;
  if (args.shm == nullptr && grad_bytes > StreamAbove()) {
    FLCE_ASSIGN_OR_RETURN(response, BackwardStreamed(request));
  } else {
    FLCE_ASSIGN_OR_RETURN(response, Unary(stub_.get(), &v1::LossService::Stub::Backward, request));
  }
  // Gradients the server wrote into shared memory become ordinary bytes.
  for (v1::Tensor* t : {response.has_grad_hidden() ? response.mutable_grad_hidden() : nullptr,
                        response.has_grad_weight() ? response.mutable_grad_weight() : nullptr,
                        response.has_grad_bias() ? response.mutable_grad_bias() : nullptr}) {
    if (t == nullptr || !t->has_shm()) continue;
    const v1::SharedMemorySlice slice = t->shm();
    FLCE_ASSIGN_OR_RETURN(const int64_t bytes, TensorBytes(*t, "gradient"));
    if (args.shm == nullptr || slice.region_id() != args.shm->region_id() || slice.offset() < 0 ||
        slice.offset() > args.shm->bytes() - bytes) {
      return absl::DataLossError("Backward: a gradient in shared memory this call did not offer");
    }
    t->set_data(args.shm->base() + slice.offset(), static_cast<size_t>(bytes));
  }
  RemoteGradients out;
  out.times.rpc_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  out.times.queue_ms = response.stats().queue_ms();
  out.times.engine_ms = response.stats().engine_ms();
  if (response.has_grad_hidden()) {  // absent after GRADIENTS_WEIGHT
    FLCE_ASSIGN_OR_RETURN(out.grad_hidden,
                          MoveFromProto(response.mutable_grad_hidden(), "grad_hidden"));
  }
  if (response.has_grad_weight()) {
    FLCE_ASSIGN_OR_RETURN(out.grad_weight,
                          MoveFromProto(response.mutable_grad_weight(), "grad_weight"));
  }
  if (response.has_grad_bias()) {
    FLCE_ASSIGN_OR_RETURN(out.grad_bias,
                          MoveFromProto(response.mutable_grad_bias(), "grad_bias"));
  }
  return out;
}

absl::StatusOr<bool> LossClient::ReleaseSession(const std::string& session_id) {
  {
    absl::MutexLock lock(&mu_);
    sessions_.erase(session_id);
  }
  v1::ReleaseSessionRequest request;
  request.set_session_id(session_id);
  FLCE_ASSIGN_OR_RETURN(v1::ReleaseSessionResponse response,
                        Unary(stub_.get(), &v1::LossService::Stub::ReleaseSession, request));
  return response.released();
}

absl::StatusOr<v1::GetServerInfoResponse> LossClient::GetServerInfo() {
  return Unary(stub_.get(), &v1::LossService::Stub::GetServerInfo, v1::GetServerInfoRequest());
}

absl::StatusOr<v1::GetStatsResponse> LossClient::GetStats() {
  return Unary(stub_.get(), &v1::LossService::Stub::GetStats, v1::GetStatsRequest());
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
LossClient::CheckHealth(const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  FLCE_ASSIGN_OR_RETURN(grpc::health::v1::HealthCheckResponse response,
                        Unary(health_.get(), &grpc::health::v1::Health::Stub::Check, request));
  return response.status();
}

namespace {

v1::WeightHeader WeightHeaderOf(const std::string& name, const TensorView& weight,
                                const std::optional<TensorView>& bias) {
  v1::WeightHeader header;
  header.set_name(name);
  header.set_dtype(ToProto(weight.dtype));
  header.mutable_shape()->Assign(weight.shape.begin(), weight.shape.end());
  header.set_has_bias(bias.has_value());
  return header;
}

}  // namespace

absl::StatusOr<v1::WeightInfo> LossClient::PutWeight(const std::string& name,
                                                     const TensorView& weight,
                                                     const std::optional<TensorView>& bias) {
  // W's bytes then b's, as one logical stream.
  const char* parts[2] = {static_cast<const char*>(weight.data),
                          bias ? static_cast<const char*>(bias->data) : nullptr};
  const int64_t sizes[2] = {weight.bytes(), bias ? bias->bytes() : 0};
  if (BulkTransfer* bulk = Bulk(sizes[0] + sizes[1])) {
    // Into the region over every connection, each part checked; the header
    // then names the slice.
    FLCE_ASSIGN_OR_RETURN(const std::string region, bulk->Region(sizes[0] + sizes[1]));
    if (sizes[0] > 0) FLCE_RETURN_IF_ERROR(bulk->Write(region, 0, parts[0], sizes[0]));
    if (sizes[1] > 0) FLCE_RETURN_IF_ERROR(bulk->Write(region, sizes[0], parts[1], sizes[1]));
    grpc::ClientContext context;
    Prepare(context);
    v1::PutWeightResponse response;
    auto writer = stub_->PutWeight(&context, &response);
    v1::PutWeightChunk chunk;
    *chunk.mutable_header() = WeightHeaderOf(name, weight, bias);
    chunk.mutable_header()->mutable_source()->set_region_id(region);
    writer->Write(chunk);
    writer->WritesDone();
    FLCE_RETURN_IF_ERROR(FromGrpcStatus(writer->Finish()));
    absl::MutexLock lock(&mu_);
    weights_[name] = response.weight();
    return response.weight();
  }
  uint32_t crc = 0;
  for (int k = 0; k < 2; ++k) crc = Crc32c(crc, parts[k], static_cast<size_t>(sizes[k]));

  grpc::ClientContext context;
  Prepare(context);
  v1::PutWeightResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::PutWeightChunk>> writer =
      stub_->PutWeight(&context, &response);
  v1::PutWeightChunk chunk;
  *chunk.mutable_header() = WeightHeaderOf(name, weight, bias);
  chunk.mutable_header()->set_crc32c(crc);
  bool ok = true;
  bool sent = false;
  const int64_t step = ChunkBytes();
  for (int k = 0; k < 2 && ok; ++k) {
    for (int64_t offset = 0; offset < sizes[k] && ok; offset += step) {
      const int64_t n = std::min(step, sizes[k] - offset);
      chunk.set_data(parts[k] + offset, static_cast<size_t>(n));
      ok = writer->Write(chunk);
      chunk.clear_header();
      sent = true;
    }
  }
  if (ok && !sent) ok = writer->Write(chunk);  // header only (cannot happen for V, H >= 1)
  writer->WritesDone();
  FLCE_RETURN_IF_ERROR(FromGrpcStatus(writer->Finish()));
  absl::MutexLock lock(&mu_);
  weights_[name] = response.weight();
  return response.weight();
}

absl::StatusOr<bool> LossClient::DeleteWeight(const std::string& name) {
  v1::DeleteWeightRequest request;
  request.set_name(name);
  FLCE_ASSIGN_OR_RETURN(v1::DeleteWeightResponse response,
                        Unary(stub_.get(), &v1::LossService::Stub::DeleteWeight, request));
  return response.deleted();
}

absl::StatusOr<std::vector<v1::WeightInfo>> LossClient::ListWeights() {
  FLCE_ASSIGN_OR_RETURN(v1::ListWeightsResponse response,
                        Unary(stub_.get(), &v1::LossService::Stub::ListWeights, v1::ListWeightsRequest()));
  return std::vector<v1::WeightInfo>(response.weights().begin(), response.weights().end());
}

absl::StatusOr<WeightGrad> LossClient::TakeWeightGrad(const std::string& name, int64_t version,
                                                      DType dtype, std::optional<TakeInto> into) {
  if (into && into->weight == nullptr) {
    return absl::InvalidArgumentError("into: needs the weight's memory (into.weight)");
  }
  v1::TakeWeightGradRequest request;
  request.mutable_weight()->set_name(name);
  request.mutable_weight()->set_version(version);
  request.set_dtype(ToProto(dtype));
  // The server keeps each take until the next one, which asks for it again
  // if it did not arrive whole.
  request.set_hold_until_acknowledged(true);
  {
    absl::MutexLock lock(&mu_);
    auto it = lost_takes_.find(name);
    if (it != lost_takes_.end()) request.set_resume_take(it->second);
  }
  // A gradient of a weight this client put, and large: into a region, then
  // over every connection.
  int64_t known = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = weights_.find(name);
    if (it != weights_.end() && it->second.shape_size() == 2) {
      const int64_t v = it->second.shape(0), h = it->second.shape(1);
      known = (v * h + (it->second.has_bias() ? v : 0)) * DTypeSize(dtype);
    }
  }
  BulkTransfer* bulk = known > 0 ? Bulk(known) : nullptr;
  std::string region;
  if (bulk != nullptr) {
    FLCE_ASSIGN_OR_RETURN(region, bulk->Region(known));
    request.mutable_into()->set_region_id(region);
  }
  WeightGrad out;
  std::string bytes;
  DType got = dtype;
  uint64_t take_id = 0;
  absl::Status status = ReadTake(request, &out, &bytes, &got, &take_id);
  const int64_t v = status.ok() ? out.weight.shape(0) : 0;
  const int64_t h = status.ok() ? out.weight.shape(1) : 0;
  const int64_t elem = DTypeSize(got);
  const bool has_bias = out.weight.has_bias();
  if (status.ok() && into && has_bias && into->bias == nullptr) {
    // The take stays with the server: the next one asks for it again.
    status = absl::InvalidArgumentError("into: the weight has a bias; into.bias is needed");
  }
  // The results' memory: the caller's, or new tensors.
  char* weight_to = nullptr;
  char* bias_to = nullptr;
  if (status.ok()) {
    auto destination = [&](std::vector<int64_t> shape, void* caller, HostTensor& tensor) {
      if (caller != nullptr) {
        tensor.dtype = got;
        tensor.shape = std::move(shape);
        return static_cast<char*>(caller);
      }
      tensor = HostTensor(got, std::move(shape));
      return &tensor.data[0];
    };
    weight_to = destination({v, h}, into ? into->weight : nullptr, out.grad_weight);
    if (has_bias) bias_to = destination({v}, into ? into->bias : nullptr, out.grad_bias.emplace());
  }
  if (status.ok() && bulk != nullptr) {
    // Straight from the region into the results.
    status = bulk->Read(region, 0, weight_to, v * h * elem);
    if (status.ok() && has_bias) status = bulk->Read(region, v * h * elem, bias_to, v * elem);
  }
  const int64_t expected = bulk != nullptr ? 0 : (v * h + (has_bias ? v : 0)) * elem;
  if (status.ok() && static_cast<int64_t>(bytes.size()) != expected) {
    status = absl::DataLossError(absl::StrCat("TakeWeightGrad: received ", bytes.size(),
                                              " bytes, expected ", expected));
  }
  {
    // A take that did not arrive whole is asked for again next time.
    absl::MutexLock lock(&mu_);
    if (status.ok() || take_id == 0) {
      lost_takes_.erase(name);
    } else {
      lost_takes_[name] = take_id;
    }
  }
  FLCE_RETURN_IF_ERROR(status);
  if (bulk != nullptr) return out;
  std::memcpy(weight_to, bytes.data(), static_cast<size_t>(v * h * elem));
  if (has_bias) std::memcpy(bias_to, bytes.data() + v * h * elem, static_cast<size_t>(v * elem));
  return out;
}

absl::Status LossClient::ReadTake(const v1::TakeWeightGradRequest& request, WeightGrad* out,
                                  std::string* bytes, DType* dtype, uint64_t* take_id) {
  grpc::ClientContext context;
  Prepare(context);
  std::unique_ptr<grpc::ClientReader<v1::WeightGradChunk>> reader =
      stub_->TakeWeightGrad(&context, request);
  v1::WeightGradChunk chunk;
  bool header = false;
  absl::Status status;
  while (reader->Read(&chunk)) {
    if (chunk.has_header()) {
      header = true;
      out->weight = chunk.header().weight();
      out->accumulated_backwards = chunk.header().accumulated_backwards();
      *take_id = chunk.header().take_id();
      absl::StatusOr<DType> got = FromProto(chunk.header().dtype(), "header.dtype");
      if (got.ok()) *dtype = *got;
      if (!got.ok() && status.ok()) status = got.status();
    }
    bytes->append(chunk.data());
  }
  FLCE_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  FLCE_RETURN_IF_ERROR(status);
  if (!header || out->weight.shape_size() != 2) {
    return absl::DataLossError("TakeWeightGrad: the stream had no header");
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ForwardResponse> LossClient::ForwardThroughShm(const ForwardArgs& args) {
  v1::ForwardRequest request = BuildForwardRequest(args, /*with_data=*/false);
  const LossProblem& p = args.problem;
  int64_t offset = 0;
  absl::Status status;
  auto place = [&](const TensorView& view, v1::Tensor* t) {
    const int64_t bytes = view.bytes();
    if (!status.ok()) return;
    if (offset + bytes > args.shm->bytes()) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "shm: the tensors need more than the region's ", args.shm->bytes(), " bytes"));
      return;
    }
    std::memcpy(args.shm->base() + offset, view.data, static_cast<size_t>(bytes));
    t->mutable_shm()->set_region_id(args.shm->region_id());
    t->mutable_shm()->set_offset(offset);
    offset += (bytes + 63) / 64 * 64;
  };
  place(p.hidden, request.mutable_hidden());
  if (args.weight_name.empty()) {
    place(p.weight, request.mutable_weight());
    if (p.bias) place(*p.bias, request.mutable_bias());
  }
  place(p.target, request.mutable_target());
  if (p.class_weight) place(*p.class_weight, request.mutable_options()->mutable_class_weight());
  FLCE_RETURN_IF_ERROR(status);
  return Unary(stub_.get(), &v1::LossService::Stub::Forward, request);
}

absl::StatusOr<std::unique_ptr<SharedMemoryArena>> LossClient::CreateSharedMemory(int64_t bytes) {
  static std::atomic<int> counter{0};
  std::unique_ptr<SharedMemoryArena> arena(new SharedMemoryArena());
  arena->client_ = this;
  arena->name_ = absl::StrCat("/flce-", getpid(), "-", counter++);
  const int fd = shm_open(arena->name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("shm_open ", arena->name_, ": ", std::strerror(errno)));
  }
  if (ftruncate(fd, bytes) != 0) {
    close(fd);
    shm_unlink(arena->name_.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("shm: cannot size ", bytes, " bytes"));
  }
  void* base = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(arena->name_.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("shm: cannot map ", bytes, " bytes"));
  }
  arena->base_ = static_cast<char*>(base);
  arena->bytes_ = bytes;
  v1::RegisterSharedMemoryRequest request;
  request.set_shm_name(arena->name_);
  request.set_bytes(bytes);
  FLCE_ASSIGN_OR_RETURN(v1::RegisterSharedMemoryResponse response,
                        Unary(stub_.get(), &v1::LossService::Stub::RegisterSharedMemory, request));
  arena->region_id_ = response.region_id();
  return arena;
}

SharedMemoryArena::~SharedMemoryArena() {
  if (!region_id_.empty()) {
    v1::UnregisterSharedMemoryRequest request;
    request.set_region_id(region_id_);
    // Best effort: a destructor cannot report a failure.
    client_->Unary(client_->stub_.get(), &v1::LossService::Stub::UnregisterSharedMemory, request)
        .IgnoreError();
  }
  if (base_ != nullptr) munmap(base_, static_cast<size_t>(bytes_));
  shm_unlink(name_.c_str());
}

}  // namespace flce
