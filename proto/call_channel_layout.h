#ifndef FLCE_PROTO_CALL_CHANNEL_LAYOUT_H_
#define FLCE_PROTO_CALL_CHANNEL_LAYOUT_H_

// The call channel (LossService.OpenCallChannel): how a same-host client
// and the server pass Forward, Backward and ReleaseSession calls through a
// POSIX shared-memory region instead of gRPC. Part of the API, like the
// .proto: the C++ client (client/call_channel_client.h) and the Python one
// (flce/call_channel.py) follow it.
//
// Layout (little-endian; every word 32 bits unless named u64):
//
//   [0, kHeaderBytes)             the header: the words below, each on its
//                                 own 64-byte line
//   [kHeaderBytes, +request)      the request area (OpenCallChannel's
//                                 request_bytes)
//   [.., +response)               the response area (response_bytes)
//
// One call at a time, numbered by the client from 1 (0 is never used;
// after 2^32 - 1 comes 1):
//
//   client: writes the serialized request message into the request area,
//           kRequestMethod, kRequestLength and kRequestTimeoutUs, then
//           stores the call's number in kRequestSeq and, after a full
//           memory barrier, wakes the server if kServerWaiting is set
//           (futex(2) FUTEX_WAKE on kRequestSeq; a server polling needs
//           none). The server sets kServerWaiting (a sequentially
//           consistent store) before it checks kRequestSeq a last time and
//           sleeps in FUTEX_WAIT on it: either the client sees it waiting
//           or the server sees the call. (Waking it always is correct too,
//           at a system call's cost.)
//   server: takes a number it has not served in kRequestSeq as a call
//           (copying the request out of the region before it reads it),
//           serves it like the RPC of kRequestMethod, writes kResponseCode
//           (a gRPC status code), kResponseLength and the response area (on
//           OK the serialized response message, otherwise the error's
//           message as UTF-8), then stores the number in kResponseSeq and,
//           if kClientWaiting is set, wakes the client (FUTEX_WAKE on
//           kResponseSeq).
//   client: waits until kResponseSeq holds the number (polling, or with
//           kClientWaiting set in FUTEX_WAIT on kResponseSeq), then reads
//           the response.
//
// Two more words let a client go on before the answer comes. The server
// stores a Forward's number in kAcceptedSeq once the call was accepted
// (validated, its session's place reserved: only the engine can fail it
// now), waking the client as for an answer; a call refused before that is
// answered without it. And it stores every call's number in kFenceSeq
// right after the answer: a client's GPU stream can wait for that word
// (cuStreamWaitValue32, cyclic >=, on the region registered with
// cudaHostRegister), so work it queues after an accepted Forward runs once
// the server's writes into its memory (gradients, loss_out) are done. A
// client that gives up on a call whose fence its GPU waits for (the server
// died) stores the fence itself.
//
// The server adds 1 to kHeartbeat every 100 ms while the channel is open,
// also while a call runs: a client that sees it stand still for seconds
// while it waits knows the server is gone.
//
// A client stores a call's number in kCancelSeq to cancel it (the answer
// is then CANCELLED, or the call's result if it had finished). The server
// stores 1 in kClosed when it closes the channel (CloseCallChannel, the
// idle timeout, shutdown, a region its owner shrank) and wakes the client;
// it serves no call whose number it had not taken before: a client that
// finds kClosed set and kResponseSeq short of its call knows the call was
// not made. A client that gives up waiting for an answer must not use the
// channel again (a late answer would land in the response area).

#include <cstdint>

namespace flce {
namespace call_channel {

// "FLCECH01" as a little-endian u64 at offset 0, written by the client
// before OpenCallChannel; the server refuses a region without it.
constexpr uint64_t kMagic = 0x3130484345434c46ull;
constexpr int64_t kHeaderBytes = 4096;
constexpr int64_t kMinAreaBytes = 4096;

constexpr int64_t kMagicOffset = 0;            // u64, client
constexpr int64_t kRequestSeqOffset = 64;      // client
constexpr int64_t kResponseSeqOffset = 128;    // server
constexpr int64_t kClientWaitingOffset = 192;  // client: 1 while in FUTEX_WAIT
constexpr int64_t kServerWaitingOffset = 256;  // server: 1 while in FUTEX_WAIT
constexpr int64_t kCancelSeqOffset = 320;      // client
constexpr int64_t kClosedOffset = 384;         // server
constexpr int64_t kRequestMethodOffset = 448;  // client: a Method
constexpr int64_t kRequestLengthOffset = 452;  // client: bytes in the request area
constexpr int64_t kRequestTimeoutUsOffset = 456;  // u64, client: 0 for no deadline
constexpr int64_t kResponseCodeOffset = 512;      // server: a gRPC status code
constexpr int64_t kResponseLengthOffset = 516;    // server: bytes in the response area
constexpr int64_t kAcceptedSeqOffset = 576;       // server
constexpr int64_t kFenceSeqOffset = 640;          // server (and a client giving up)
constexpr int64_t kHeartbeatOffset = 704;         // server

enum Method : uint32_t {
  kForward = 1,         // ForwardRequest → ForwardResponse
  kBackward = 2,        // BackwardRequest → BackwardResponse
  kReleaseSession = 3,  // ReleaseSessionRequest → ReleaseSessionResponse
};

}  // namespace call_channel
}  // namespace flce

#endif  // FLCE_PROTO_CALL_CHANNEL_LAYOUT_H_
