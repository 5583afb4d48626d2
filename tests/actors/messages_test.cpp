// Every message type survives CAF's binary serialization unchanged.

#include "actors/cluster.hpp"
#include "messages/session_id.hpp"
#include "model/base/error.hpp"
#include "tests/support.hpp"

#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>

#include <set>

namespace strata {
namespace {

struct Messages : ::testing::Test {
  actors::actor_config cfg;
  caf::actor_system sys{cfg};

  template <class T>
  T round_trip(T x) {
    std::vector<char> buf;
    caf::binary_serializer sink{sys, buf};
    EXPECT_FALSE(sink(x));
    T y;
    caf::binary_deserializer source{sys, buf};
    EXPECT_FALSE(source(y));
    EXPECT_EQ(caf::deep_to_string(x), caf::deep_to_string(y));
    return y;
  }
};

msg::cache_recipe recipe() {
  return {"llama", "builtin:tiny", "f32", "f32", 5, 2, 8};
}

TEST_F(Messages, TensorBlobCopiesOnceEachWay) {
  model::Activation a{2, 3, {1, 2, 3, 4, 5, 6.5f}};
  auto b = round_trip(msg::tensor_blob::from(a));
  EXPECT_EQ(b.shape, (std::vector<int64_t>{2, 3}));
  auto back = b.to_activation();
  EXPECT_EQ(back.data, a.data);
  b.bytes.pop_back();
  EXPECT_MODEL_ERROR(b.to_activation(), model::errc::bad_shape, "expected 24");
}

TEST_F(Messages, EveryTypeRoundTrips) {
  auto echo = caf::actor_cast<msg::shard_actor>(sys.spawn([](int) { return caf::behavior{[](int) {}}; }, 0));
  msg::hop h{echo, 0, 2};
  auto r = round_trip(recipe());
  EXPECT_EQ(r, recipe());
  EXPECT_EQ(round_trip(h).shard, echo);
  msg::route_info ri{7, {h, msg::hop{echo, 3, 4}}, recipe()};
  EXPECT_EQ(round_trip(ri).hops.size(), 2u);
  round_trip(msg::sampling_state{0.7f, 40, 0.9f, 123456789});
  msg::step_request req;
  req.session = msg::mint_session_id("s");
  req.key = msg::mint_session_key();
  req.epoch = 3;
  req.step_id = 9;
  req.mode = 1;
  req.past_len = 4;
  req.positions = {4};
  req.tokens = {42};
  req.hidden = msg::tensor_blob::from(model::Activation{1, 2, {0.5f, -1}});
  req.recipe = recipe();
  req.route = ri.hops;
  req.hop_index = 1;
  req.sampling = {1.0f, 0, 1.0f, 99};
  auto req2 = round_trip(req);
  EXPECT_EQ(req2.hidden.bytes, req.hidden.bytes);
  EXPECT_EQ(req2.key, req.key);
  EXPECT_EQ(req2.session, req.session);
  msg::model_facts facts{"qwen2", "builtin:qwen2-0.5b", 24, 151936, 32768, -1, {151643, 151645}, ""};
  EXPECT_EQ(round_trip(facts), facts);
  msg::step_reply rep{"s-1", 3, 9, 1, -1, 0, 5, 2, "why"};
  EXPECT_EQ(round_trip(rep).detail, "why");
  msg::shard_stats st{0, 2, 4096, 3, 10, {0, 1, 2, 3, 4, 5, 6}, 2, 11, 1};
  EXPECT_EQ(round_trip(st).misses.size(), 7u);
  round_trip(msg::token_event{"s-1", 3, 77});
  msg::generation_result g{"s-1", {1, 2, 3}, "stop", 1.5, 9.0, 4, 1, 0, {0, 0, 1, 0, 0, 0, 0}, 2, 17};
  EXPECT_EQ(round_trip(g).ids, g.ids);
  msg::generation_request gr{"s-1", {1, 5}, 10, {0, 0, 1, 0}, {2}};
  EXPECT_EQ(round_trip(gr).prompt, gr.prompt);
  caf::anon_send_exit(echo, caf::exit_reason::user_shutdown);
}

TEST_F(Messages, MintedIdsAndKeysAreUniqueAndWellFormed) {
  std::set<std::string> ids;
  std::set<std::pair<uint64_t, uint64_t>> keys;
  for (int i = 0; i < 10000; ++i) {
    const auto id = msg::mint_session_id("cli");
    ASSERT_EQ(id.size(), 4u + 32u) << id;
    ASSERT_EQ(id.rfind("cli-", 0), 0u);
    ASSERT_TRUE(msg::valid_session_id(id));
    ids.insert(id);
    const auto k = msg::mint_session_key();
    ASSERT_FALSE(k.empty());
    keys.insert({k.hi, k.lo});
  }
  EXPECT_EQ(ids.size(), 10000u);
  EXPECT_EQ(keys.size(), 10000u);
  EXPECT_FALSE(msg::valid_session_id(""));
  EXPECT_FALSE(msg::valid_session_id(std::string(129, 'a')));
  EXPECT_FALSE(msg::valid_session_id("has space"));
}

TEST_F(Messages, ErrorsRenderWithTheirCategory) {
  auto e = caf::make_error(ec::stale_epoch, "epoch 3 < 5");
  const auto text = sys.render(e);
  EXPECT_NE(text.find("stale_epoch"), std::string::npos) << text;
  EXPECT_NE(text.find("epoch 3 < 5"), std::string::npos) << text;
}

} // namespace
} // namespace strata
