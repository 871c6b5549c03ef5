// flce_server: serves flce.v1.LossService. See README.md for the flags.

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/flag_types.h"
#include "common/usage.h"
#include "server/logging.h"
#include "server/loss_server.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, listen_address, "0.0.0.0:50051",
          "host:port to serve on (port 0: any free port)");
ABSL_FLAG(std::string, backend, "auto", "auto, cuda or cpu");
ABSL_FLAG(int64_t, max_sessions, 1024, "most live sessions at once");
ABSL_FLAG(flce::ByteCount, session_memory_bytes, flce::ByteCount{int64_t{16} << 30},
          "memory budget for all sessions' saved state");
ABSL_FLAG(int64_t, max_sessions_per_principal, 0,
          "most live sessions of one principal (0: only --max_sessions applies)");
ABSL_FLAG(flce::ByteCount, session_memory_bytes_per_principal, flce::ByteCount{0},
          "session memory of one principal (0: only --session_memory_bytes applies)");
ABSL_FLAG(flce::ByteCount, weight_memory_bytes, flce::ByteCount{int64_t{32} << 30},
          "memory budget for registered weights (PutWeight)");
ABSL_FLAG(flce::ByteCount, weight_device_memory_bytes,
          flce::ByteCount{flce::ServerOptions().weight_device_memory_bytes},
          "GPU memory for registered weights' device copies and fp32 gradient sums"
          "(CUDA backend); past it they are read and summed in host memory");
ABSL_FLAG(bool, enable_shared_memory, false,
          "accept tensors in same-host clients' POSIX shared memory (RegisterSharedMemory)");
ABSL_FLAG(int64_t, max_shared_memory_regions, flce::SharedMemoryLimits().max_regions,
          "shared-memory regions registered at once (at most 4096)");
ABSL_FLAG(int64_t, max_shared_memory_regions_per_principal, 0,
          "shared-memory regions of one principal (0: only --max_shared_memory_regions)");
ABSL_FLAG(flce::ByteCount, shared_memory_bytes,
          flce::ByteCount{flce::SharedMemoryLimits().max_bytes},
          "bytes all registered shared-memory regions may map");
ABSL_FLAG(flce::ByteCount, shared_memory_bytes_per_principal, flce::ByteCount{0},
          "bytes one principal's shared-memory regions may map (0: only --shared_memory_bytes)");
ABSL_FLAG(flce::ByteCount, region_memory_bytes,
          flce::ByteCount{flce::SharedMemoryLimits().max_server_bytes},
          "bytes regions of server memory may hold (RegisterSharedMemory server_memory, filled "
          "and read by WriteRegion/ReadRegion; 0: none)");
ABSL_FLAG(flce::ByteCount, region_memory_bytes_per_principal, flce::ByteCount{0},
          "bytes one principal's regions of server memory may hold (0: only "
          "--region_memory_bytes)");
ABSL_FLAG(flce::DurationFlag, region_idle_timeout,
          flce::DurationFlag{flce::SharedMemoryLimits().server_region_ttl},
          "a region of server memory no call named for this long is unregistered");
ABSL_FLAG(int64_t, max_call_channels, flce::CallChannelLimits().max_channels,
          "call channels open at once (OpenCallChannel; a server thread each; at most 1024)");
ABSL_FLAG(int64_t, max_call_channels_per_principal, 0,
          "call channels of one principal (0: only --max_call_channels)");
ABSL_FLAG(flce::DurationFlag, call_channel_spin, flce::DurationFlag{flce::CallChannelLimits().spin},
          "how long a call channel's thread polls for the next call from the moment it is due "
          "(after the gaps between the last calls) before it sleeps (a CPU core while it "
          "polls; 0s: never poll, each call then pays a thread wake-up)");
ABSL_FLAG(flce::DurationFlag, call_channel_idle_timeout,
          flce::DurationFlag{flce::CallChannelLimits().idle_timeout},
          "a call channel without a call for this long is closed");
ABSL_FLAG(int64_t, max_streams, flce::RequestLimits().max_streams,
          "ForwardStream and PutWeight streams open at once");
ABSL_FLAG(int64_t, max_streams_per_principal, 0,
          "open streams of one principal (0: only --max_streams)");
ABSL_FLAG(flce::ByteCount, request_memory_bytes,
          flce::ByteCount{flce::RequestLimits().memory_bytes},
          "bytes requests in flight may hold: unary messages and ForwardStreams' announced "
          "tensors");
ABSL_FLAG(flce::ByteCount, request_memory_bytes_per_principal, flce::ByteCount{0},
          "bytes one principal's requests in flight may hold (0: only --request_memory_bytes)");
ABSL_FLAG(flce::DurationFlag, stream_idle_timeout,
          flce::DurationFlag{flce::RequestLimits().idle_timeout},
          "a ForwardStream or PutWeight that sends no message for this long is finished");
ABSL_FLAG(flce::DurationFlag, session_ttl, flce::DurationFlag{absl::Minutes(10)},
          "idle time after which a session expires");
ABSL_FLAG(int, workers, 1, "engine calls run concurrently");
ABSL_FLAG(int, vocab_shards, 1,
          "compute every problem in this many vocabulary shards, combined in the server (the "
          "path of a server with an engine per device, on one engine); 1: off");
ABSL_FLAG(flce::ByteCount, stage_ahead_bytes,
          flce::ByteCount{flce::ServerOptions().stage_ahead_bytes},
          "GPU: device memory for the X of Forward calls (in regions of server memory) copied "
          "onto the device as they arrive, while they wait for the engine; 0: in their call");
ABSL_FLAG(int, max_queued_requests, 64,
          "requests that may wait for a worker; more are RESOURCE_EXHAUSTED");
ABSL_FLAG(flce::ByteCount, max_message_bytes, flce::ByteCount{int64_t{256} << 20},
          "largest request or response message");
ABSL_FLAG(flce::ByteCount, cpu_chunk_bytes, flce::ByteCount{flce::CpuEngineOptions().chunk_bytes},
          "CPU engine: bytes of fp32 logits per token chunk");
ABSL_FLAG(flce::ByteCount, cpu_workspace_cache_bytes,
          flce::ByteCount{flce::CpuEngineOptions().workspace_cache_bytes},
          "CPU engine: freed workspace (logits chunks, converted weights) kept for reuse");
ABSL_FLAG(bool, cpu_native_bf16, true,
          "CPU engine: bf16 inputs multiply in bf16 (oneDNN) where the CPU has bf16 dot "
          "products and they outrun fp32 there (measured at start); false: widened to fp32");
ABSL_FLAG(bool, cpu_onednn_fp32, flce::CpuEngineOptions().onednn_fp32,
          "CPU engine: fp32 GEMMs on oneDNN (false: on OpenBLAS's sgemm)");
ABSL_FLAG(int, cuda_device, flce::CudaEngineOptions().device, "CUDA engine: device ordinal");
ABSL_FLAG(std::vector<std::string>, cuda_devices, {},
          "comma-separated CUDA device ordinals: an engine on each, every problem sharded by "
          "vocabulary over them, dX's parts summed with NCCL (a device repeated: engines "
          "sharing it); overrides --cuda_device");
ABSL_FLAG(std::string, cuda_devices_mode, "shard",
          "with several --cuda_devices: shard every problem over them, or spread requests "
          "over them whole");
ABSL_FLAG(int, cuda_lanes, flce::CudaEngineOptions().lanes,
          "CUDA engine: concurrent calls (streams)");
ABSL_FLAG(flce::ByteCount, cuda_chunk_bytes, flce::ByteCount{flce::CudaEngineOptions().chunk_bytes},
          "CUDA engine: most bytes of logits (input dtype) per token chunk");
ABSL_FLAG(int64_t, cuda_min_slice_columns, flce::CudaEngineOptions().min_slice_columns,
          "CUDA engine: RECOMPUTE's backward takes all rows at once over vocabulary slices of "
          "at least this many columns when they fit --cuda_chunk_bytes, else token chunks");
ABSL_FLAG(bool, cuda_tune_gemms, flce::CudaEngineOptions().tune_gemms,
          "CUDA engine: time each GEMM shape's cuBLASLt candidates on its first call and keep "
          "the fastest that gives cuBLAS's default bits (that call waits for the trials)");
ABSL_FLAG(bool, cuda_one_pass_rows, flce::CudaEngineOptions().one_pass_rows,
          "CUDA engine: STORE_GRADS reads each logit once where it can (bf16/fp32 without "
          "label smoothing); false: always twice");
ABSL_FLAG(bool, cuda_keep_chunk_logits, flce::CudaEngineOptions().keep_chunk_logits,
          "CUDA engine: STORE_GRADS of a batch whose rows fit one logits chunk keeps the "
          "logits and makes dX and dW in Backward, dW in its final dtype; false: fp32 "
          "gradients made in Forward");
ABSL_FLAG(std::vector<std::string>, cuda_hopper_gemms, {},
          "CUDA engine: which of the GEMMs (logits,dx,dw) run flce's own Hopper GEMM instead of "
          "cuBLAS, where the device and shape allow and its output is cuBLAS's bits (checked "
          "once per shape); none by default");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain of the server: serve TLS (with --tls_key_file)");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA certificates: require client certificates they sign (mutual TLS)");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "file of '<principal> <token>' lines: require 'authorization: Bearer <token>'");
ABSL_FLAG(std::string, metrics_address, "",
          "host:port for Prometheus metrics over HTTP (GET /metrics); empty: off");
ABSL_FLAG(std::string, bulk_address, flce::ServerOptions().bulk_address,
          "host:port of the bulk HTTP port, where remote clients move the bytes of regions of "
          "server memory (large tensors) much faster than over gRPC; TLS like the server; "
          "'auto': the host of --listen_address on a free port; empty: off");
ABSL_FLAG(int, max_bulk_connections, flce::ServerOptions().max_bulk_connections,
          "connections the bulk port holds at once (a thread each)");
ABSL_FLAG(int, max_bulk_connections_per_address,
          flce::ServerOptions().max_bulk_connections_per_address,
          "connections the bulk port holds from one client address");
ABSL_FLAG(std::string, health_address, "",
          "host:port of a plaintext port with only grpc.health.v1, for probes without TLS");
ABSL_FLAG(int, max_health_watches, flce::ServerOptions().max_health_watches,
          "grpc.health.v1 Watch calls open at once on each port (ended at shutdown)");
ABSL_FLAG(bool, insecure, false,
          "serve plaintext without TLS (refused unless given; logs a warning)");
ABSL_FLAG(flce::DurationFlag, drain_timeout, flce::DurationFlag{absl::ZeroDuration()},
          "on SIGTERM/SIGINT, first refuse new work but serve existing sessions until "
          "none is left or this long (rolling upgrades); then --shutdown_grace");
ABSL_FLAG(flce::DurationFlag, shutdown_grace, flce::DurationFlag{absl::Seconds(30)},
          "on SIGTERM/SIGINT, how long RPCs in flight may take to finish");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error, critical or off");

namespace {

int g_signal_pipe[2] = {-1, -1};
std::atomic<int> g_signals{0};

// Async-signal-safe: a write to the pipe, or the exit.
void OnSignal(int signal_number) {
  if (g_signals.fetch_add(1) > 0) {
    static const char kLine[] = "received a second termination signal; exiting without finishing\n";
    if (write(STDERR_FILENO, kLine, sizeof(kLine) - 1) < 0) {
    }
    _exit(1);
  }
  const unsigned char c = static_cast<unsigned char>(signal_number);
  if (write(g_signal_pipe[1], &c, 1) < 0) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  flce::InitUsage(
      "flce_server",
      "flce_server: fused linear + cross-entropy loss over gRPC.\n"
      "  flce_server --listen_address=0.0.0.0:50051 --backend=auto \\\n"
      "      --tls_cert_file=server.crt --tls_key_file=server.key\n"
      "  flce_server --insecure --listen_address=127.0.0.1:50051   (plaintext, this host only)\n"
      "Byte counts take 17179869184 or 16GiB, durations 600s or 10m.");
  flce::HandleHelp(argc, argv, "server/main.cc");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = flce::InitLogging(absl::GetFlag(FLAGS_log_level)); !s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 2;
  }

  // Registered shared-memory regions each keep their object open.
  rlimit files;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }

  // SIGTERM/SIGINT reach a handler in whichever thread they land (threads
  // that libraries start before main, OpenBLAS's, do not block them): the
  // first wakes the main thread, a second ends the process at once.
  if (pipe2(g_signal_pipe, O_CLOEXEC) != 0) {
    std::perror("pipe2");
    return 2;
  }
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);

  flce::ServerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen_address);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.security.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.security.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.security.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  options.security.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  options.security.insecure = absl::GetFlag(FLAGS_insecure);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.health_address = absl::GetFlag(FLAGS_health_address);
  options.max_health_watches = absl::GetFlag(FLAGS_max_health_watches);
  options.bulk_address = absl::GetFlag(FLAGS_bulk_address);
  options.max_bulk_connections = absl::GetFlag(FLAGS_max_bulk_connections);
  options.max_bulk_connections_per_address = absl::GetFlag(FLAGS_max_bulk_connections_per_address);
  options.sessions.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.sessions.memory_budget_bytes = absl::GetFlag(FLAGS_session_memory_bytes).bytes;
  options.sessions.ttl = absl::GetFlag(FLAGS_session_ttl).value;
  options.sessions.max_sessions_per_principal = absl::GetFlag(FLAGS_max_sessions_per_principal);
  options.sessions.memory_bytes_per_principal =
      absl::GetFlag(FLAGS_session_memory_bytes_per_principal).bytes;
  options.weight_memory_bytes = absl::GetFlag(FLAGS_weight_memory_bytes).bytes;
  options.weight_device_memory_bytes = absl::GetFlag(FLAGS_weight_device_memory_bytes).bytes;
  options.enable_shared_memory = absl::GetFlag(FLAGS_enable_shared_memory);
  options.shared_memory.max_regions = absl::GetFlag(FLAGS_max_shared_memory_regions);
  options.shared_memory.max_regions_per_principal =
      absl::GetFlag(FLAGS_max_shared_memory_regions_per_principal);
  options.shared_memory.max_bytes = absl::GetFlag(FLAGS_shared_memory_bytes).bytes;
  options.shared_memory.max_bytes_per_principal =
      absl::GetFlag(FLAGS_shared_memory_bytes_per_principal).bytes;
  options.shared_memory.max_server_bytes = absl::GetFlag(FLAGS_region_memory_bytes).bytes;
  options.shared_memory.max_server_bytes_per_principal =
      absl::GetFlag(FLAGS_region_memory_bytes_per_principal).bytes;
  options.shared_memory.server_region_ttl = absl::GetFlag(FLAGS_region_idle_timeout).value;
  options.call_channels.max_channels = absl::GetFlag(FLAGS_max_call_channels);
  options.call_channels.max_channels_per_principal =
      absl::GetFlag(FLAGS_max_call_channels_per_principal);
  options.call_channels.spin = absl::GetFlag(FLAGS_call_channel_spin).value;
  options.call_channels.idle_timeout = absl::GetFlag(FLAGS_call_channel_idle_timeout).value;
  options.requests.max_streams = absl::GetFlag(FLAGS_max_streams);
  options.requests.max_streams_per_principal = absl::GetFlag(FLAGS_max_streams_per_principal);
  options.requests.memory_bytes = absl::GetFlag(FLAGS_request_memory_bytes).bytes;
  options.requests.memory_bytes_per_principal =
      absl::GetFlag(FLAGS_request_memory_bytes_per_principal).bytes;
  options.requests.idle_timeout = absl::GetFlag(FLAGS_stream_idle_timeout).value;
  options.workers = absl::GetFlag(FLAGS_workers);
  options.max_queued_requests = absl::GetFlag(FLAGS_max_queued_requests);
  options.stage_ahead_bytes = absl::GetFlag(FLAGS_stage_ahead_bytes).bytes;
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes).bytes;
  options.engine.vocab_shards = absl::GetFlag(FLAGS_vocab_shards);
  options.engine.cpu.chunk_bytes = absl::GetFlag(FLAGS_cpu_chunk_bytes).bytes;
  options.engine.cpu.workspace_cache_bytes = absl::GetFlag(FLAGS_cpu_workspace_cache_bytes).bytes;
  options.engine.cpu.bf16_gemms =
      absl::GetFlag(FLAGS_cpu_native_bf16) ? flce::Bf16Gemms::kWhereFaster : flce::Bf16Gemms::kNever;
  options.engine.cpu.onednn_fp32 = absl::GetFlag(FLAGS_cpu_onednn_fp32);
  options.engine.cuda.device = absl::GetFlag(FLAGS_cuda_device);
  for (const std::string& device : absl::GetFlag(FLAGS_cuda_devices)) {
    int ordinal = -1;
    if (!absl::SimpleAtoi(device, &ordinal) || ordinal < 0) {
      std::fprintf(stderr, "--cuda_devices: '%s' is not a device ordinal\n", device.c_str());
      return 2;
    }
    options.engine.cuda_devices.push_back(ordinal);
  }
  options.engine.cuda_devices_mode = absl::GetFlag(FLAGS_cuda_devices_mode);
  options.engine.cuda.lanes = absl::GetFlag(FLAGS_cuda_lanes);
  options.engine.cuda.chunk_bytes = absl::GetFlag(FLAGS_cuda_chunk_bytes).bytes;
  options.engine.cuda.min_slice_columns = absl::GetFlag(FLAGS_cuda_min_slice_columns);
  options.engine.cuda.tune_gemms = absl::GetFlag(FLAGS_cuda_tune_gemms);
  options.engine.cuda.one_pass_rows = absl::GetFlag(FLAGS_cuda_one_pass_rows);
  options.engine.cuda.keep_chunk_logits = absl::GetFlag(FLAGS_cuda_keep_chunk_logits);
  if (std::string error; !flce::ParseHopperGemmForms(absl::GetFlag(FLAGS_cuda_hopper_gemms),
                                                      &options.engine.cuda.hopper_gemms, &error)) {
    std::fprintf(stderr, "--cuda_hopper_gemms: %s\n", error.c_str());
    return 2;
  }

  absl::StatusOr<std::unique_ptr<flce::LossServer>> server = flce::LossServer::Start(options);
  if (!server.ok()) {
    SPDLOG_CRITICAL("cannot start: {}", server.status().ToString());
    return 1;
  }
  unsigned char signal_number = 0;
  while (read(g_signal_pipe[0], &signal_number, 1) != 1 && errno == EINTR) {
  }
  SPDLOG_INFO("received {}; shutting down", strsignal(signal_number));
  // A shutdown that overruns its phases ends the process too: stopping
  // never waits on a stuck call.
  const absl::Duration drain = absl::GetFlag(FLAGS_drain_timeout).value;
  const absl::Duration grace = absl::GetFlag(FLAGS_shutdown_grace).value;
  std::thread([limit = drain + grace + absl::Seconds(10)] {
    absl::SleepFor(limit);
    const std::string line =
        absl::StrCat("shutdown did not finish within ", absl::FormatDuration(limit), "; exiting\n");
    if (write(STDERR_FILENO, line.data(), line.size()) < 0) {
    }
    _exit(1);
  }).detach();
  if (drain > absl::ZeroDuration()) (*server)->Drain(drain);
  (*server)->Shutdown(grace);
  return 0;
}
