// The copy engine: every submitted copy lands with the right bytes whatever the order and delays,
// Wait returns only once the bytes are there (and the source's error when the read failed),
// the link is paced at least as the model says, and destruction with copies queued is clean.
// Real sources over real files throughout; failures come from real faults (an index the model
// lacks, a weight file that shrank).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "keel/moe/copy_engine.h"
#include "keel/moe/expert_source.h"
#include "tests/moe/moe_test_model.h"

namespace keel::moe {
namespace {

using engine::Model;
using test::DiskTempDir;
using test::Slot;
using test::SlotMismatch;

// A real source behind a gate: reads wait until the test opens it, and the order in which the
// link asked for experts is recorded. Lets tests queue copies behind a read deterministically.
class GatedSource final : public ExpertSource {
 public:
  explicit GatedSource(ExpertSource& inner) : inner_(inner) {}
  std::string name() const override { return "gated " + inner_.name(); }
  Status Read(int layer, int expert, uint8_t* dst) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++waiting_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
    order_.emplace_back(layer, expert);
    lock.unlock();
    return inner_.Read(layer, expert, dst);
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  // Blocks until some read has reached the gate.
  void AwaitReader() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return waiting_ > 0; });
  }
  std::vector<std::pair<int, int>> order() {
    std::lock_guard<std::mutex> lock(mu_);
    return order_;
  }

 private:
  ExpertSource& inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  int waiting_ = 0;
  std::vector<std::pair<int, int>> order_;
};

class CopyEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (dir_.path().empty()) GTEST_SKIP() << "no scratch directory on a disk file system";
    auto path = test::WriteTinyMoe(dir_.path(), kLayers, kExperts, 50, 40, DType::kBF16, 11);
    ASSERT_TRUE(path.ok()) << path.status().ToString();
    path_ = *path;
    auto m = test::MoeViewsFromSafetensors(path_);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m);
    layout_ = LayoutOf(model_.layers[0].moe.experts[0]);
    auto dram = MakeDramSource(model_);
    ASSERT_TRUE(dram.ok()) << dram.status().ToString();
    dram_ = std::move(*dram);
  }

  static constexpr int kLayers = 3, kExperts = 6;
  DiskTempDir dir_;
  std::string path_;
  Model model_;
  ExpertLayout layout_;
  std::unique_ptr<ExpertSource> dram_;
};

TEST_F(CopyEngineTest, ManyCopiesWithJitterAndReorderAllLandExactly) {
  auto direct = MakeDirectFileSource(model_);
  ASSERT_TRUE(direct.ok()) << direct.status().ToString();
  for (ExpertSource* src : {dram_.get(), direct->get()}) {
    CopyModel cm;
    cm.bandwidth_bytes_per_s = 2e9;
    cm.jitter_s = 0.0005;
    cm.reorder = true;
    cm.seed = 42;
    CopyEngine engine(*src, layout_.bytes, cm);
    constexpr int kCopies = 120;
    std::vector<std::unique_ptr<Slot>> slots;
    std::vector<CopyEngine::Ticket> tickets;
    std::vector<std::pair<int, int>> which;
    for (int i = 0; i < kCopies; ++i) {
      const int l = i % kLayers, e = (i * 7) % kExperts;
      slots.push_back(std::make_unique<Slot>(layout_.bytes));
      tickets.push_back(engine.Submit(l, e, slots.back()->p));
      which.emplace_back(l, e);
    }
    // Tickets are distinct and increasing.
    EXPECT_TRUE(std::is_sorted(tickets.begin(), tickets.end()));
    EXPECT_EQ(std::adjacent_find(tickets.begin(), tickets.end()), tickets.end());
    // Wait in a shuffled order: each wait must see its own slot complete.
    std::vector<int> order(kCopies);
    for (int i = 0; i < kCopies; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937(3));
    for (int i : order) {
      Status st = engine.Wait(tickets[i]);
      ASSERT_TRUE(st.ok()) << src->name() << " copy " << i << ": " << st.ToString();
      EXPECT_TRUE(engine.Ready(tickets[i]));
      const auto [l, e] = which[i];
      EXPECT_EQ(SlotMismatch(*slots[i], model_.layers[l].moe.experts[e]), "")
          << src->name() << " copy " << i;
    }
    const CopyStats s = engine.stats();
    EXPECT_EQ(s.copies, kCopies) << src->name();
    EXPECT_EQ(s.bytes, int64_t(kCopies) * int64_t(layout_.bytes)) << src->name();
    EXPECT_EQ(s.failed, 0) << src->name();
    // Paced copies take at least bytes/bandwidth each (a lower bound: sleeps never end early).
    EXPECT_GE(s.busy_s, kCopies * (double(layout_.bytes) / cm.bandwidth_bytes_per_s)) << src->name();
  }
}

TEST_F(CopyEngineTest, WaitBlocksUntilTheCopyLanded) {
  CopyModel cm;
  cm.latency_s = 0.05;
  CopyEngine engine(*dram_, layout_.bytes, cm);
  Slot slot(layout_.bytes);
  const CopyEngine::Ticket t = engine.Submit(2, 5, slot.p);
  ASSERT_NE(t, 0u);
  EXPECT_FALSE(engine.Ready(t));  // 50 ms of modelled latency cannot have passed yet
  ASSERT_TRUE(engine.Wait(t).ok());
  EXPECT_TRUE(engine.Ready(t));
  EXPECT_EQ(SlotMismatch(slot, model_.layers[2].moe.experts[5]), "");
  CopyStats s = engine.stats();
  EXPECT_EQ(s.copies, 1);
  EXPECT_EQ(s.bytes, int64_t(layout_.bytes));
  EXPECT_GT(s.stall_s, 0.0);
  EXPECT_GE(s.busy_s, 0.05);

  // Waiting again, on ticket 0, or on a landed ticket returns at once; a ticket never issued is
  // an error rather than a wait forever.
  EXPECT_TRUE(engine.Wait(t).ok());
  EXPECT_TRUE(engine.Wait(0).ok());
  EXPECT_TRUE(engine.Ready(0));
  EXPECT_FALSE(engine.Ready(t + 100));
  EXPECT_EQ(engine.Wait(t + 100).code(), StatusCode::kInvalidArgument);

  // One serial link: three queued copies land one after another, each paying the latency.
  std::vector<std::unique_ptr<Slot>> more;
  std::vector<CopyEngine::Ticket> ts;
  for (int e = 0; e < 3; ++e) {
    more.push_back(std::make_unique<Slot>(layout_.bytes));
    ts.push_back(engine.Submit(0, e, more.back()->p));
  }
  ASSERT_TRUE(engine.Wait(ts.back()).ok());
  for (int e = 0; e < 3; ++e) {
    EXPECT_TRUE(engine.Ready(ts[e]));
    EXPECT_EQ(SlotMismatch(*more[e], model_.layers[0].moe.experts[e]), "");
  }
  s = engine.stats();
  EXPECT_EQ(s.copies, 4);
  EXPECT_GE(s.busy_s, 4 * 0.05);
}

TEST_F(CopyEngineTest, DemandCopiesOvertakeQueuedPrefetches) {
  CopyModel cm;
  cm.latency_s = 0.2;
  CopyEngine engine(*dram_, layout_.bytes, cm);
  Slot a(layout_.bytes), b(layout_.bytes), c(layout_.bytes);
  const CopyEngine::Ticket p1 = engine.Submit(0, 1, a.p);  // may already be on the link
  const CopyEngine::Ticket p2 = engine.Submit(0, 2, b.p);
  const CopyEngine::Ticket d = engine.Submit(0, 3, c.p, CopyEngine::Priority::kDemand);
  ASSERT_TRUE(engine.Wait(d).ok());
  // FIFO would have landed p2 first; p2 now needs a whole 200 ms copy after d.
  EXPECT_FALSE(engine.Ready(p2));
  EXPECT_EQ(SlotMismatch(c, model_.layers[0].moe.experts[3]), "");
  ASSERT_TRUE(engine.Wait(p1).ok());
  ASSERT_TRUE(engine.Wait(p2).ok());
}

TEST_F(CopyEngineTest, WaitReturnsOnlyAfterTheReadFinished) {
  GatedSource gated(*dram_);
  CopyEngine engine(gated, layout_.bytes, CopyModel{});
  Slot slot(layout_.bytes);
  const CopyEngine::Ticket t = engine.Submit(1, 4, slot.p);
  std::atomic<bool> returned{false};
  Status st;
  std::thread waiter([&] {
    st = engine.Wait(t);
    returned = true;
  });
  // The read cannot finish while the gate is shut, so neither may the wait (a slow machine can
  // only make this check pass more easily, never fail it).
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(returned.load());
  EXPECT_FALSE(engine.Ready(t));
  gated.Open();
  waiter.join();
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(SlotMismatch(slot, model_.layers[1].moe.experts[4]), "");
  EXPECT_GT(engine.stats().stall_s, 0.0);
}

// The order the link started copies in, with all but the first queued behind a shut gate (the
// first is taken alone, so every pick after it sees the same queue whatever the timing).
std::vector<std::pair<int, int>> StartOrder(ExpertSource& src, size_t bytes, CopyModel cm,
                                            int layers, int experts) {
  GatedSource gated(src);
  std::vector<std::unique_ptr<Slot>> slots;
  {
    CopyEngine engine(gated, bytes, cm);
    std::vector<CopyEngine::Ticket> ts;
    for (int l = 0; l < layers; ++l) {
      for (int e = 0; e < experts; ++e) {
        slots.push_back(std::make_unique<Slot>(bytes));
        ts.push_back(engine.Submit(l, e, slots.back()->p));
        if (ts.size() == 1) gated.AwaitReader();
      }
    }
    gated.Open();
    for (auto t : ts) EXPECT_TRUE(engine.Wait(t).ok());
  }
  return gated.order();
}

TEST_F(CopyEngineTest, ReorderIsSeededAndFifoOtherwise) {
  std::vector<std::pair<int, int>> fifo;
  for (int l = 0; l < kLayers; ++l) {
    for (int e = 0; e < kExperts; ++e) fifo.emplace_back(l, e);
  }
  CopyModel cm;
  EXPECT_EQ(StartOrder(*dram_, layout_.bytes, cm, kLayers, kExperts), fifo);
  cm.reorder = true;
  cm.seed = 7;
  const auto a = StartOrder(*dram_, layout_.bytes, cm, kLayers, kExperts);
  const auto b = StartOrder(*dram_, layout_.bytes, cm, kLayers, kExperts);
  cm.seed = 8;
  const auto c = StartOrder(*dram_, layout_.bytes, cm, kLayers, kExperts);
  ASSERT_EQ(a.size(), fifo.size());
  EXPECT_TRUE(std::is_permutation(a.begin(), a.end(), fifo.begin()));
  EXPECT_NE(a, fifo);  // 17 copies queued behind the first: FIFO by chance is 1 in 17!
  EXPECT_EQ(a, b);     // same seed, same order
  EXPECT_NE(a, c);
}

TEST_F(CopyEngineTest, FailedReadsSurfaceInWaitAndTheLinkGoesOn) {
  CopyEngine engine(*dram_, layout_.bytes, CopyModel{});
  Slot bad(layout_.bytes), good(layout_.bytes);
  const CopyEngine::Ticket tb = engine.Submit(kLayers, 0, bad.p);  // no such layer
  const CopyEngine::Ticket tg = engine.Submit(1, 1, good.p);
  Status st = engine.Wait(tb);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_TRUE(engine.Ready(tb));
  EXPECT_EQ(engine.Wait(tb).code(), StatusCode::kInvalidArgument);  // remembered
  ASSERT_TRUE(engine.Wait(tg).ok());
  EXPECT_EQ(SlotMismatch(good, model_.layers[1].moe.experts[1]), "");
  const CopyStats s = engine.stats();
  EXPECT_EQ(s.copies, 1);
  EXPECT_EQ(s.failed, 1);

  // An I/O fault: the weight file shrank under a direct source.
  auto direct = MakeDirectFileSource(model_);
  ASSERT_TRUE(direct.ok()) << direct.status().ToString();
  auto where = model_.Locate(model_.layers[kLayers - 1].moe.experts[kExperts - 1].w1);
  ASSERT_TRUE(where.ok());
  ASSERT_EQ(::truncate(path_.c_str(), off_t(where->second)), 0);
  CopyEngine io(**direct, layout_.bytes, CopyModel{});
  Slot slot(layout_.bytes);
  Status io_st = io.Wait(io.Submit(kLayers - 1, kExperts - 1, slot.p));
  EXPECT_EQ(io_st.code(), StatusCode::kCorruption) << io_st.ToString();
  EXPECT_NE(io_st.message().find(path_), std::string::npos) << io_st.ToString();
}

TEST_F(CopyEngineTest, DestroyedWithCopiesQueuedIsClean) {
  constexpr int kCopies = 20;
  std::vector<std::unique_ptr<Slot>> slots;
  for (int i = 0; i < kCopies; ++i) slots.push_back(std::make_unique<Slot>(layout_.bytes, 0x5A));
  {
    CopyModel cm;
    cm.latency_s = 1.0;  // 20 s of queued link time: the destructor must not wait it out
    cm.reorder = true;
    CopyEngine engine(*dram_, layout_.bytes, cm);
    for (int i = 0; i < kCopies; ++i) engine.Submit(i % kLayers, i % kExperts, slots[i]->p);
  }
  // After destruction nothing writes any more: each slot is untouched or a whole copy, and
  // the copies that never started were dropped, not run.
  int written = 0;
  for (int i = 0; i < kCopies; ++i) {
    const Slot& s = *slots[i];
    const bool untouched = std::all_of(s.p, s.p + s.bytes, [](uint8_t b) { return b == 0x5A; });
    if (untouched) continue;
    ++written;
    EXPECT_EQ(SlotMismatch(s, model_.layers[i % kLayers].moe.experts[i % kExperts]), "")
        << "slot " << i << " holds a torn copy";
  }
  EXPECT_LT(written, kCopies);
  // Destroying an idle engine, and one that never got work, is clean too.
  { CopyEngine idle(*dram_, layout_.bytes, CopyModel{}); }
}

}  // namespace
}  // namespace keel::moe
