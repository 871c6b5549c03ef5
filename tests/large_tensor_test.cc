// A hidden-state tensor above protobuf's 2 GiB message ceiling goes through
// ForwardStream and its gradient comes back through BackwardStream, bit for
// bit what the engine computes in process. Needs ~10 GiB of memory: runs
// alone (tag exclusive).

#include <memory>

#include "client/loss_client.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_engine.h"
#include "kernels/reference/random_problem.h"
#include "proto/crc32c.h"
#include "server/loss_server.h"

namespace flce {
namespace {

TEST(LargeTensorTest, HiddenStatesAboveTwoGiBStreamBothWays) {
  RandomProblemSpec spec;
  spec.rows = 1025;
  spec.hidden = int64_t{1} << 20;
  spec.vocab = 3;
  spec.dtype = DType::kBFloat16;
  spec.fast_fill = true;
  spec.options.reduction = Reduction::kSum;
  const OwnedProblem p = MakeRandomProblem(spec);
  ASSERT_GT(p.hidden.data.size(), size_t{1} << 31);

  // What the engine computes in process, remembered by checksum.
  uint32_t expected_dx_crc;
  float expected_loss;
  {
    CpuEngine engine;
    ForwardSpec fs;
    fs.need_backward = true;
    auto fwd = engine.Forward(p.view(), fs, nullptr);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    expected_loss = fwd->loss.data_as<float>()[0];
    BackwardSpec bs;
    bs.last_use = true;
    auto grads = engine.Backward(*fwd->saved, bs, nullptr);
    ASSERT_TRUE(grads.ok()) << grads.status();
    expected_dx_crc = Crc32c(0, grads->grad_hidden.data.data(), grads->grad_hidden.data.size());
  }

  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.security.insecure = true;
  options.backend = "cpu";
  auto server = LossServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = LossClient::Create("127.0.0.1:" + std::to_string((*server)->port()));
  ForwardArgs args;
  args.problem = p.view();
  args.need_backward = true;
  args.mode = BackwardMode::kStoreGrads;
  auto fwd = client->Forward(args);  // 2 GiB of hidden: streamed
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(fwd->loss.data_as<float>()[0], expected_loss);
  BackwardArgs b;
  b.session_id = fwd->session_id;
  auto grads = client->Backward(b);  // 2 GiB of dX: streamed
  ASSERT_TRUE(grads.ok()) << grads.status();
  ASSERT_EQ(grads->grad_hidden.data.size(), p.hidden.data.size());
  EXPECT_EQ(Crc32c(0, grads->grad_hidden.data.data(), grads->grad_hidden.data.size()),
            expected_dx_crc);
}

}  // namespace
}  // namespace flce
