// Tests of the job layout (shm/job_layout.h): bucketing rules, alignment and non-overlap of every
// region, the spec hash, spec validation, and the state/rank segment headers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "shm/error.h"
#include "shm/job_layout.h"
#include "shm/segment.h"
#include "tests/cpp/shm/full_spec.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::shm {
namespace {

using trainstream::testing::ScopedSegmentName;

ParamSpec Param(std::string name, std::vector<int64_t> shape, DType dtype = DType::kFloat32, uint32_t group = 0) {
  return ParamSpec{.name = std::move(name), .shape = std::move(shape), .dtype = dtype, .group = group};
}

// A spec of `count` fp32 parameters of `numel` elements each.
LayoutSpec UniformSpec(size_t count, int64_t numel, uint64_t bucket_bytes) {
  LayoutSpec spec;
  for (size_t i = 0; i < count; ++i) spec.params.push_back(Param("p" + std::to_string(i), {numel}));
  spec.bucket_bytes = bucket_bytes;
  return spec;
}

// A varied spec: mixed dtypes, odd sizes, a scalar, an empty tensor, a parameter larger than a bucket.
LayoutSpec MixedSpec() {
  LayoutSpec spec;
  spec.num_groups = 2;
  spec.bucket_bytes = 4096;
  spec.accumulation_steps = 4;
  spec.moment_dtype = DType::kBFloat16;
  spec.params = {Param("embed", {50, 33}, DType::kBFloat16, 0), Param("w1", {17, 3}, DType::kFloat32, 1),
                 Param("scalar", {}, DType::kFloat32, 0),       Param("empty", {0, 5}, DType::kFloat32, 1),
                 Param("big", {3000}, DType::kFloat32, 0),      Param("b1", {7}, DType::kBFloat16, 1),
                 Param("h", {2, 2, 255}, DType::kFloat16, 0),   Param("w2", {999}, DType::kFloat32, 1)};
  return spec;
}

using Range = std::pair<uint64_t, uint64_t>;  // [begin, end)

void ExpectDisjoint(std::vector<Range> ranges, const std::string& what) {
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    EXPECT_LE(ranges[i - 1].second, ranges[i].first) << what << " overlap";
  }
}

void ExpectRegionsAlignedDisjointInside(const std::vector<Range>& regions, uint64_t header_bytes, uint64_t total,
                                        const std::string& what) {
  for (const auto& [begin, end] : regions) {
    EXPECT_EQ(begin % kAlign, 0u) << what << " region at " << begin << " is not 64-byte aligned";
    EXPECT_GE(begin, header_bytes) << what << " region overlaps the header";
    EXPECT_LE(end, total) << what << " region ends past the segment";
  }
  ExpectDisjoint(regions, what + " regions");
}

// Every structural invariant of a layout, checked for any spec.
void ExpectConsistent(const LayoutSpec& spec, const JobLayout& layout) {
  ASSERT_EQ(layout.params.size(), spec.params.size());
  std::vector<int> seen(spec.params.size(), 0);
  std::vector<Range> bucket_elems, uploads;
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const BucketLayout& bucket = layout.buckets[b];
    EXPECT_FALSE(bucket.params.empty()) << "bucket " << b;
    std::vector<Range> param_elems;
    for (uint32_t p : bucket.params) {
      ++seen[p];
      const ParamLayout& param = layout.params[p];
      EXPECT_EQ(param.bucket, b);
      EXPECT_EQ(spec.params[p].dtype, bucket.dtype) << "bucket " << b << " mixes dtypes";
      EXPECT_EQ(param.numel, spec.params[p].numel());
      EXPECT_EQ(param.offset_in_bucket * SizeOf(bucket.dtype) % kAlign, 0u) << "param " << p << " unaligned";
      EXPECT_LE(param.offset_in_bucket + param.numel, bucket.numel) << "param " << p << " outside its bucket";
      param_elems.emplace_back(param.offset_in_bucket, param.offset_in_bucket + param.numel);
    }
    ExpectDisjoint(param_elems, "params of bucket " + std::to_string(b));
    EXPECT_EQ(bucket.elem_offset * sizeof(float) % kAlign, 0u);
    EXPECT_EQ(bucket.elem_offset * 2 % kAlign, 0u);  // bf16 moments too
    EXPECT_LE(bucket.elem_offset + bucket.numel, layout.total_elems);
    bucket_elems.emplace_back(bucket.elem_offset, bucket.elem_offset + bucket.numel);
    if (!bucket.grads_in_upload) {
      EXPECT_EQ(bucket.grad_offset % kAlign, 0u);
      EXPECT_LE(bucket.grad_offset + bucket.bytes(), layout.grad_bytes);
    }
    EXPECT_EQ(bucket.uploads_from_master(), bucket.dtype == DType::kFloat32);
    if (!bucket.uploads_from_master()) {  // fp32 buckets are read from the master weights
      EXPECT_EQ(bucket.upload_offset % kAlign, 0u);
      EXPECT_LE(bucket.upload_offset + bucket.bytes(), layout.upload_bytes);
      uploads.emplace_back(bucket.upload_offset, bucket.upload_offset + bucket.bytes());
    }
  }
  for (size_t p = 0; p < seen.size(); ++p) EXPECT_EQ(seen[p], 1) << "param " << p << " is in " << seen[p] << " buckets";
  ExpectDisjoint(bucket_elems, "bucket element ranges");
  ExpectDisjoint(uploads, "bucket upload ranges");

  const uint64_t moment_bytes = layout.total_elems * SizeOf(spec.moment_dtype);
  std::vector<Range> state = {
      {layout.bucket_state_offset, layout.bucket_state_offset + sizeof(BucketState) * layout.buckets.size()},
      {layout.upload_offset, layout.upload_offset + layout.upload_bytes}};
  EXPECT_EQ(layout.state_halves, spec.state_halves);
  for (uint32_t h = 0; h < spec.state_halves; ++h) {  // with one half, [1] names [0]'s memory
    state.emplace_back(layout.param_state_offset[h],
                       layout.param_state_offset[h] + sizeof(ParamState) * spec.params.size());
    state.emplace_back(layout.master_offset[h], layout.master_offset[h] + layout.total_elems * sizeof(float));
    state.emplace_back(layout.exp_avg_offset[h], layout.exp_avg_offset[h] + moment_bytes);
    state.emplace_back(layout.exp_avg_sq_offset[h], layout.exp_avg_sq_offset[h] + moment_bytes);
  }
  if (spec.state_halves == 1) {
    EXPECT_EQ(layout.master_offset[1], layout.master_offset[0]);
    EXPECT_EQ(layout.param_state_offset[1], layout.param_state_offset[0]);
    EXPECT_EQ(layout.exp_avg_offset[1], layout.exp_avg_offset[0]);
    EXPECT_EQ(layout.exp_avg_sq_offset[1], layout.exp_avg_sq_offset[0]);
  }
  if (spec.accumulation_steps > 1) {
    state.emplace_back(layout.accum_offset, layout.accum_offset + layout.total_elems * sizeof(float));
  }
  ExpectRegionsAlignedDisjointInside(state, sizeof(StateHeader), layout.state_bytes, "state");
  const std::vector<Range> rank = {
      {layout.request_ring_offset, layout.request_ring_offset + RingBytes(kRingCapacity)},
      {layout.completion_ring_offset, layout.completion_ring_offset + RingBytes(kRingCapacity)},
      {layout.hparams_offset, layout.hparams_offset + sizeof(HParams) * 2 * spec.num_groups},
      {layout.presence_offset, layout.presence_offset + spec.params.size()},
      {layout.grads_offset, layout.grads_offset + layout.grad_bytes}};
  ExpectRegionsAlignedDisjointInside(rank, sizeof(RankHeader), layout.rank_bytes, "rank");
}

// Bytes of a bucket's real content: up to the end of its last parameter.
uint64_t UsedBytes(const JobLayout& layout, const BucketLayout& bucket) {
  uint64_t end = 0;
  for (uint32_t p : bucket.params) end = std::max(end, layout.params[p].offset_in_bucket + layout.params[p].numel);
  return end * SizeOf(bucket.dtype);
}

TEST(ComputeLayout, BucketsFollowReverseRegistrationOrder) {
  const JobLayout one = ComputeLayout(UniformSpec(3, 100, 1 << 20));
  ASSERT_EQ(one.buckets.size(), 1u);
  EXPECT_EQ(one.buckets[0].params, (std::vector<uint32_t>{2, 1, 0}));

  const JobLayout each = ComputeLayout(UniformSpec(3, 1000, 4096));  // 4000 bytes: one per bucket
  ASSERT_EQ(each.buckets.size(), 3u);
  for (uint32_t b = 0; b < 3; ++b) EXPECT_EQ(each.buckets[b].params, (std::vector<uint32_t>{2 - b}));
  EXPECT_LT(each.buckets[0].elem_offset, each.buckets[1].elem_offset);
}

TEST(ComputeLayout, OneDtypePerBucket) {
  LayoutSpec spec;
  for (int i = 0; i < 6; ++i) {
    spec.params.push_back(Param("p" + std::to_string(i), {10}, i % 2 == 0 ? DType::kFloat32 : DType::kBFloat16));
  }
  const JobLayout layout = ComputeLayout(spec);
  ASSERT_EQ(layout.buckets.size(), 2u);
  EXPECT_EQ(layout.buckets[0].dtype, DType::kBFloat16);  // the last parameter's dtype opens the first bucket
  EXPECT_EQ(layout.buckets[0].params, (std::vector<uint32_t>{5, 3, 1}));
  EXPECT_EQ(layout.buckets[1].params, (std::vector<uint32_t>{4, 2, 0}));
  ExpectConsistent(spec, layout);
}

TEST(ComputeLayout, BucketSizeLimitIsRespected) {
  const LayoutSpec spec = UniformSpec(40, 300, 4096);  // 1200 bytes each, padded to 1216: three per bucket
  const JobLayout layout = ComputeLayout(spec);
  ASSERT_EQ(layout.buckets.size(), 14u);
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    EXPECT_LE(UsedBytes(layout, layout.buckets[b]), spec.bucket_bytes);
    // Filled as far as the limit allows; the last one takes the remaining parameter.
    EXPECT_EQ(layout.buckets[b].params.size(), b + 1 < layout.buckets.size() ? 3u : 1u) << "bucket " << b;
  }
  ExpectConsistent(spec, layout);
}

TEST(ComputeLayout, ParameterLargerThanABucketGetsItsOwnBucket) {
  LayoutSpec spec = UniformSpec(4, 100, 4096);
  spec.params.insert(spec.params.begin() + 2, Param("huge", {5000}));  // 20000 bytes
  const JobLayout layout = ComputeLayout(spec);
  const BucketLayout& own = layout.buckets[layout.params[2].bucket];
  EXPECT_EQ(own.params, (std::vector<uint32_t>{2}));
  EXPECT_GE(own.bytes(), 20000u);
  for (uint32_t p : {0u, 1u, 3u, 4u}) EXPECT_NE(layout.params[p].bucket, layout.params[2].bucket);
  ExpectConsistent(spec, layout);
}

TEST(ComputeLayout, EveryRegionIsAlignedDisjointAndInside) {
  for (uint32_t halves : {1u, 2u}) {
    for (LayoutSpec spec : {MixedSpec(), UniformSpec(1, 1, 4096), UniformSpec(100, 33, 1 << 16)}) {
      SCOPED_TRACE(::testing::Message() << spec.params.size() << " params, " << halves << " halves");
      spec.state_halves = halves;
      ExpectConsistent(spec, ComputeLayout(spec));
    }
  }
}

// Two state halves double the master weights, the moments and the step counts, nothing else.
TEST(ComputeLayout, TwoStateHalvesDoubleTheOptimizerStateOnly) {
  LayoutSpec spec = MixedSpec();
  const JobLayout one = ComputeLayout(spec);
  spec.state_halves = 2;
  const JobLayout two = ComputeLayout(spec);
  const uint64_t half = one.total_elems * (sizeof(float) + 2 * SizeOf(spec.moment_dtype));
  EXPECT_GE(two.state_bytes - one.state_bytes, half);
  EXPECT_LE(two.state_bytes - one.state_bytes, half + sizeof(ParamState) * spec.params.size() + 4 * kAlign);
  EXPECT_EQ(two.rank_bytes, one.rank_bytes);
  EXPECT_EQ(two.upload_bytes, one.upload_bytes);
}

TEST(BucketCommit, StepHalfAndUpdatingShareOneWord) {
  for (const BucketCommit commit : {BucketCommit{}, BucketCommit{.step = 7, .half = 1},
                                    BucketCommit{.step = (uint64_t{1} << 62) - 1, .half = 0, .updating = true}}) {
    EXPECT_EQ(BucketCommit::Of(commit.Word()), commit);
    BucketState state;
    state.Store(commit);
    EXPECT_EQ(state.Load(), commit);
  }
}

// Paged blocks: parameters of different partitions never share a bucket, even when they would fit.
TEST(ComputeLayout, PartitionsNeverShareABucket) {
  LayoutSpec spec = UniformSpec(6, 10, 1 << 20);  // all six would fit one bucket
  for (uint32_t i = 0; i < 6; ++i) spec.params[i].partition = i < 2 ? 0 : 1 + (i - 2) / 2;  // 0 0 1 1 2 2
  const JobLayout layout = ComputeLayout(spec);
  ASSERT_EQ(layout.buckets.size(), 3u);
  EXPECT_EQ(layout.buckets[0].params, (std::vector<uint32_t>{5, 4}));
  EXPECT_EQ(layout.buckets[0].partition, 2u);
  EXPECT_EQ(layout.buckets[1].params, (std::vector<uint32_t>{3, 2}));
  EXPECT_EQ(layout.buckets[2].params, (std::vector<uint32_t>{1, 0}));
  EXPECT_EQ(layout.buckets[2].partition, 0u);
  ExpectConsistent(spec, layout);
}

// A paged 16-bit bucket's gradients land in its upload copy when nothing else reads them (one rank, no
// accumulator, no speculative redo): the rank segment then holds only the other buckets' slots.
TEST(ComputeLayout, PagedSixteenBitBucketsOfOneRankTakeTheirGradientsInTheUploadCopy) {
  LayoutSpec spec = UniformSpec(4, 100, 1 << 20);
  for (uint32_t i = 0; i < 4; ++i) {
    spec.params[i].partition = i;                                        // 0: resident, 1-3: paged blocks
    spec.params[i].dtype = i == 3 ? DType::kFloat32 : DType::kBFloat16;  // fp32: no upload copy to use
  }
  const JobLayout layout = ComputeLayout(spec);
  ASSERT_EQ(layout.buckets.size(), 4u);  // partitions 3, 2, 1, 0
  EXPECT_FALSE(layout.buckets[0].grads_in_upload);
  EXPECT_TRUE(layout.buckets[1].grads_in_upload);
  EXPECT_TRUE(layout.buckets[2].grads_in_upload);
  EXPECT_FALSE(layout.buckets[3].grads_in_upload);
  EXPECT_EQ(layout.grad_bytes, 448u + 256u);  // fp32 and resident bf16 slots, 64-byte aligned
  ExpectConsistent(spec, layout);

  const std::vector<std::pair<std::string, std::function<void(LayoutSpec&)>>> shared_readers = {
      {"two ranks", [](LayoutSpec& s) { s.world_size = 2; }},
      {"accumulation", [](LayoutSpec& s) { s.accumulation_steps = 2; }},
      {"two nodes",
       [](LayoutSpec& s) {
         s.peers = {"a:1", "b:1"};
       }},
      {"speculation", [](LayoutSpec& s) {
         s.max_grad_norm = 1.0;
         s.state_halves = 2;
         s.speculative_clipping = Speculation::kOn;
       }}};
  for (const auto& [what, change] : shared_readers) {
    LayoutSpec other = spec;
    change(other);
    const JobLayout apart = ComputeLayout(other);
    for (const BucketLayout& bucket : apart.buckets) EXPECT_FALSE(bucket.grads_in_upload) << what;
    EXPECT_EQ(apart.grad_bytes, layout.grad_bytes + 2 * 256u) << what;
  }
}

// Frozen parameters (a LoRA base) take no bucket and no optimizer state: only their own bytes, one
// after another in the frozen region at the end of the state segment.
TEST(ComputeLayout, FrozenParametersGetTheirOwnRegionOnly) {
  LayoutSpec spec = UniformSpec(2, 100, 4096);
  const JobLayout without = ComputeLayout(spec);
  spec.frozen = {Param("base.a", {3, 7}, DType::kBFloat16), Param("base.b", {1000}, DType::kBFloat16),
                 Param("base.c", {5}, DType::kFloat32)};
  const JobLayout with = ComputeLayout(spec);
  EXPECT_EQ(with.buckets.size(), without.buckets.size());
  EXPECT_EQ(with.total_elems, without.total_elems);
  EXPECT_EQ(with.grad_bytes, without.grad_bytes);
  EXPECT_EQ(with.rank_bytes, without.rank_bytes);
  ASSERT_EQ(with.frozen_offsets.size(), 3u);
  EXPECT_EQ(with.frozen_offsets[0], 0u);
  EXPECT_EQ(with.frozen_offsets[1], 64u);    // 42 bytes, padded to 64
  EXPECT_EQ(with.frozen_offsets[2], 2112u);  // 64 + 2000 bytes, padded
  EXPECT_EQ(with.frozen_bytes, 2112u + 64u);
  EXPECT_EQ(with.frozen_offset % kAlign, 0u);
  EXPECT_GE(with.frozen_offset, with.upload_offset + with.upload_bytes);
  EXPECT_EQ(with.state_bytes, with.frozen_offset + with.frozen_bytes);
  EXPECT_EQ(with.state_bytes - without.state_bytes, with.frozen_bytes);
}

TEST(ComputeLayout, AccumulatorOnlyWithAccumulation) {
  LayoutSpec spec = UniformSpec(2, 100, 4096);
  const JobLayout without = ComputeLayout(spec);
  spec.accumulation_steps = 2;
  const JobLayout with = ComputeLayout(spec);
  EXPECT_GE(with.state_bytes, without.state_bytes + without.total_elems * sizeof(float));
}

TEST(ComputeLayout, HashIsEqualForEqualSpecs) {
  EXPECT_EQ(ComputeLayout(MixedSpec()).hash, ComputeLayout(MixedSpec()).hash);
}

// A daemon re-adopts a dead daemon's job by comparing this hash with the one its state segment holds
// (and ranks compare theirs at attach): a change to what it covers, or in which order, goes with a new
// kSegmentVersion. The value is the one of the hash before ForEachOption listed the options.
TEST(ComputeLayout, HashOfAFixedSpecStaysTheSame) {
  EXPECT_EQ(ComputeLayout(testing::FullSpec()).hash, 1060129321780834316ull);
}

TEST(ComputeLayout, HashChangesWithEveryField) {
  const std::vector<std::pair<std::string, std::function<void(LayoutSpec&)>>> changes = {
      {"name", [](LayoutSpec& s) { s.params[1].name = "w1x"; }},
      {"shape",
       [](LayoutSpec& s) {
         s.params[1].shape = {3, 17};
       }},
      {"rank of shape",
       [](LayoutSpec& s) {
         s.params[1].shape = {17, 3, 1};
       }},
      {"dtype", [](LayoutSpec& s) { s.params[1].dtype = DType::kBFloat16; }},
      {"group", [](LayoutSpec& s) { s.params[1].group = 0; }},
      {"param order", [](LayoutSpec& s) { std::swap(s.params[0], s.params[1]); }},
      {"num_groups", [](LayoutSpec& s) { s.num_groups = 3; }},
      {"world_size", [](LayoutSpec& s) { s.world_size = 2; }},
      {"accumulation_steps", [](LayoutSpec& s) { s.accumulation_steps = 5; }},
      {"max_grad_norm", [](LayoutSpec& s) { s.max_grad_norm = 1.0; }},
      {"bucket_bytes", [](LayoutSpec& s) { s.bucket_bytes = 8192; }},
      {"moment dtype", [](LayoutSpec& s) { s.moment_dtype = DType::kFloat32; }},
      {"optimizer", [](LayoutSpec& s) { s.optimizer = OptimizerKind::kAdam; }},
      {"partition", [](LayoutSpec& s) { s.params[1].partition = 3; }},
      {"a frozen parameter", [](LayoutSpec& s) { s.frozen.push_back(Param("base", {8}, DType::kBFloat16)); }},
      {"state halves", [](LayoutSpec& s) { s.state_halves = 2; }},
      {"speculative clipping",
       [](LayoutSpec& s) { s.state_halves = 2, s.max_grad_norm = 1.0, s.speculative_clipping = Speculation::kOn; }},
  };
  const uint64_t base = ComputeLayout(MixedSpec()).hash;
  for (const auto& [what, change] : changes) {
    LayoutSpec spec = MixedSpec();
    change(spec);
    EXPECT_NE(ComputeLayout(spec).hash, base) << "hash ignores " << what;
  }
  LayoutSpec two = MixedSpec();
  two.state_halves = 2, two.max_grad_norm = 1.0;
  LayoutSpec speculative = two;
  speculative.speculative_clipping = Speculation::kOn;
  EXPECT_NE(ComputeLayout(two).hash, ComputeLayout(speculative).hash);
}

TEST(ComputeLayout, InvalidSpecsAreRejectedNamingTheProblem) {
  const std::vector<std::tuple<std::string, std::function<void(LayoutSpec&)>, std::string>> cases = {
      {"no params", [](LayoutSpec& s) { s.params.clear(); }, "no parameters"},
      {"group out of range", [](LayoutSpec& s) { s.params[1].group = 2; }, "group 2"},
      {"world_size 0", [](LayoutSpec& s) { s.world_size = 0; }, "world_size"},
      {"negative dim",
       [](LayoutSpec& s) {
         s.params[1].shape = {4, -3};
       },
       "dimension -3"},
      {"elements overflow 64 bits",
       [](LayoutSpec& s) {
         s.params[1].shape = {int64_t{1} << 32, int64_t{1} << 32};
       },
       "parameter 1 (w1) has over 2^40 elements"},
      {"elements over 2^40",
       [](LayoutSpec& s) {
         s.params[1].shape = {int64_t{1} << 20, int64_t{1} << 20};
       },
       "has over 2^40 elements"},
      // 512 * (2^55 - 1) = 2^64 - 512: each dimension in range, the product wraps to "-512 elements".
      {"elements wrap to a small count",
       [](LayoutSpec& s) {
         s.params[1].shape = {512, 23 * 31 * 89 * 881, int64_t{3191} * 201961};
       },
       "has over 2^40 elements"},
      {"fp16 moments", [](LayoutSpec& s) { s.moment_dtype = DType::kFloat16; }, "moment dtype"},
      {"accumulation 0", [](LayoutSpec& s) { s.accumulation_steps = 0; }, "accumulation_steps"},
      {"max_grad_norm negative", [](LayoutSpec& s) { s.max_grad_norm = -1; }, "max_grad_norm"},
      {"max_grad_norm NaN", [](LayoutSpec& s) { s.max_grad_norm = std::numeric_limits<double>::quiet_NaN(); },
       "max_grad_norm"},
      {"max_grad_norm inf", [](LayoutSpec& s) { s.max_grad_norm = std::numeric_limits<double>::infinity(); },
       "max_grad_norm"},
      {"num_groups 0", [](LayoutSpec& s) { s.num_groups = 0; }, "num_groups"},
      {"tiny buckets", [](LayoutSpec& s) { s.bucket_bytes = 100; }, "bucket_bytes"},
      {"unknown dtype", [](LayoutSpec& s) { s.params[0].dtype = static_cast<DType>(9); }, "dtype"},
      {"frozen negative dim",
       [](LayoutSpec& s) {
         s.frozen = {Param("base", {4, -3})};
       },
       "frozen parameter 0 (base) has dimension -3"},
      {"frozen unknown dtype", [](LayoutSpec& s) { s.frozen = {Param("base", {4}, static_cast<DType>(7))}; },
       "frozen parameter 0 (base) has an unknown dtype"},
      {"3 state halves", [](LayoutSpec& s) { s.state_halves = 3; }, "state_halves 3 must be 1 or 2"},
      {"state halves undecided", [](LayoutSpec& s) { s.state_halves = 0; }, "state_halves 0 must be 1 or 2"},
      {"speculation undecided",
       [](LayoutSpec& s) { s.state_halves = 2, s.max_grad_norm = 1, s.speculative_clipping = Speculation::kAuto; },
       "speculative_clipping 2 must be off (0), on (1)"},
      {"speculation without clipping",
       [](LayoutSpec& s) { s.state_halves = 2, s.speculative_clipping = Speculation::kOn; },
       "max_grad_norm is 0: there is no clipping to speculate about"},
      {"speculation with one half",
       [](LayoutSpec& s) { s.max_grad_norm = 1, s.speculative_clipping = Speculation::kOn; },
       "speculative_clipping needs two state halves"},
  };
  for (const auto& [what, change, needle] : cases) {
    SCOPED_TRACE(what);
    LayoutSpec spec = MixedSpec();
    change(spec);
    TS_EXPECT_ERROR(ComputeLayout(spec), Code::kInvalidArgument, needle);
  }
}

// An attach request may leave to the daemon what it decides (state halves 0, speculation kAuto); the
// rest is validated as in ComputeLayout.
TEST(ValidateRequest, AllowsWhatTheDaemonDecidesOnly) {
  LayoutSpec spec = MixedSpec();
  spec.state_halves = 0;
  spec.max_grad_norm = 1.0;
  spec.speculative_clipping = Speculation::kAuto;
  EXPECT_NO_THROW(ValidateRequest(spec));
  spec.speculative_clipping = Speculation::kOn;
  EXPECT_NO_THROW(ValidateRequest(spec));  // 0 halves may become 2
  spec.state_halves = 1;
  TS_EXPECT_ERROR(ValidateRequest(spec), Code::kInvalidArgument, "needs two state halves");
  spec.state_halves = 3;
  TS_EXPECT_ERROR(ValidateRequest(spec), Code::kInvalidArgument, "(or 0: the daemon decides)");
  spec = MixedSpec();
  spec.world_size = 0;
  TS_EXPECT_ERROR(ValidateRequest(spec), Code::kInvalidArgument, "world_size");
}

// A segment created and initialized for `layout`, as the daemon does.
Segment InitializedState(const ScopedSegmentName& name, const JobLayout& layout) {
  Segment segment = Segment::Create(name.str(), layout.state_bytes);
  InitStateSegment(segment.data(), layout);
  return segment;
}

TEST(SegmentHeaders, StateSegmentAcceptsItsOwnLayoutOnly) {
  const JobLayout layout = ComputeLayout(MixedSpec());
  LayoutSpec other_spec = MixedSpec();
  other_spec.world_size = 2;
  const JobLayout other = ComputeLayout(other_spec);
  ScopedSegmentName name;
  Segment segment = InitializedState(name, layout);
  EXPECT_NO_THROW(CheckStateSegment(segment.data(), segment.size(), layout));
  Segment reopened = Segment::Open(name.str());
  EXPECT_NO_THROW(CheckStateSegment(reopened.data(), reopened.size(), layout));
  TS_EXPECT_ERROR(CheckStateSegment(segment.data(), segment.size(), other), Code::kInvalidArgument, "layout");
  TS_EXPECT_ERROR(CheckStateSegment(segment.data(), layout.state_bytes - 64, layout), Code::kInvalidArgument, "bytes");
  const auto* header = static_cast<const StateHeader*>(segment.data());
  EXPECT_EQ(header->completed_step.load(), 0u);
  EXPECT_EQ(header->initialized, 0u);
}

TEST(SegmentHeaders, ZeroedMemoryIsNotAStateOrRankSegment) {
  const JobLayout layout = ComputeLayout(MixedSpec());
  ScopedSegmentName name;
  Segment segment = Segment::Create(name.str(), std::max(layout.state_bytes, layout.rank_bytes));
  TS_EXPECT_ERROR(CheckStateSegment(segment.data(), segment.size(), layout), Code::kInvalidArgument, "format");
  TS_EXPECT_ERROR(CheckRankSegment(segment.data(), segment.size(), layout, 0), Code::kInvalidArgument, "format");
}

TEST(SegmentHeaders, RankSegmentAcceptsItsOwnLayoutAndRankOnly) {
  const JobLayout layout = ComputeLayout(MixedSpec());
  LayoutSpec other_spec = MixedSpec();
  other_spec.params[0].name = "renamed";
  const JobLayout other = ComputeLayout(other_spec);
  ScopedSegmentName name;
  Segment segment = Segment::Create(name.str(), layout.rank_bytes);
  InitRankSegment(segment.data(), layout, 3);
  EXPECT_NO_THROW(CheckRankSegment(segment.data(), segment.size(), layout, 3));
  TS_EXPECT_ERROR(CheckRankSegment(segment.data(), segment.size(), layout, 2), Code::kInvalidArgument, "rank");
  TS_EXPECT_ERROR(CheckRankSegment(segment.data(), segment.size(), other, 3), Code::kInvalidArgument, "layout");
  TS_EXPECT_ERROR(CheckRankSegment(segment.data(), layout.rank_bytes - 1, layout, 3), Code::kInvalidArgument, "bytes");
}

TEST(SegmentHeaders, RankSegmentRingsAreReadyToUse) {
  const JobLayout layout = ComputeLayout(MixedSpec());
  ScopedSegmentName name;
  Segment segment = Segment::Create(name.str(), layout.rank_bytes);
  InitRankSegment(segment.data(), layout, 0);
  const RankView view = ViewRank(segment.data(), layout);
  for (RingHeader* ring : {view.request_ring, view.completion_ring}) {
    RingProducer producer(ring, &view.header->completion_doorbell);
    RingConsumer consumer(ring);
    uint32_t pushed = 0;
    while (producer.TryPush(Message{.kind = MessageKind::kGradReady, .bucket = pushed})) ++pushed;
    EXPECT_EQ(pushed, kRingCapacity);
    Message message;
    ASSERT_TRUE(consumer.TryPop(&message));
    EXPECT_EQ(message.bucket, 0u);
  }
}

}  // namespace
}  // namespace trainstream::shm
