// LossServiceImpl's compute handlers: Forward, Backward, ForwardStream and
// BackwardStream.

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/status_macros.h"
#include "proto/codec.h"
#include "server/forward_assembly.h"
#include "server/handler_support.h"
#include "server/loss_service.h"
#include "server/stream_call.h"

namespace flce {
namespace {

// A gradient into the response: its bytes, or (written to the caller's
// shared memory already) its dtype and shape with the slice.
void EncodeGradient(HostTensor&& t, bool in_shm, const v1::SharedMemorySlice& slice,
                    v1::Tensor* out) {
  if (!in_shm) {
    MoveToProto(std::move(t), out);
    return;
  }
  out->set_dtype(ToProto(t.dtype));
  out->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  *out->mutable_shm() = slice;
}

std::string ProblemDetail(const LossProblem& p) {
  return absl::StrCat(
      "n=", p.rows(), " h=", p.hidden_size(), " v=", p.vocab(),
      p.shard ? absl::StrCat(" shard=", p.shard->first, "/", p.shard->full_vocab) : std::string(),
      " dtype=", DTypeName(p.hidden.dtype), " ");
}

// Bytes a Forward response takes beyond its framing: the per-row tensors.
int64_t ForwardResponseBytes(const ForwardCall& call) {
  const int64_t rows = call.problem.rows();
  int64_t tensors = static_cast<int64_t>(call.want_lse) + call.want_per_row_loss;
  if (call.problem.shard) {
    tensors = 6;  // max, sum-exp, target logit, weighted sum, argmax (8 bytes)
  } else if (call.problem.options.reduction == Reduction::kNone) {
    tensors += 2;  // loss, z_loss
  }
  return tensors * rows * 4;
}

// ForwardRequest.backward as the Backward call it stands for (on the session
// the Forward makes, kept; the Forward's shared memory and ready event).
absl::StatusOr<BackwardCall> DecodeEagerBackward(const v1::ForwardRequest& request,
                                                 const ForwardCall& forward) {
  const v1::EagerBackward& part = request.backward();
  if (!request.need_backward()) {
    return absl::InvalidArgumentError("backward: needs need_backward (it runs on the session)");
  }
  if (part.gradients() == v1::GRADIENTS_WEIGHT) {
    return absl::InvalidArgumentError(
        "backward.gradients: GRADIENTS_ALL or GRADIENTS_HIDDEN in a Forward (GRADIENTS_WEIGHT "
        "is a later Backward's)");
  }
  if (part.gradients() == v1::GRADIENTS_HIDDEN) {
    if (!part.has_grad_hidden_out() || part.has_grad_weight_out() || part.has_grad_bias_out()) {
      return absl::InvalidArgumentError(
          "backward: GRADIENTS_HIDDEN writes dX only: grad_hidden_out, and no grad_weight_out "
          "or grad_bias_out (dW and db stay in the session)");
    }
  } else if (!part.has_grad_hidden_out() || !part.has_grad_weight_out() ||
             part.has_grad_bias_out() != forward.problem.bias.has_value()) {
    return absl::InvalidArgumentError(
        "backward: every gradient needs its destination (grad_hidden_out, grad_weight_out, and "
        "grad_bias_out exactly when there is a bias); gradients come back as bytes only from "
        "Backward");
  }
  v1::BackwardRequest as_backward;
  as_backward.set_session_id("(this Forward's)");
  as_backward.set_keep_session(true);
  as_backward.set_gradients(part.gradients());
  if (part.has_grad_output()) *as_backward.mutable_grad_output() = part.grad_output();
  as_backward.set_grad_dtype(part.grad_dtype());
  *as_backward.mutable_grad_hidden_out() = part.grad_hidden_out();
  if (part.has_grad_weight_out()) *as_backward.mutable_grad_weight_out() = part.grad_weight_out();
  if (part.has_grad_bias_out()) *as_backward.mutable_grad_bias_out() = part.grad_bias_out();
  as_backward.set_ready_event(request.ready_event());
  return DecodeBackward(as_backward, forward.shm);
}

}  // namespace

absl::Status LossServiceImpl::WriteLoss(const HostTensor& loss, const SliceMemory& out) {
  const int64_t bytes = static_cast<int64_t>(loss.data.size());
  if (out.space == MemorySpace::kHost) {
    std::memcpy(out.data, loss.data.data(), bytes);
    return absl::OkStatus();
  }
  DeviceMemory* device = core_->engine().device_memory();
  if (device == nullptr) return absl::InternalError("loss_out: device memory without a device");
  return device->CopyToDevice(loss.data.data(), out.data, bytes);
}

namespace {

// ForwardRequest.release_sessions' bound.
constexpr int kMaxReleasedSessions = 64;

}  // namespace

// --- Forward ---------------------------------------------------------------

absl::Status LossServiceImpl::ComputeForward(Call* call, const std::string& principal,
                                             const ForwardCall& forward, BackwardCall* eager,
                                             const v1::EagerBackward* eager_request,
                                             MarkBoard* written_marks,
                                             std::shared_ptr<LossCore::Staged> staged,
                                             v1::ForwardResponse* response, absl::Time queued) {
  const absl::Time engine_start = absl::Now();
  absl::StatusOr<ForwardOutcome> outcome = core_->Forward(
      forward, principal, CancelFor(call),
      [call] {
        call->record().Stamp("accepted");
        call->Started();
      },
      std::move(staged));
  metrics_->RecordQueueWait(absl::ToDoubleSeconds(engine_start - queued));
  metrics_->RecordEngine(call->record().rpc(), absl::ToDoubleSeconds(absl::Now() - engine_start),
                         outcome.ok() ? forward.problem.rows() : 0);
  if (!outcome.ok()) return Explain(outcome.status(), *call);
  // The session lives only if the client learns its id.
  if (!outcome->session_id.empty()) {
    call->WhenOver([this, id = outcome->session_id, principal](bool delivered) {
      if (!delivered) core_->Release(id, principal);
    });
  }
  call->record().Stamp("forward");
  if (eager != nullptr) {
    // The gradients now, into the caller's memory; the session stays for
    // a Backward that needs another grad_output.
    eager->session_id = outcome->session_id;
    if (written_marks != nullptr && eager->grad_hidden_out) {
      // dX's first bytes in the region let reads of them go at once.
      eager->grad_hidden_landed = [written_marks, mark = eager_request->written_mark(),
                                   begin = eager->grad_hidden_out->offset](int64_t bytes) {
        written_marks->Progress(mark, begin, begin + bytes);
      };
    }
    absl::StatusOr<BackwardOutcome> grads = core_->Backward(*eager, principal, CancelFor(call));
    if (!grads.ok()) {
      core_->Release(outcome->session_id, principal);
      return Explain(grads.status(), *call);
    }
    core_->Answered(*grads);
    core_->Settle(*grads, /*delivered=*/true);
    const v1::EagerBackward& slices = *eager_request;
    // dX is in its region: a read waiting for the mark goes now.
    if (written_marks != nullptr) written_marks->Post(slices.written_mark(), absl::OkStatus());
    v1::BackwardResponse* back = response->mutable_backward();
    EncodeGradient(std::move(grads->grad_hidden), true, slices.grad_hidden_out(),
                   back->mutable_grad_hidden());
    if (grads->grad_weight) {
      EncodeGradient(std::move(*grads->grad_weight), true, slices.grad_weight_out(),
                     back->mutable_grad_weight());
    }
    if (grads->grad_bias) {
      EncodeGradient(std::move(*grads->grad_bias), true, slices.grad_bias_out(),
                     back->mutable_grad_bias());
    }
    call->record().Stamp("backward");
  }
  FLCE_RETURN_IF_ERROR(CheckAlive(*call, "while computing"));
  ForwardResult& r = outcome->result;
  if (forward.loss_out) {
    FLCE_RETURN_IF_ERROR(WriteLoss(r.loss, *forward.loss_out));
    call->record().Stamp("loss");
  }
  if (r.shard_stats) {
    v1::ShardStats* stats = response->mutable_shard_stats();
    MoveToProto(std::move(r.shard_stats->max), stats->mutable_max());
    MoveToProto(std::move(r.shard_stats->sum_exp), stats->mutable_sum_exp());
    MoveToProto(std::move(r.shard_stats->target_logit), stats->mutable_target_logit());
    if (r.shard_stats->weighted_logit_sum) {
      MoveToProto(std::move(*r.shard_stats->weighted_logit_sum),
                  stats->mutable_weighted_logit_sum());
    }
    MoveToProto(std::move(r.shard_stats->argmax), stats->mutable_argmax());
  } else {
    MoveToProto(std::move(r.loss), response->mutable_loss());
    MoveToProto(std::move(r.z_loss), response->mutable_z_loss());
  }
  if (r.lse) MoveToProto(std::move(*r.lse), response->mutable_lse());
  if (r.per_row_loss) MoveToProto(std::move(*r.per_row_loss), response->mutable_per_row_loss());
  response->set_num_valid(r.num_valid);
  response->set_num_correct(r.num_correct);
  response->set_session_id(outcome->session_id);
  response->set_backward_mode(ToProto(outcome->mode));
  response->mutable_stats()->set_queue_ms(absl::ToDoubleMilliseconds(engine_start - queued));
  response->mutable_stats()->set_engine_ms(MillisSince(engine_start));
  call->record().PrependDetail(SessionDetail(outcome->session_id));
  return absl::OkStatus();
}

absl::StatusOr<MarkBoard*> LossServiceImpl::WrittenMarks(Call* call, const std::string& principal,
                                                         const v1::ForwardRequest& request) {
  const uint64_t mark = request.backward().written_mark();
  if (mark == 0) return nullptr;
  const v1::SharedMemorySlice& slice = request.backward().grad_hidden_out();
  absl::StatusOr<std::shared_ptr<SharedRegion>> region =
      shared_memory_->Find(slice.region_id(), principal);
  if (!request.backward().has_grad_hidden_out() || !region.ok() || (*region)->marks() == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "backward.written_mark: posted on grad_hidden_out's region, which must be a region of "
        "server memory of the caller's (",
        !request.backward().has_grad_hidden_out() ? std::string("none given")
        : region.ok()                             ? std::string("not server memory")
                                                  : std::string(region.status().message()),
        ")"));
  }
  MarkBoard* marks = (*region)->marks();
  // Whatever ends the call: a read still waiting learns it never comes (an
  // OK post before this stays). The region stays until then.
  call->WhenOver([region = *std::move(region), marks, mark](bool) {
    marks->Post(
        mark, absl::AbortedError(absl::StrCat("the Forward that was to write mark ", mark,
                                              " ended without writing it (its answer says why)")));
  });
  return marks;
}

void LossServiceImpl::StartForward(Call* call, const std::string& principal,
                                   const v1::ForwardRequest* request,
                                   v1::ForwardResponse* response) {
  if (request->release_sessions_size() > kMaxReleasedSessions) {
    call->Reply(absl::InvalidArgumentError(
        absl::StrCat("release_sessions: ", request->release_sessions_size(), " ids; at most ",
                     kMaxReleasedSessions, " per Forward")));
    return;
  }
  absl::StatusOr<MarkBoard*> written_marks = WrittenMarks(call, principal, *request);
  if (!written_marks.ok()) {
    call->Reply(written_marks.status());
    return;
  }
  for (const std::string& id : request->release_sessions()) core_->Release(id, principal);
  absl::StatusOr<ForwardCall> decoded = GuardMemory(
      [&]() -> absl::StatusOr<ForwardCall> {
        return DecodeForward(*request, core_->weights(), principal, ResolverFor(principal));
      },
      call->record().rpc());
  if (!decoded.ok()) {
    call->Reply(decoded.status());
    return;
  }
  call->record().Stamp("decoded");
  call->record().SetDetail(ProblemDetail(decoded->problem));
  // Refused before any compute rather than computed and then undeliverable.
  const int64_t response_bytes = ForwardResponseBytes(*decoded);
  if (response_bytes > limits_.max_message_bytes - 4096) {
    call->Reply(absl::ResourceExhaustedError(
        absl::StrCat("Forward: the response's per-row outputs take ", response_bytes,
                     " bytes, over the server's message limit of ", limits_.max_message_bytes,
                     " (--max_message_bytes); ask for fewer outputs or split the batch")));
    return;
  }
  std::shared_ptr<BackwardCall> eager;
  if (request->has_backward()) {
    absl::StatusOr<BackwardCall> part = DecodeEagerBackward(*request, *decoded);
    if (!part.ok()) {
      call->Reply(part.status());
      return;
    }
    eager = std::make_shared<BackwardCall>(*std::move(part));
  }
  auto forward = std::make_shared<ForwardCall>(*std::move(decoded));
  // X onto the device now, beside whatever runs before this call.
  std::shared_ptr<LossCore::Staged> staged = core_->StageAhead(*forward);
  if (staged != nullptr) call->record().Stamp("staged");
  Run(
      call,
      [=](absl::Time queued) {
        return ComputeForward(call, principal, *forward, eager.get(),
                              eager ? &request->backward() : nullptr, *written_marks, staged,
                              response, queued);
      },
      [call](const absl::Status& status) { call->Reply(status); });
}

LossServiceImpl::Unary* LossServiceImpl::Forward(Context* context, const Bytes* in, Bytes* out) {
  auto* call = NewUnary<v1::ForwardRequest, v1::ForwardResponse>(context, in, out, "Forward");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/true)) {
    StartForward(call, *principal, &call->request(), call->response());
  }
  return call;
}

// --- Backward --------------------------------------------------------------

void LossServiceImpl::StartBackward(Call* call, const std::string& principal,
                                    const v1::BackwardRequest* request, int64_t max_response_bytes,
                                    std::shared_ptr<BackwardOutcome> outcome,
                                    std::shared_ptr<CallStats> stats,
                                    std::function<void(const absl::Status&)> done) {
  absl::StatusOr<BackwardCall> decoded = GuardMemory(
      [&]() -> absl::StatusOr<BackwardCall> {
        return DecodeBackward(*request, ResolverFor(principal));
      },
      call->record().rpc());
  if (!decoded.ok()) {
    done(decoded.status());
    return;
  }
  call->record().Stamp("decoded");
  decoded->max_response_bytes = max_response_bytes;
  call->record().SetDetail(SessionDetail(decoded->session_id));
  // The session is consumed only once the gradients reached the client.
  call->WhenOver([this, outcome](bool delivered) { core_->Settle(*outcome, delivered); });
  auto backward = std::make_shared<BackwardCall>(*std::move(decoded));
  Run(
      call,
      [=](absl::Time queued) -> absl::Status {
        const absl::Time engine_start = absl::Now();
        absl::StatusOr<BackwardOutcome> grads =
            core_->Backward(*backward, principal, CancelFor(call));
        call->record().Stamp("computed");
        metrics_->RecordQueueWait(absl::ToDoubleSeconds(engine_start - queued));
        metrics_->RecordEngine(
            call->record().rpc(), absl::ToDoubleSeconds(absl::Now() - engine_start),
            grads.ok() && !grads->grad_hidden.shape.empty() ? grads->grad_hidden.shape[0] : 0);
        if (!grads.ok()) return Explain(grads.status(), *call);
        *outcome = *std::move(grads);
        stats->queue_ms = absl::ToDoubleMilliseconds(engine_start - queued);
        stats->engine_ms = MillisSince(engine_start);
        return absl::OkStatus();
      },
      std::move(done));
}

LossServiceImpl::Unary* LossServiceImpl::Backward(Context* context, const Bytes* in, Bytes* out) {
  auto* call = NewUnary<v1::BackwardRequest, v1::BackwardResponse>(context, in, out, "Backward");
  if (std::optional<std::string> principal = Accept(call, /*new_work=*/false)) {
    ServeBackward(call, *principal, &call->request(), call->response());
  }
  return call;
}

void LossServiceImpl::ChannelForward(Call* call, const std::string& principal,
                                     const v1::ForwardRequest* request,
                                     v1::ForwardResponse* response) {
  if (draining_) return call->Reply(DrainingError());
  StartForward(call, principal, request, response);
}

void LossServiceImpl::ChannelBackward(Call* call, const std::string& principal,
                                      const v1::BackwardRequest* request,
                                      v1::BackwardResponse* response) {
  ServeBackward(call, principal, request, response);
}

void LossServiceImpl::ServeBackward(Call* call, const std::string& principal,
                                    const v1::BackwardRequest* request_ptr,
                                    v1::BackwardResponse* response_ptr) {
  auto outcome = std::make_shared<BackwardOutcome>();
  auto stats = std::make_shared<CallStats>();
  StartBackward(
      call, principal, request_ptr, limits_.max_message_bytes, outcome, stats,
      [this, call, request_ptr, response_ptr, outcome, stats](const absl::Status& status) {
        if (status.ok()) {
          core_->Answered(*outcome);
          const v1::BackwardRequest& request = *request_ptr;
          v1::BackwardResponse* response = response_ptr;
          BackwardOutcome& o = *outcome;
          if (o.has_grad_hidden) {
            EncodeGradient(std::move(o.grad_hidden), o.grad_hidden_in_shm,
                           request.grad_hidden_out(), response->mutable_grad_hidden());
          }
          if (o.grad_weight) {
            EncodeGradient(std::move(*o.grad_weight), o.grad_weight_in_shm,
                           request.grad_weight_out(), response->mutable_grad_weight());
          }
          if (o.grad_bias) {
            EncodeGradient(std::move(*o.grad_bias), o.grad_bias_in_shm, request.grad_bias_out(),
                           response->mutable_grad_bias());
          }
          response->mutable_stats()->set_queue_ms(stats->queue_ms);
          response->mutable_stats()->set_engine_ms(stats->engine_ms);
        }
        call->Reply(status);
      });
}

// --- Streams ---------------------------------------------------------------

namespace {

// ForwardStream: the header request, then its tensors' bytes field by field;
// at the end of the stream, the assembled request goes through Forward.
// The announced tensors' bytes are reserved (RequestAdmission) when the
// header arrives; each tensor's memory is allocated when its first bytes
// do, and is filled only as far as they come.
class ForwardStreamReactor final : public ReadStream {
 public:
  ForwardStreamReactor(grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
                       ServiceMetrics* metrics, int64_t max_message_bytes, int64_t max_bytes,
                       std::function<void(ForwardStreamReactor*)> start_forward)
      : ReadStream(context, response, metrics, "ForwardStream", max_message_bytes),
        start_forward_(std::move(start_forward)),
        assembly_(max_bytes) {}

  const v1::ForwardRequest* request() const { return &assembly_.request(); }
  v1::ForwardResponse* forward_response() { return &response_; }
  using ReadStream::principal;

 private:
  google::protobuf::Message* message() override { return &chunk_; }
  const google::protobuf::Message& response() override { return response_; }

  absl::Status Take() override {
    const bool first = !assembly_.started();
    FLCE_ASSIGN_OR_RETURN(const int64_t announced, assembly_.Take(&chunk_));
    return first ? ticket().Reserve(announced, "ForwardStream") : absl::OkStatus();
  }

  absl::Status End() override { return assembly_.End(); }

  bool RepliesLater() const override { return true; }
  void Proceed() override { start_forward_(this); }  // replies through Reply()

  const std::function<void(ForwardStreamReactor*)> start_forward_;
  v1::ForwardRequestChunk chunk_;
  ForwardAssembly assembly_;
  v1::ForwardResponse response_;
};

// BackwardStream: the response with the gradients' dtypes and shapes, then
// their bytes in chunks.
class BackwardStreamReactor final : public WriteStream {
 public:
  BackwardStreamReactor(grpc::CallbackServerContext* context, ServiceMetrics* metrics,
                        int64_t max_message_bytes, int64_t chunk_bytes)
      : WriteStream(context, metrics, "BackwardStream", max_message_bytes),
        chunk_bytes_(chunk_bytes) {}

  v1::BackwardRequest* request() { return &request_; }

  // Called once the gradients are computed (or failed).
  void Start(const absl::Status& status, BackwardOutcome& outcome, double queue_ms,
             double engine_ms) {
    if (!status.ok()) return Reply(status);
    v1::BackwardResponse* header = message_.mutable_response();
    auto add = [&](HostTensor&& t, bool in_shm, const v1::SharedMemorySlice& slice,
                   v1::Tensor* meta, v1::TensorField field) {
      std::string data = std::move(t.data);
      t.data.clear();
      EncodeGradient(std::move(t), in_shm, slice, meta);  // dtype, shape (and slice)
      meta->clear_data();
      if (!in_shm) parts_.push_back({field, std::move(data)});
    };
    if (outcome.has_grad_hidden) {
      add(std::move(outcome.grad_hidden), outcome.grad_hidden_in_shm, request_.grad_hidden_out(),
          header->mutable_grad_hidden(), v1::TENSOR_FIELD_GRAD_HIDDEN);
    }
    if (outcome.grad_weight) {
      add(std::move(*outcome.grad_weight), outcome.grad_weight_in_shm, request_.grad_weight_out(),
          header->mutable_grad_weight(), v1::TENSOR_FIELD_GRAD_WEIGHT);
    }
    if (outcome.grad_bias) {
      add(std::move(*outcome.grad_bias), outcome.grad_bias_in_shm, request_.grad_bias_out(),
          header->mutable_grad_bias(), v1::TENSOR_FIELD_GRAD_BIAS);
    }
    header->mutable_stats()->set_queue_ms(queue_ms);
    header->mutable_stats()->set_engine_ms(engine_ms);
    StartWriting();
  }

 private:
  const google::protobuf::Message* Next() override {
    if (!sent_header_) {
      sent_header_ = true;
      return &message_;
    }
    message_.Clear();
    while (part_ < parts_.size() && offset_ >= parts_[part_].data.size()) {
      parts_[part_].data = std::string();  // sent: free it
      ++part_;
      offset_ = 0;
    }
    if (part_ == parts_.size()) return nullptr;
    const Part& p = parts_[part_];
    const size_t n = std::min(p.data.size() - offset_, static_cast<size_t>(chunk_bytes_));
    message_.mutable_chunk()->set_field(p.field);
    message_.mutable_chunk()->set_data(p.data.data() + offset_, n);
    offset_ += n;
    return &message_;
  }

  struct Part {
    v1::TensorField field;
    std::string data;
  };
  const int64_t chunk_bytes_;
  v1::BackwardRequest request_;
  v1::BackwardResponseChunk message_;
  std::vector<Part> parts_;
  size_t part_ = 0, offset_ = 0;
  bool sent_header_ = false;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* LossServiceImpl::ForwardStream(Context* context,
                                                                          Bytes* response) {
  auto* reactor = new ForwardStreamReactor(
      context, response, metrics_, limits_.max_message_bytes, limits_.max_stream_request_bytes,
      [this](ForwardStreamReactor* r) {
        StartForward(r, r->principal(), r->request(), r->forward_response());
      });
  reactor->Begin(Admit(context), admission_);
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LossServiceImpl::BackwardStream(Context* context,
                                                                            const Bytes* in) {
  auto* reactor = new BackwardStreamReactor(context, metrics_, limits_.max_message_bytes,
                                            limits_.stream_chunk_bytes());
  absl::StatusOr<std::string> principal = Authenticate(context);
  if (!principal.ok()) {
    reactor->Reply(principal.status());
    return reactor;
  }
  absl::Status parsed = reactor->ParseRequest(*in, *admission_, *principal, reactor->request());
  if (!parsed.ok()) {
    reactor->Reply(parsed);
    return reactor;
  }
  auto outcome = std::make_shared<BackwardOutcome>();
  auto stats = std::make_shared<CallStats>();
  StartBackward(reactor, *principal, reactor->request(), /*max_response_bytes=*/0, outcome, stats,
                [this, reactor, outcome, stats](const absl::Status& status) {
                  if (status.ok()) core_->Answered(*outcome);
                  reactor->Start(status, *outcome, stats->queue_ms, stats->engine_ms);
                });
  return reactor;
}

}  // namespace flce
