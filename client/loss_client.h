#ifndef FLCE_CLIENT_LOSS_CLIENT_H_
#define FLCE_CLIENT_LOSS_CLIENT_H_

// C++ client for flce.v1.LossService: typed arguments and results, a
// deadline on every call, gRPC errors as absl::Status with the server's code
// and message.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kernels/loss_engine.h"
#include "kernels/tensor.h"
#include "proto/flce/v1/loss_service.grpc.pb.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace flce {

struct ClientOptions {
  // Deadline of each call, from when it is made.
  absl::Duration timeout = absl::Minutes(5);
  // Largest message sent or received.
  int64_t max_message_bytes = int64_t{256} << 20;
  // Bytes per chunk of a streamed tensor (PutWeight, ForwardStream); less
  // where max_message_bytes is smaller.
  int64_t stream_chunk_bytes = int64_t{4} << 20;
  // Forward and Backward switch to their streaming RPCs when the tensors
  // would make a message larger than this (default: max_message_bytes less
  // 1 MiB for the rest of the message).
  int64_t stream_above_bytes = -1;
  // TLS: connect over TLS, trusting the CAs of `tls_root_certs` (PEM; empty:
  // the system's roots). Mutual TLS: also present this certificate chain
  // and key (PEM).
  bool tls = false;
  std::string tls_root_certs, tls_client_cert, tls_client_key;
  // TLS: the name the server's certificate must carry, when it is not the
  // host dialled (a pod dialled by IP whose certificate names its Service).
  std::string tls_server_name;
  // Sent as "authorization: Bearer <token>" on every call when not empty.
  std::string token;
  // A weight or its gradient of at least bulk_threshold_bytes travels over
  // this many connections of its own at once, through a region of the
  // server's memory (client/bulk_transfer.h); 0: over the one channel.
  // 1 MiB: from there on the bulk port was faster than the one stream at
  // every size measured (bench/RESULTS.md, 2026-12-04).
  // Over the server's bulk HTTP port where it offers one and `bulk_http`
  // (TLS like the channel, without a client certificate: the region's
  // ticket is the credential), else as gRPC streams.
  int bulk_connections = 4;
  int64_t bulk_threshold_bytes = int64_t{1} << 20;
  bool bulk_http = true;
};

class BulkTransfer;
class SharedMemoryArena;

struct ForwardArgs {
  // The tensors (views, copied into the request) and loss options. With
  // `weight_name` set, problem.weight and problem.bias are not sent: the
  // server uses that registered weight (version 0: the latest).
  LossProblem problem;
  std::string weight_name;
  int64_t weight_version = 0;
  bool need_backward = false;
  BackwardMode mode = BackwardMode::kAuto;
  bool want_lse = false;
  bool want_per_row_loss = false;
  // Send the tensors through this shared-memory region instead of the
  // message (same host; the server runs with --enable_shared_memory).
  SharedMemoryArena* shm = nullptr;
};

struct CallTimes {
  double queue_ms = 0;   // server: waiting for a worker
  double engine_ms = 0;  // server: computing
  double rpc_ms = 0;     // client: the whole round trip
};

struct RemoteForward {
  HostTensor loss, z_loss;
  std::optional<HostTensor> lse, per_row_loss;
  int64_t num_valid = 0;
  int64_t num_correct = 0;
  std::string session_id;
  BackwardMode mode = BackwardMode::kAuto;
  CallTimes times;
};

struct BackwardArgs {
  std::string session_id;
  std::optional<TensorView> grad_output;  // {} / {1} (mean, sum) or {N} (none)
  bool keep_session = false;
  std::optional<DType> grad_dtype;  // kFloat32, or unset for the input dtype
  // Add dW, db into the registered weight's accumulator instead of returning
  // them (the session's Forward must have used a registered weight).
  bool accumulate_weight_grad = false;
  // Which gradients to deliver (BackwardRequest.gradients): GRADIENTS_HIDDEN
  // needs keep_session; after GRADIENTS_WEIGHT grad_hidden is empty.
  v1::GradientSet gradients = v1::GRADIENTS_ALL;
  // Receive the gradients through this shared-memory region (the session's
  // Forward must have been made by this client).
  SharedMemoryArena* shm = nullptr;
};

struct RemoteGradients {
  HostTensor grad_hidden;
  std::optional<HostTensor> grad_weight, grad_bias;  // absent when accumulated
  CallTimes times;
};

// A registered weight's gradient sum, from TakeWeightGrad.
struct WeightGrad {
  v1::WeightInfo weight;
  HostTensor grad_weight;
  std::optional<HostTensor> grad_bias;
  int64_t accumulated_backwards = 0;
};

// The wire request for `args` (tensor bytes copied in, or left out for
// ForwardStream when !with_data).
v1::ForwardRequest BuildForwardRequest(const ForwardArgs& args, bool with_data = true);

// A POSIX shared-memory region of this process, registered with a server
// (which must run with --enable_shared_memory) by LossClient::
// CreateSharedMemory. Tensors passed through it are copied into it instead of
// a message; the server reads and writes it directly. REQUIRES: the client
// that created it outlives it.
class SharedMemoryArena {
 public:
  ~SharedMemoryArena();  // unregisters, unmaps and unlinks
  SharedMemoryArena(const SharedMemoryArena&) = delete;
  SharedMemoryArena& operator=(const SharedMemoryArena&) = delete;

  char* base() const { return base_; }
  int64_t bytes() const { return bytes_; }
  const std::string& region_id() const { return region_id_; }

 private:
  friend class LossClient;
  SharedMemoryArena() = default;
  class LossClient* client_ = nullptr;
  std::string name_, region_id_;
  char* base_ = nullptr;
  int64_t bytes_ = 0;
};

// The port flce_server listens on unless told otherwise.
inline constexpr int kDefaultPort = 50051;

// `target` with ":50051" added when it names a host without a port
// ("localhost", "10.0.0.7", "[::1]", "::1", "dns:///flce.svc"); gRPC would
// otherwise dial 443. Targets with a port, and other schemes (unix:, ...),
// are returned as they are.
std::string WithDefaultPort(const std::string& target);

// The host a gRPC target dials ("10.0.0.7", "::1", "flce.svc"); empty for a
// target that is not a host and port (unix: and the like).
std::string TargetHost(const std::string& target);

class LossClient {
 public:
  // A client of the server at `target` ("host:port"; a host alone means
  // port kDefaultPort: see WithDefaultPort). Connects lazily: the first call
  // reports an unreachable server as UNAVAILABLE.
  static std::unique_ptr<LossClient> Create(const std::string& target,
                                            ClientOptions options = {});

  absl::StatusOr<RemoteForward> Forward(const ForwardArgs& args);
  absl::StatusOr<RemoteGradients> Backward(const BackwardArgs& args);
  // True if a live session was freed.
  absl::StatusOr<bool> ReleaseSession(const std::string& session_id);
  absl::StatusOr<v1::GetServerInfoResponse> GetServerInfo();
  // Request counts, latency histograms and gauges (what /metrics shows).
  absl::StatusOr<v1::GetStatsResponse> GetStats();

  // A shared-memory region of `bytes`, registered with the server.
  absl::StatusOr<std::unique_ptr<SharedMemoryArena>> CreateSharedMemory(int64_t bytes);

  // Registers `weight` [V, H] (and `bias` [V]) under `name`, streamed in
  // stream_chunk_bytes chunks with a CRC-32C, or (large) written over the
  // bulk connections; returns the new version.
  absl::StatusOr<v1::WeightInfo> PutWeight(const std::string& name, const TensorView& weight,
                                           const std::optional<TensorView>& bias);
  absl::StatusOr<bool> DeleteWeight(const std::string& name);
  absl::StatusOr<std::vector<v1::WeightInfo>> ListWeights();
  // The accumulated gradient of a weight version (0: latest) in `dtype`
  // (kFloat32 or the weight's dtype); resets the accumulator. The server
  // keeps the take until the next TakeWeightGrad of the version: if this
  // one did not arrive whole, this client's next one gets it again. A large
  // one comes over the bulk connections when this client put the weight.
  // With `into`, the bytes go into the caller's memory (W's gradient at
  // into->weight, [V, H] in `dtype`; b's at into->bias when the weight has
  // a bias), as PyTorch's `out=`: memory already touched takes them at the
  // bus's rate, where new tensors fault in fresh pages. The returned
  // tensors then have dtype and shape but no bytes.
  struct TakeInto {
    void* weight = nullptr;
    void* bias = nullptr;
  };
  absl::StatusOr<WeightGrad> TakeWeightGrad(const std::string& name, int64_t version = 0,
                                            DType dtype = DType::kFloat32,
                                            std::optional<TakeInto> into = std::nullopt);
  // grpc.health.v1 status of `service` ("" for the whole server).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CheckHealth(
      const std::string& service = "");

  ~LossClient();

 private:
  using ChannelFactory = std::function<std::shared_ptr<grpc::Channel>(int connection)>;
  LossClient(ChannelFactory channels, ClientOptions options, std::string host = "");
  // The bulk transfer and its region for `bytes`, or null where they go
  // over the one channel (small, disabled, or a server without regions).
  BulkTransfer* Bulk(int64_t bytes);
  void Prepare(grpc::ClientContext& context) const;
  // A unary call of `stub` with Prepare's deadline and token.
  template <typename Stub, typename Request, typename Response>
  absl::StatusOr<Response> Unary(
      Stub* stub, grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
      const Request& request) const;
  int64_t StreamAbove() const;
  int64_t ChunkBytes() const;
  // The stream of one TakeWeightGrad: its header, bytes and take id.
  absl::Status ReadTake(const v1::TakeWeightGradRequest& request, WeightGrad* out,
                        std::string* bytes, DType* dtype, uint64_t* take_id);
  absl::StatusOr<v1::ForwardResponse> ForwardStreamed(const ForwardArgs& args);
  absl::StatusOr<v1::BackwardResponse> BackwardStreamed(const v1::BackwardRequest& request);

  friend class SharedMemoryArena;
  absl::StatusOr<v1::ForwardResponse> ForwardThroughShm(const ForwardArgs& args);

  // Each live session's shapes, from its Forward: they choose Backward's RPC
  // and lay out gradients in shared memory.
  struct SessionShape {
    int64_t rows = 0, hidden = 0, vocab = 0;  // vocab 0: weight not sent
    bool has_bias = false;
    DType dtype = DType::kFloat32;
  };
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, SessionShape> sessions_ ABSL_GUARDED_BY(mu_);
  // A take of each weight name that did not arrive whole, resumed by the
  // next TakeWeightGrad of that name.
  absl::flat_hash_map<std::string, uint64_t> lost_takes_ ABSL_GUARDED_BY(mu_);

  ClientOptions options_;
  ChannelFactory make_channel_;
  const std::string host_;  // for the bulk port
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::LossService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  // After the stub it unregisters its region through: gone before it.
  std::unique_ptr<BulkTransfer> bulk_ ABSL_GUARDED_BY(mu_);
  bool bulk_refused_ ABSL_GUARDED_BY(mu_) = false;
  // The shapes of the weights this client put: their gradients' sizes.
  absl::flat_hash_map<std::string, v1::WeightInfo> weights_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flce

#endif  // FLCE_CLIENT_LOSS_CLIENT_H_
