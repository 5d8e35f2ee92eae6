// Tests of the step engine's element passes (daemon/engine/bucket_passes.h): the real kernels on a job's
// memory as the daemon lays it out (a state segment with two state halves, two ranks' segments), one
// block of a parameter at a time. Each pass writes its block's elements and nothing around them; a rank
// without the parameter's gradient (presence 0) contributes nothing; an update or a carry from one half
// into the other leaves the half it reads as it was.
#include "daemon/engine/bucket_passes.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <vector>

#include "daemon/engine/rank_channel.h"
#include "daemon/optimizer/adamw_kernels.h"
#include "daemon/optimizer/float_convert.h"
#include "shm/job_layout.h"
#include "shm/segment.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

using optimizer::LoadAsFloat;
using optimizer::StoreFromFloat;

constexpr uint32_t kW = 0, kE = 1;           // an fp32 parameter and a bf16 one, in buckets of their own
constexpr Block kBlockOfW{kW, 200, 300};     // elements [200, 500) of W's 1000
constexpr Block kBlockOfE{kE, 100, 250};     // elements [100, 350) of E's 600
constexpr float kUntouched = 7.0f;           // what the elements around a block hold
constexpr uint16_t kUntouchedBits = 0x5A5A;  // the same, for 16-bit elements

float Value(uint32_t seed, uint64_t i) {
  return static_cast<float>(0.5 * std::cos(0.13 * static_cast<double>(i) + seed));
}

bool Inside(const Block& block, uint64_t i) {
  return i >= block.begin && i < block.begin + block.count;
}

class BucketPassesTest : public ::testing::Test {
 protected:
  BucketPassesTest() : layout_(shm::ComputeLayout(spec_)) {
    state_segment_ = shm::Segment::Create(state_name_.str(), layout_.state_bytes);
    shm::InitStateSegment(state_segment_.data(), layout_);
    state_ = shm::ViewState(state_segment_.data(), layout_, spec_);
    for (uint32_t rank = 0; rank < spec_.world_size; ++rank) {
      shm::Segment segment = shm::Segment::Create(rank_names_.emplace_back().str(), layout_.rank_bytes);
      shm::InitRankSegment(segment.data(), layout_, rank);
      sources_.push_back(
          std::make_shared<RankChannel>(rank, ClientSegment(std::move(segment), geteuid()), layout_, nullptr));
    }
  }

  static shm::LayoutSpec Spec() {
    shm::LayoutSpec spec;
    spec.params = {shm::ParamSpec{.name = "w", .shape = {1000}, .dtype = DType::kFloat32, .group = 0},
                   shm::ParamSpec{.name = "e", .shape = {20, 30}, .dtype = DType::kBFloat16, .group = 0}};
    spec.moment_dtype = DType::kBFloat16;
    spec.accumulation_steps = 2;  // the job has an accumulator
    spec.world_size = 2;
    spec.state_halves = 2;
    return spec;
  }

  [[nodiscard]] uint64_t Numel(uint32_t p) const { return layout_.params[p].numel; }
  [[nodiscard]] DType DTypeOf(uint32_t p) const { return layout_.buckets[layout_.params[p].bucket].dtype; }
  [[nodiscard]] uint64_t Element(uint32_t p) const {
    return layout_.buckets[layout_.params[p].bucket].elem_offset + layout_.params[p].offset_in_bucket;
  }
  [[nodiscard]] const shm::StateHalf& Half(uint32_t h) const { return state_.halves[h]; }
  [[nodiscard]] float* Master(uint32_t p, uint32_t h = 0) const { return Half(h).master + Element(p); }
  [[nodiscard]] float* Accum(uint32_t p) const { return state_.accum + Element(p); }
  [[nodiscard]] std::byte* Moment(void* region, uint32_t p) const {
    return static_cast<std::byte*>(region) + Element(p) * SizeOf(spec_.moment_dtype);
  }
  [[nodiscard]] std::byte* Upload(uint32_t p) const {  // 16-bit parameters only
    const shm::BucketLayout& bucket = layout_.buckets[layout_.params[p].bucket];
    return state_.upload + bucket.upload_offset + layout_.params[p].offset_in_bucket * SizeOf(bucket.dtype);
  }
  [[nodiscard]] std::byte* Grad(uint32_t rank, uint32_t p) const {
    const shm::BucketLayout& bucket = layout_.buckets[layout_.params[p].bucket];
    return sources_[rank]->view.grads + bucket.grad_offset + layout_.params[p].offset_in_bucket * SizeOf(bucket.dtype);
  }
  // Rank `rank`'s gradient of p, in p's dtype as a client writes it, and its presence flag.
  void SetGradient(uint32_t rank, uint32_t p) {
    for (uint64_t i = 0; i < Numel(p); ++i) StoreFromFloat(Grad(rank, p), i, DTypeOf(p), Value(rank, i));
    sources_[rank]->view.presence[p] = 1;
  }
  [[nodiscard]] float Gradient(uint32_t rank, uint32_t p, uint64_t i) const {
    return LoadAsFloat(Grad(rank, p), i, DTypeOf(p));
  }
  void FillAccum(uint32_t p, float value) {
    for (uint64_t i = 0; i < Numel(p); ++i) Accum(p)[i] = value;
  }
  // The bytes of `count` elements of `size` bytes at `data`, to compare regions by value.
  static std::vector<std::byte> Bytes(const void* data, size_t count, size_t size) {
    const auto* first = static_cast<const std::byte*>(data);
    return {first, first + count * size};
  }

  const shm::LayoutSpec spec_ = Spec();
  const shm::JobLayout layout_;
  trainstream::testing::ScopedSegmentName state_name_;
  std::deque<trainstream::testing::ScopedSegmentName> rank_names_;
  shm::Segment state_segment_;
  shm::StateView state_{};
  Sources sources_;
  const BucketPasses passes_{layout_, state_, spec_.moment_dtype};
};

TEST_F(BucketPassesTest, AccumulateSumsTheSlotsOfBothRanks) {
  SetGradient(0, kW);
  SetGradient(1, kW);
  FillAccum(kW, kUntouched);
  passes_.Accumulate(kBlockOfW, sources_, state_.accum, /*overwrite=*/true);  // micro-batch 0
  for (uint64_t i = 0; i < Numel(kW); ++i) {
    const float sum = Gradient(0, kW, i) + Gradient(1, kW, i);
    EXPECT_EQ(Accum(kW)[i], Inside(kBlockOfW, i) ? sum : kUntouched) << "element " << i;
  }
  passes_.Accumulate(kBlockOfW, sources_, state_.accum, /*overwrite=*/false);  // micro-batch 1 adds to it
  for (uint64_t i = kBlockOfW.begin; i < kBlockOfW.begin + kBlockOfW.count; ++i) {
    EXPECT_FLOAT_EQ(Accum(kW)[i], 2 * (Gradient(0, kW, i) + Gradient(1, kW, i))) << "element " << i;
  }
}

TEST_F(BucketPassesTest, ARankWithoutTheGradientIsSkipped) {
  SetGradient(0, kW);
  SetGradient(1, kW);
  sources_[1]->view.presence[kW] = 0;  // rank 1 had no gradient for W in this micro-batch
  passes_.Accumulate(kBlockOfW, sources_, state_.accum, /*overwrite=*/true);
  for (uint64_t i = kBlockOfW.begin; i < kBlockOfW.begin + kBlockOfW.count; ++i) {
    EXPECT_EQ(Accum(kW)[i], Gradient(0, kW, i)) << "element " << i;
  }
  sources_[0]->view.presence[kW] = 0;  // no rank: a later micro-batch leaves the sum as it is...
  passes_.Accumulate(kBlockOfW, sources_, state_.accum, /*overwrite=*/false);
  EXPECT_EQ(Accum(kW)[kBlockOfW.begin], Gradient(0, kW, kBlockOfW.begin));
  passes_.Accumulate(kBlockOfW, sources_, state_.accum, /*overwrite=*/true);  // ...and the first one starts it at 0
  EXPECT_EQ(Accum(kW)[kBlockOfW.begin], 0.0f);
}

TEST_F(BucketPassesTest, SumOfSquaresIsTheSumOverTheBlockOfTheScaledGradientsSquared) {
  SetGradient(0, kW);
  SetGradient(1, kW);
  for (uint64_t i = 0; i < Numel(kW); ++i) Accum(kW)[i] = Inside(kBlockOfW, i) ? Value(9, i) : 1e6f;
  constexpr float kScale = 0.25f;
  double expected = 0;
  for (uint64_t i = kBlockOfW.begin; i < kBlockOfW.begin + kBlockOfW.count; ++i) {
    const double g = kScale * (static_cast<double>(Accum(kW)[i]) + Gradient(0, kW, i) + Gradient(1, kW, i));
    expected += g * g;
  }
  bool nonfinite = false;
  EXPECT_NEAR(passes_.SumOfSquares(kBlockOfW, sources_, state_.accum, kScale, &nonfinite), expected, 1e-6 * expected);
  EXPECT_FALSE(nonfinite);
  reinterpret_cast<float*>(Grad(1, kW))[kBlockOfW.begin + 5] = std::numeric_limits<float>::infinity();
  passes_.SumOfSquares(kBlockOfW, sources_, state_.accum, kScale, &nonfinite);
  EXPECT_TRUE(nonfinite);
}

TEST_F(BucketPassesTest, UpdateIsTheOptimizerKernelOnTheBlocksElements) {
  SetGradient(0, kE);
  SetGradient(1, kE);
  for (uint64_t i = 0; i < Numel(kE); ++i) {
    Master(kE)[i] = Value(3, i);
    Accum(kE)[i] = Value(4, i);
    StoreFromFloat(Moment(Half(0).exp_avg, kE), i, spec_.moment_dtype, 0.1f * Value(5, i));
    StoreFromFloat(Moment(Half(0).exp_avg_sq, kE), i, spec_.moment_dtype, 0.01f * std::abs(Value(6, i)));
  }
  const optimizer::AdamWStep step = optimizer::AdamWStep::For(0.01, 0.9, 0.999, 1e-8, 0.1, /*decoupled=*/true, 3);
  constexpr float kScale = 0.5f;
  constexpr uint64_t kSeed = 1234;

  // The kernel itself, on copies of the block's elements.
  const size_t moment_size = SizeOf(spec_.moment_dtype), begin = kBlockOfE.begin, count = kBlockOfE.count;
  std::vector<float> master(Master(kE) + begin, Master(kE) + begin + count);
  std::vector<std::byte> exp_avg = Bytes(Moment(Half(0).exp_avg, kE) + begin * moment_size, count, moment_size);
  std::vector<std::byte> exp_avg_sq = Bytes(Moment(Half(0).exp_avg_sq, kE) + begin * moment_size, count, moment_size);
  std::vector<std::byte> upload(count * SizeOf(DTypeOf(kE)));
  const std::vector<const void*> slots = {Grad(0, kE) + begin * SizeOf(DTypeOf(kE)),
                                          Grad(1, kE) + begin * SizeOf(DTypeOf(kE))};
  const optimizer::MomentBuffers moments{.exp_avg = exp_avg.data(),
                                         .exp_avg_sq = exp_avg_sq.data(),
                                         .dtype = spec_.moment_dtype,
                                         .sr_seed = kSeed,
                                         // rounding keyed by (parameter, element of it)
                                         .element_base = (uint64_t{kE} << 40) + begin};
  optimizer::AdamWUpdate({.slots = slots, .dtype = DTypeOf(kE), .accum = Accum(kE) + begin, .scale = kScale}, step,
                         optimizer::StateIn::InPlace(master.data(), moments), master.data(), moments,
                         {.data = upload.data(), .dtype = DTypeOf(kE)}, count);

  const float before = Master(kE)[begin - 1];
  EXPECT_FALSE(passes_.Update(kBlockOfE, sources_, state_.accum, kScale, step, kSeed, Half(0), Half(0)));  // in place
  EXPECT_EQ(std::vector<float>(Master(kE) + begin, Master(kE) + begin + count), master);
  EXPECT_EQ(Bytes(Moment(Half(0).exp_avg, kE) + begin * moment_size, count, moment_size), exp_avg);
  EXPECT_EQ(Bytes(Moment(Half(0).exp_avg_sq, kE) + begin * moment_size, count, moment_size), exp_avg_sq);
  EXPECT_EQ(Bytes(Upload(kE) + begin * SizeOf(DTypeOf(kE)), count, SizeOf(DTypeOf(kE))), upload);
  EXPECT_EQ(Master(kE)[begin - 1], before);  // the element before the block
}

TEST_F(BucketPassesTest, UpdateReportsNonFiniteWeights) {
  SetGradient(0, kW);
  reinterpret_cast<float*>(Grad(0, kW))[kBlockOfW.begin] = std::numeric_limits<float>::quiet_NaN();
  const optimizer::AdamWStep step = optimizer::AdamWStep::For(0.01, 0.9, 0.999, 1e-8, 0.0, /*decoupled=*/true, 1);
  EXPECT_TRUE(passes_.Update(kBlockOfW, sources_, state_.accum, 1.0f, step, /*sr_seed=*/0, Half(0), Half(0)));
  EXPECT_TRUE(passes_.Update(kBlockOfW, sources_, state_.accum, 1.0f, step, /*sr_seed=*/0, Half(0), Half(1)));
}

// Out of place: the update of half 0 into half 1 gives half 1 what the update in place gives half 0, and
// leaves half 0 as it was (it is the committed state until the update commits).
TEST_F(BucketPassesTest, UpdateIntoTheOtherHalfEqualsTheUpdateInPlaceAndKeepsTheHalfItReads) {
  SetGradient(0, kE);
  SetGradient(1, kE);
  const size_t moment_size = SizeOf(spec_.moment_dtype);
  for (uint64_t i = 0; i < Numel(kE); ++i) {
    Master(kE)[i] = Value(3, i);
    Master(kE, 1)[i] = kUntouched;
    Accum(kE)[i] = Value(4, i);
    StoreFromFloat(Moment(Half(0).exp_avg, kE), i, spec_.moment_dtype, 0.1f * Value(5, i));
    StoreFromFloat(Moment(Half(0).exp_avg_sq, kE), i, spec_.moment_dtype, 0.01f * std::abs(Value(6, i)));
  }
  const std::vector<std::byte> before = Bytes(Master(kE), Numel(kE), sizeof(float));
  const std::vector<std::byte> exp_avg_before = Bytes(Moment(Half(0).exp_avg, kE), Numel(kE), moment_size);
  const optimizer::AdamWStep step = optimizer::AdamWStep::For(0.01, 0.9, 0.999, 1e-8, 0.1, /*decoupled=*/true, 3);
  const std::byte* upload = Upload(kE) + kBlockOfE.begin * SizeOf(DTypeOf(kE));
  const size_t upload_bytes = kBlockOfE.count * SizeOf(DTypeOf(kE));
  EXPECT_FALSE(passes_.Update(kBlockOfE, sources_, state_.accum, 0.5f, step, 77, Half(0), Half(1)));
  const std::vector<std::byte> upload_out_of_place = Bytes(upload, upload_bytes, 1);
  EXPECT_EQ(Bytes(Master(kE), Numel(kE), sizeof(float)), before);
  EXPECT_EQ(Bytes(Moment(Half(0).exp_avg, kE), Numel(kE), moment_size), exp_avg_before);
  EXPECT_EQ(Master(kE, 1)[kBlockOfE.begin - 1], kUntouched);  // only the block was written
  const std::vector<float> out_of_place(Master(kE, 1) + kBlockOfE.begin,
                                        Master(kE, 1) + kBlockOfE.begin + kBlockOfE.count);
  EXPECT_FALSE(passes_.Update(kBlockOfE, sources_, state_.accum, 0.5f, step, 77, Half(0), Half(0)));
  EXPECT_EQ(std::vector<float>(Master(kE) + kBlockOfE.begin, Master(kE) + kBlockOfE.begin + kBlockOfE.count),
            out_of_place);
  EXPECT_EQ(Bytes(upload, upload_bytes, 1), upload_out_of_place);
}

// A parameter without a gradient keeps its state in the half the step commits: its block is copied
// there as it is; with one half (from == to) nothing moves.
TEST_F(BucketPassesTest, CarryCopiesTheBlockIntoTheOtherHalfUnchanged) {
  const size_t moment_size = SizeOf(spec_.moment_dtype);
  for (uint64_t i = 0; i < Numel(kW); ++i) {
    Master(kW)[i] = Value(1, i);
    Master(kW, 1)[i] = kUntouched;
    StoreFromFloat(Moment(Half(0).exp_avg, kW), i, spec_.moment_dtype, Value(2, i));
    StoreFromFloat(Moment(Half(0).exp_avg_sq, kW), i, spec_.moment_dtype, Value(3, i));
  }
  passes_.Carry(kBlockOfW, Half(0), Half(1));
  for (uint64_t i = 0; i < Numel(kW); ++i) {
    EXPECT_EQ(Master(kW, 1)[i], Inside(kBlockOfW, i) ? Master(kW)[i] : kUntouched) << "element " << i;
  }
  const size_t first = kBlockOfW.begin * moment_size, bytes = kBlockOfW.count * moment_size;
  EXPECT_EQ(Bytes(Moment(Half(1).exp_avg, kW) + first, bytes, 1), Bytes(Moment(Half(0).exp_avg, kW) + first, bytes, 1));
  EXPECT_EQ(Bytes(Moment(Half(1).exp_avg_sq, kW) + first, bytes, 1),
            Bytes(Moment(Half(0).exp_avg_sq, kW) + first, bytes, 1));
  const std::vector<std::byte> before = Bytes(Master(kW), Numel(kW), sizeof(float));
  passes_.Carry(kBlockOfW, Half(0), Half(0));
  EXPECT_EQ(Bytes(Master(kW), Numel(kW), sizeof(float)), before);
}

TEST_F(BucketPassesTest, UploadMasterRoundsTheLoadedWeightsIntoTheUploadRegion) {
  for (uint64_t i = 0; i < Numel(kE); ++i) {
    Master(kE)[i] = Value(8, i);
    reinterpret_cast<uint16_t*>(Upload(kE))[i] = kUntouchedBits;
  }
  passes_.UploadMaster(kBlockOfE, Half(0));
  for (uint64_t i = 0; i < Numel(kE); ++i) {
    const uint16_t expected = Inside(kBlockOfE, i) ? optimizer::FloatToBF16(Master(kE)[i]) : kUntouchedBits;
    EXPECT_EQ(reinterpret_cast<uint16_t*>(Upload(kE))[i], expected) << "element " << i;
  }
  const std::vector<std::byte> upload = Bytes(state_.upload, layout_.upload_bytes, 1);
  passes_.UploadMaster(kBlockOfW, Half(0));  // an fp32 parameter has no upload copy: its master weights are read
  EXPECT_EQ(Bytes(state_.upload, layout_.upload_bytes, 1), upload);
}

TEST_F(BucketPassesTest, TouchZeroesTheBlockInEveryRegion) {
  const size_t moment_size = SizeOf(spec_.moment_dtype), upload_size = SizeOf(DTypeOf(kE));
  for (uint32_t h = 0; h < 2; ++h) {
    std::memset(Master(kE, h), 0x5A, Numel(kE) * sizeof(float));
    std::memset(Moment(Half(h).exp_avg, kE), 0x5A, Numel(kE) * moment_size);
    std::memset(Moment(Half(h).exp_avg_sq, kE), 0x5A, Numel(kE) * moment_size);
  }
  std::memset(Accum(kE), 0x5A, Numel(kE) * sizeof(float));
  std::memset(Upload(kE), 0x5A, Numel(kE) * upload_size);
  passes_.Touch(kBlockOfE);
  const auto expect_touched = [&](const std::byte* region, size_t size, const char* what) {
    for (uint64_t i = 0; i < Numel(kE); ++i) {
      const std::byte expected = Inside(kBlockOfE, i) ? std::byte{0} : std::byte{0x5A};
      for (size_t b = 0; b < size; ++b) ASSERT_EQ(region[i * size + b], expected) << what << " element " << i;
    }
  };
  for (uint32_t h = 0; h < 2; ++h) {  // both halves
    expect_touched(reinterpret_cast<const std::byte*>(Master(kE, h)), sizeof(float), "master");
    expect_touched(Moment(Half(h).exp_avg, kE), moment_size, "exp_avg");
    expect_touched(Moment(Half(h).exp_avg_sq, kE), moment_size, "exp_avg_sq");
  }
  expect_touched(reinterpret_cast<const std::byte*>(Accum(kE)), sizeof(float), "accum");
  expect_touched(Upload(kE), upload_size, "upload");
}

}  // namespace
}  // namespace trainstream::daemon
