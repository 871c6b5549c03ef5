// flce: command-line client for flce_server.
//
//   flce info                          server version, backend, devices, limits
//   flce health                        grpc.health.v1 status; exit 0 if SERVING
//   flce stats [--raw]                 requests, latency, memory (GetStats)
//   flce smoke [--n ... --matrix]      random problem → Forward + Backward on the
//                                      server → compared with the fp64 reference
//   flce forward --hidden=x.npy --weight=w.npy --target=t.npy --out=DIR
//   flce backward --session=ID [--grad_output=g.npy] --out=DIR
//   flce release --session=ID

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/loss_client.h"
#include "client/npy.h"
#include "client/progress.h"
#include "client/stats_summary.h"
#include "common/flag_types.h"
#include "common/usage.h"
#include "kernels/reference/accuracy.h"
#include "kernels/reference/random_problem.h"
#include "kernels/status_macros.h"

ABSL_FLAG(std::string, server, "localhost:50051",
          "host:port of flce_server (a host alone: port 50051)");
ABSL_FLAG(flce::DurationFlag, timeout, flce::DurationFlag{absl::Minutes(5)},
          "deadline of each call (e.g. 30s, 5m)");
ABSL_FLAG(flce::ByteCount, max_message_bytes, flce::ByteCount{int64_t{256} << 20},
          "largest message (e.g. 256MiB)");
ABSL_FLAG(bool, tls, false, "connect over TLS (implied by the --tls_* files)");
ABSL_FLAG(std::string, tls_server_name, "",
          "TLS: the name the server's certificate must carry when it is not the host "
          "dialled (e.g. a pod dialled by IP: --tls_server_name=flce.ml.svc)");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM CAs to trust (default: the system's)");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate chain (mutual TLS)");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, token_file, "",
          "file holding the bearer token (else the FLCE_TOKEN environment variable)");
// Problem options (smoke, forward).
ABSL_FLAG(int64_t, n, 64, "smoke: rows (tokens)");
ABSL_FLAG(int64_t, h, 128, "smoke: hidden size");
ABSL_FLAG(int64_t, v, 1000, "smoke: vocabulary size");
ABSL_FLAG(std::string, dtype, "",
          "bf16, fp16 or fp32 (also bfloat16, float16, half, float32, float). smoke: the "
          "problem's (default bf16); forward: what X, W and b are sent as (default: the "
          "hidden .npy's dtype; other float inputs are converted to it)");
ABSL_FLAG(std::string, reduction, "mean", "mean, sum or none");
ABSL_FLAG(std::string, mode, "auto", "backward mode: auto, store_grads or recompute");
ABSL_FLAG(int64_t, ignore_index, -100, "target value to ignore");
ABSL_FLAG(double, ignore_fraction, 0.1, "smoke: fraction of rows ignored");
ABSL_FLAG(float, label_smoothing, 0.0f, "label smoothing in [0, 1)");
ABSL_FLAG(float, softcap, 0.0f, "logit softcap c > 0 (0: none)");
ABSL_FLAG(float, z_loss, 0.0f, "z-loss scale");
ABSL_FLAG(bool, bias, false, "smoke: use a bias");
ABSL_FLAG(bool, class_weight, false, "smoke: use random class weights");
ABSL_FLAG(double, logit_scale, 2.0, "smoke: standard deviation of the logits");
ABSL_FLAG(uint64_t, seed, 1, "smoke: random seed");
ABSL_FLAG(bool, matrix, false, "smoke: run every dtype × reduction × mode with every option on");
// forward / backward.
ABSL_FLAG(std::string, hidden, "", "forward: X [N, H] .npy");
ABSL_FLAG(std::string, weight, "", "forward: W [V, H] .npy");
ABSL_FLAG(std::string, bias_npy, "", "forward: b [V] .npy (optional)");
ABSL_FLAG(std::string, target, "", "forward: t [N] .npy (int32/int64)");
ABSL_FLAG(std::string, class_weight_npy, "", "forward: class weights [V] .npy");
ABSL_FLAG(bool, need_backward, false, "forward: keep a session for backward");
ABSL_FLAG(std::string, session, "", "backward/release: session id");
ABSL_FLAG(std::string, grad_output, "", "backward: upstream gradient .npy");
ABSL_FLAG(bool, keep_session, false, "backward: keep the session");
ABSL_FLAG(std::string, out, ".", "forward/backward: directory for .npy outputs");
ABSL_FLAG(bool, raw, false, "stats: the GetStats message in protobuf text format");

namespace flce {
namespace {

absl::StatusOr<DType> ParseDType(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::kBFloat16;
  if (s == "fp16" || s == "float16" || s == "half") return DType::kFloat16;
  if (s == "fp32" || s == "float32" || s == "float") return DType::kFloat32;
  return absl::InvalidArgumentError(
      absl::StrCat("--dtype: unknown '", s,
                   "'; choose bf16, fp16 or fp32 (also written bfloat16, float16 or half, "
                   "float32 or float)"));
}

absl::StatusOr<Reduction> ParseReduction(const std::string& s) {
  if (s == "mean") return Reduction::kMean;
  if (s == "sum") return Reduction::kSum;
  if (s == "none") return Reduction::kNone;
  return absl::InvalidArgumentError(
      absl::StrCat("--reduction: unknown '", s, "'; choose mean, sum or none"));
}

absl::StatusOr<BackwardMode> ParseMode(const std::string& s) {
  if (s == "auto") return BackwardMode::kAuto;
  if (s == "store_grads") return BackwardMode::kStoreGrads;
  if (s == "recompute") return BackwardMode::kRecompute;
  return absl::InvalidArgumentError(
      absl::StrCat("--mode: unknown '", s, "'; choose auto, store_grads or recompute"));
}

absl::StatusOr<LossOptions> OptionsFromFlags() {
  LossOptions o;
  auto reduction = ParseReduction(absl::GetFlag(FLAGS_reduction));
  if (!reduction.ok()) return reduction.status();
  o.reduction = *reduction;
  o.ignore_index = absl::GetFlag(FLAGS_ignore_index);
  o.label_smoothing = absl::GetFlag(FLAGS_label_smoothing);
  if (absl::GetFlag(FLAGS_softcap) != 0.0f) o.logit_softcap = absl::GetFlag(FLAGS_softcap);
  o.z_loss_scale = absl::GetFlag(FLAGS_z_loss);
  return o;
}

// The contents of `path` without trailing whitespace; exits naming `flag`
// if it cannot be read.
std::string ReadOrDie(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "error: %s: cannot read %s\n", flag, path.c_str());
    std::exit(1);
  }
  std::stringstream text;
  text << in.rdbuf();
  std::string s = text.str();
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

std::unique_ptr<LossClient> MakeClient() {
  ClientOptions options;
  options.timeout = absl::GetFlag(FLAGS_timeout).value;
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes).bytes;
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  const std::string ca = absl::GetFlag(FLAGS_tls_ca_file);
  const std::string cert = absl::GetFlag(FLAGS_tls_cert_file);
  const std::string key = absl::GetFlag(FLAGS_tls_key_file);
  options.tls =
      absl::GetFlag(FLAGS_tls) || !ca.empty() || !cert.empty() || !options.tls_server_name.empty();
  if (!ca.empty()) options.tls_root_certs = ReadOrDie(ca, "--tls_ca_file");
  if (!cert.empty()) options.tls_client_cert = ReadOrDie(cert, "--tls_cert_file");
  if (!key.empty()) options.tls_client_key = ReadOrDie(key, "--tls_key_file");
  const std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (!token_file.empty()) {
    options.token = ReadOrDie(token_file, "--token_file");
  } else if (const char* token = std::getenv("FLCE_TOKEN")) {
    options.token = token;
  }
  return LossClient::Create(absl::GetFlag(FLAGS_server), options);
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  if (status.code() == absl::StatusCode::kUnavailable) {
    std::fprintf(stderr,
                 "hint: is flce_server running at %s (--server=host:port), and does it speak "
                 "what this client does (TLS: --tls_ca_file, --tls_server_name; plaintext: "
                 "neither)?\n",
                 WithDefaultPort(absl::GetFlag(FLAGS_server)).c_str());
  } else if (status.code() == absl::StatusCode::kUnimplemented && status.message().empty()) {
    std::fprintf(stderr,
                 "hint: %s does not serve flce.v1.LossService (a --health_address port "
                 "serves only health); use the server's --listen_address\n",
                 absl::GetFlag(FLAGS_server).c_str());
  }
  return 1;
}

int Info() {
  auto info = MakeClient()->GetServerInfo();
  if (!info.ok()) return Fail(info.status());
  std::printf("version          %s\nbackend          %s\n", info->version().c_str(),
              info->backend().c_str());
  for (const auto& d : info->devices()) {
    std::printf("device           %s (%lld bytes)\n", d.name().c_str(),
                static_cast<long long>(d.total_memory_bytes()));
  }
  const auto& l = info->limits();
  std::printf(
      "max_sessions     %lld\nsession_memory   %lld bytes\nsession_ttl      %.0f s\n"
      "max_message      %lld bytes\nmax_queued       %lld\nlive_sessions    %lld\n"
      "session_bytes    %lld\nrunning          %lld\nqueued           %lld\n",
      static_cast<long long>(l.max_sessions()),
      static_cast<long long>(l.session_memory_budget_bytes()), l.session_ttl_seconds(),
      static_cast<long long>(l.max_message_bytes()),
      static_cast<long long>(l.max_queued_requests()),
      static_cast<long long>(info->live_sessions()),
      static_cast<long long>(info->session_memory_bytes()),
      static_cast<long long>(info->running_requests()),
      static_cast<long long>(info->queued_requests()));
  return 0;
}

// GetStats as a summary; with --raw, in protobuf text format.
int Stats() {
  auto stats = MakeClient()->GetStats();
  if (!stats.ok()) return Fail(stats.status());
  const std::string text = absl::GetFlag(FLAGS_raw) ? stats->DebugString() : StatsSummary(*stats);
  std::printf("%s", text.c_str());
  return 0;
}

int Health() {
  auto status = MakeClient()->CheckHealth("flce.v1.LossService");
  if (!status.ok()) return Fail(status.status());
  std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status).c_str());
  return *status == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

// One smoke case: Forward + Backward on the server, judged against fp64.
bool SmokeOne(LossClient& client, const RandomProblemSpec& spec, BackwardMode mode) {
  Progress progress;
  progress.Phase(
      absl::StrFormat("making a random %lldx%lldx%lld problem", static_cast<long long>(spec.rows),
                      static_cast<long long>(spec.hidden), static_cast<long long>(spec.vocab)));
  const OwnedProblem p = MakeRandomProblem(spec);
  ForwardArgs f;
  f.problem = p.view();
  f.need_backward = true;
  f.mode = mode;
  f.want_lse = true;
  const std::string title = absl::StrFormat(
      "%s %lldx%lldx%lld reduction=%s mode=%s%s%s%s%s%s", DTypeName(spec.dtype),
      static_cast<long long>(spec.rows), static_cast<long long>(spec.hidden),
      static_cast<long long>(spec.vocab), ReductionName(spec.options.reduction),
      BackwardModeName(mode), spec.bias ? " bias" : "", spec.class_weight ? " class_weight" : "",
      spec.options.label_smoothing > 0 ? " smoothing" : "",
      spec.options.logit_softcap ? " softcap" : "", spec.options.z_loss_scale > 0 ? " z_loss" : "");
  progress.Phase("Forward on the server");
  auto fwd = client.Forward(f);
  if (!fwd.ok()) {
    progress.Done();
    std::printf("FAIL %s: Forward: %s\n", title.c_str(), fwd.status().ToString().c_str());
    return false;
  }
  // A random upstream gradient, as fp32 on the wire.
  std::mt19937_64 rng(spec.seed + 1);
  std::uniform_real_distribution<float> dist(0.5f, 2.0f);
  const bool per_row = spec.options.reduction == Reduction::kNone;
  HostTensor g(DType::kFloat32, per_row ? std::vector<int64_t>{spec.rows} : std::vector<int64_t>{});
  std::vector<double> g_values;
  for (int64_t i = 0; i < g.num_elements(); ++i) {
    g.mutable_data<float>()[i] = dist(rng);
    g_values.push_back(g.data_as<float>()[i]);
  }
  BackwardArgs b;
  b.session_id = fwd->session_id;
  b.grad_output = g.view();
  progress.Phase("Backward on the server");
  auto grads = client.Backward(b);
  if (!grads.ok()) {
    progress.Done();
    std::printf("FAIL %s: Backward: %s\n", title.c_str(), grads.status().ToString().c_str());
    return false;
  }
  const EngineOutputs out = CollectOutputs(*fwd, &*grads);
  progress.Phase("computing the fp64 reference here");
  const absl::Time reference_start = absl::Now();
  const AccuracyReport report =
      CheckAccuracy(p.view(), g_values, out, [&](double f) { progress.Fraction(f); });
  const double reference_s = absl::ToDoubleSeconds(absl::Now() - reference_start);
  progress.Done();
  std::printf("%s %s\n", report.ok() ? "PASS" : "FAIL", title.c_str());
  double loss_total = 0;
  for (float l : out.loss) loss_total += l;
  std::printf(
      "  loss %.6g%s  valid %lld  correct %lld  session mode %s\n"
      "  forward: rpc %.1f ms (engine %.1f, queue %.1f)  backward: rpc %.1f ms "
      "(engine %.1f, queue %.1f)  reference (here): %.1f s\n",
      loss_total, per_row ? " (sum of per-row losses)" : "", static_cast<long long>(fwd->num_valid),
      static_cast<long long>(fwd->num_correct), BackwardModeName(fwd->mode), fwd->times.rpc_ms,
      fwd->times.engine_ms, fwd->times.queue_ms, grads->times.rpc_ms, grads->times.engine_ms,
      grads->times.queue_ms, reference_s);
  std::string lines = report.ToString();
  std::printf("%s", lines.c_str());
  return report.ok();
}

int Smoke() {
  auto options = OptionsFromFlags();
  if (!options.ok()) return Fail(options.status());
  auto mode = ParseMode(absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) return Fail(mode.status());
  const std::string dtype_flag = absl::GetFlag(FLAGS_dtype);
  auto dtype = ParseDType(dtype_flag.empty() ? "bf16" : dtype_flag);
  if (!dtype.ok()) return Fail(dtype.status());
  RandomProblemSpec spec;
  spec.rows = absl::GetFlag(FLAGS_n);
  spec.hidden = absl::GetFlag(FLAGS_h);
  spec.vocab = absl::GetFlag(FLAGS_v);
  spec.dtype = *dtype;
  spec.options = *options;
  spec.ignore_fraction = absl::GetFlag(FLAGS_ignore_fraction);
  spec.bias = absl::GetFlag(FLAGS_bias);
  spec.class_weight = absl::GetFlag(FLAGS_class_weight);
  spec.logit_scale = absl::GetFlag(FLAGS_logit_scale);
  spec.seed = absl::GetFlag(FLAGS_seed);
  auto client = MakeClient();
  int passed = 0, failed = 0;
  if (!absl::GetFlag(FLAGS_matrix)) {
    (SmokeOne(*client, spec, *mode) ? passed : failed)++;
  } else {
    // Every dtype, reduction and mode, with every option on.
    spec.bias = true;
    spec.class_weight = true;
    if (spec.options.label_smoothing == 0) spec.options.label_smoothing = 0.1f;
    if (!spec.options.logit_softcap) spec.options.logit_softcap = 30.0f;
    if (spec.options.z_loss_scale == 0) spec.options.z_loss_scale = 1e-4f;
    for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
        for (BackwardMode m : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
          if (r == Reduction::kNone && m == BackwardMode::kStoreGrads) continue;
          RandomProblemSpec s = spec;
          s.dtype = d;
          s.options.reduction = r;
          ++s.seed;
          spec.seed = s.seed;
          (SmokeOne(*client, s, m) ? passed : failed)++;
        }
      }
    }
  }
  std::printf("%s: %d passed, %d failed\n", failed == 0 ? "PASS" : "FAIL", passed, failed);
  return failed == 0 ? 0 : 1;
}

absl::StatusOr<HostTensor> ReadInput(const std::string& path, const char* flag) {
  if (path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " is required"));
  }
  return ReadNpy(path);
}

// `t` as `to` (a float tensor; other dtypes are left for the server to
// refuse), saying so on stderr when it converts.
HostTensor ConvertTo(HostTensor t, DType to, const char* flag, const char* why) {
  if (!IsFloating(t.dtype) || t.dtype == to) return t;
  std::fprintf(stderr, "note: --%s is %s; sending it as %s (%s)\n", flag, DTypeName(t.dtype),
               DTypeName(to), why);
  const std::vector<float> values = TensorToFloats(t.view());
  HostTensor converted(to, t.shape);
  FromFloat(to, values.data(), t.num_elements(), &converted.data[0]);
  return converted;
}

absl::Status Save(const std::string& name, const HostTensor& t) {
  const std::string path = absl::StrCat(absl::GetFlag(FLAGS_out), "/", name, ".npy");
  absl::Status s = WriteNpy(path, t.view());
  if (s.ok()) {
    std::printf("wrote %s (%s %s)\n", path.c_str(), ShapeString(t.shape).c_str(),
                DTypeName(t.dtype));
  }
  return s;
}

absl::Status ForwardCommand() {
  auto options = OptionsFromFlags();
  if (!options.ok()) return options.status();
  auto mode = ParseMode(absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) return mode.status();
  auto hidden = ReadInput(absl::GetFlag(FLAGS_hidden), "hidden");
  if (!hidden.ok()) return hidden.status();
  // X, W and b go as one dtype: --dtype, else the hidden states'.
  const std::string dtype_flag = absl::GetFlag(FLAGS_dtype);
  DType dtype = hidden->dtype;
  const char* why = "the hidden states' dtype; --dtype chooses another";
  if (!dtype_flag.empty()) {
    auto parsed = ParseDType(dtype_flag);
    if (!parsed.ok()) return parsed.status();
    dtype = *parsed;
    why = "--dtype";
  }
  *hidden = ConvertTo(*std::move(hidden), dtype, "hidden", "--dtype");
  auto weight = ReadInput(absl::GetFlag(FLAGS_weight), "weight");
  if (!weight.ok()) return weight.status();
  *weight = ConvertTo(*std::move(weight), dtype, "weight", why);
  auto target = ReadInput(absl::GetFlag(FLAGS_target), "target");
  if (!target.ok()) return target.status();
  ForwardArgs f;
  f.problem.hidden = hidden->view();
  f.problem.weight = weight->view();
  f.problem.target = target->view();
  std::optional<HostTensor> bias, class_weight;
  if (!absl::GetFlag(FLAGS_bias_npy).empty()) {
    auto b = ReadInput(absl::GetFlag(FLAGS_bias_npy), "bias_npy");
    if (!b.ok()) return b.status();
    bias = ConvertTo(*std::move(b), dtype, "bias_npy", why);
    f.problem.bias = bias->view();
  }
  if (!absl::GetFlag(FLAGS_class_weight_npy).empty()) {
    auto c = ReadInput(absl::GetFlag(FLAGS_class_weight_npy), "class_weight_npy");
    if (!c.ok()) return c.status();
    class_weight =
        ConvertTo(*std::move(c), DType::kFloat32, "class_weight_npy", "class weights are fp32");
    f.problem.class_weight = class_weight->view();
  }
  f.problem.options = *options;
  f.need_backward = absl::GetFlag(FLAGS_need_backward);
  f.mode = *mode;
  f.want_lse = true;
  f.want_per_row_loss = true;
  Progress progress;
  progress.Phase("Forward on the server");
  auto fwd = MakeClient()->Forward(f);
  progress.Done();
  if (!fwd.ok()) return fwd.status();
  if (fwd->loss.num_elements() == 1) {
    std::printf("loss %.9g\n", fwd->loss.data_as<float>()[0]);
  }
  std::printf("num_valid %lld num_correct %lld engine %.1f ms\n",
              static_cast<long long>(fwd->num_valid), static_cast<long long>(fwd->num_correct),
              fwd->times.engine_ms);
  if (!fwd->session_id.empty()) {
    std::printf("session %s (%s)\n", fwd->session_id.c_str(), BackwardModeName(fwd->mode));
  } else {
    std::fprintf(stderr,
                 "note: no session kept; add --need_backward to run 'flce backward' on this "
                 "loss\n");
  }
  for (auto s : {Save("loss", fwd->loss), Save("z_loss", fwd->z_loss), Save("lse", *fwd->lse),
                 Save("per_row_loss", *fwd->per_row_loss)}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status RequireSession() {
  if (!absl::GetFlag(FLAGS_session).empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      "--session is required: the id 'flce forward --need_backward' printed");
}

absl::Status BackwardCommand() {
  FLCE_RETURN_IF_ERROR(RequireSession());
  BackwardArgs b;
  b.session_id = absl::GetFlag(FLAGS_session);
  b.keep_session = absl::GetFlag(FLAGS_keep_session);
  std::optional<HostTensor> g;
  if (!absl::GetFlag(FLAGS_grad_output).empty()) {
    auto read = ReadNpy(absl::GetFlag(FLAGS_grad_output));
    if (!read.ok()) return read.status();
    g = std::move(*read);
    b.grad_output = g->view();
  }
  Progress progress;
  progress.Phase("Backward on the server");
  auto grads = MakeClient()->Backward(b);
  progress.Done();
  if (!grads.ok()) return grads.status();
  std::printf("engine %.1f ms\n", grads->times.engine_ms);
  absl::Status s = Save("grad_hidden", grads->grad_hidden);
  if (s.ok() && grads->grad_weight) s = Save("grad_weight", *grads->grad_weight);
  if (s.ok() && grads->grad_bias) s = Save("grad_bias", *grads->grad_bias);
  return s;
}

absl::Status ReleaseCommand() {
  FLCE_RETURN_IF_ERROR(RequireSession());
  auto released = MakeClient()->ReleaseSession(absl::GetFlag(FLAGS_session));
  if (!released.ok()) return released.status();
  std::printf("%s\n", *released ? "released" : "no such live session");
  return absl::OkStatus();
}

}  // namespace
}  // namespace flce

int main(int argc, char** argv) {
  flce::InitUsage("flce",
                  "flce COMMAND [--flags]: the command-line client of flce_server\n"
                  "commands:\n"
                  "  info       the server's version, backend, devices and limits\n"
                  "  health     grpc.health.v1 status; exit 0 if SERVING\n"
                  "  stats      requests, errors, latency, tokens/s, memory (--raw: the message)\n"
                  "  smoke      a random problem on the server, checked against an fp64 reference\n"
                  "  forward    Forward on your .npy files (--hidden, --weight, --target)\n"
                  "  backward   Backward of a session (--session), gradients into --out\n"
                  "  release    free a session (--session)\n"
                  "examples:\n"
                  "  flce --server=localhost:50051 health\n"
                  "  flce smoke --dtype=bf16 --n=64 --h=128 --v=1000\n"
                  "  flce smoke --matrix\n"
                  "  flce forward --hidden=x.npy --weight=w.npy --target=t.npy --need_backward\n"
                  "  flce backward --session=ID --out=grads/");
  flce::HandleHelp(argc, argv, "client/flce_cli.cc");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
    return 2;
  }
  const std::string command = args[1];
  if (command == "info") return flce::Info();
  if (command == "health") return flce::Health();
  if (command == "stats") return flce::Stats();
  if (command == "smoke") return flce::Smoke();
  absl::Status status;
  if (command == "forward") {
    status = flce::ForwardCommand();
  } else if (command == "backward") {
    status = flce::BackwardCommand();
  } else if (command == "release") {
    status = flce::ReleaseCommand();
  } else {
    std::fprintf(stderr, "unknown command '%s'\n%s\n", command.c_str(),
                 absl::ProgramUsageMessage().data());
    return 2;
  }
  return status.ok() ? 0 : flce::Fail(status);
}
