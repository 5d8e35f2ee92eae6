#include "shm/job_layout.h"

#include <cmath>
#include <cstring>
#include <new>

#include "shm/error.h"

namespace trainstream::shm {

uint64_t ParamSpec::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

namespace {

constexpr uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

class Hasher {  // FNV-1a: stable across processes and builds
 public:
  void Add(const void* data, size_t size) {
    const auto* bytes = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < size; ++i) hash_ = (hash_ ^ bytes[i]) * 1099511628211ull;
  }
  template <typename T>
  void Add(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>);
    Add(&value, sizeof(value));
  }
  void Add(const std::string& s) {
    Add(s.size());
    Add(s.data(), s.size());
  }
  void Add(const std::vector<std::string>& list) {
    Add(list.size());
    for (const std::string& s : list) Add(s);
  }
  [[nodiscard]] uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = 14695981039346656037ull;
};

void HashParams(Hasher& h, const std::vector<ParamSpec>& params) {
  h.Add(params.size());
  for (const ParamSpec& p : params) {
    h.Add(p.name);
    h.Add(p.shape.size());
    for (int64_t d : p.shape) h.Add(d);
    h.Add(p.dtype);
    h.Add(p.group);
    h.Add(p.partition);
  }
}

uint64_t HashSpec(const LayoutSpec& spec) {
  Hasher h;
  h.Add(kSegmentVersion);
  HashParams(h, spec.params);
  HashParams(h, spec.frozen);
  ForEachOption(spec, [&h](const char*, const auto& option) { h.Add(option); });
  return h.value();
}

constexpr uint64_t kMaxElements = uint64_t{1} << 40;

// A parameter's dtype and dimensions; adds its elements to *total (which must stay below 2^40).
void ValidateParam(const ParamSpec& p, const char* what, size_t i, uint64_t* total) {
  TS_CHECK(IsValidDType(static_cast<uint32_t>(p.dtype)), Code::kInvalidArgument,
           "{} {} ({}) has an unknown dtype code {} (0 float32, 1 bfloat16, 2 float16)", what, i, p.name,
           static_cast<int>(p.dtype));
  TS_CHECK(p.shape.size() <= 16, Code::kInvalidArgument, "{} {} ({}) has {} dimensions", what, i, p.name,
           p.shape.size());
  // numel() wraps silently (2^32 x 2^32 is 0, 512 x (2^55 - 1) is -512): here overflow is caught.
  uint64_t numel = 1;
  bool overflow = false, empty = false;
  for (int64_t d : p.shape) {
    TS_CHECK(d >= 0 && static_cast<uint64_t>(d) < kMaxElements, Code::kInvalidArgument, "{} {} ({}) has dimension {}",
             what, i, p.name, d);
    overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel);
    empty |= d == 0;
  }
  TS_CHECK(empty || (!overflow && numel < kMaxElements), Code::kInvalidArgument, "{} {} ({}) has over 2^40 elements",
           what, i, p.name);
  *total += numel;  // 0 when a dimension is 0, however the product wrapped before it
  TS_CHECK(*total < kMaxElements, Code::kInvalidArgument, "layout has over 2^40 elements");
}

// What the daemon decides at attach: state halves and speculation. `request`: not decided yet may be asked.
void ValidateStateOptions(const LayoutSpec& spec, bool request) {
  TS_CHECK(spec.state_halves == 1 || spec.state_halves == 2 || (request && spec.state_halves == 0),
           Code::kInvalidArgument, "state_halves {} must be 1 or 2{}", spec.state_halves,
           request ? " (or 0: the daemon decides)" : "");
  const auto speculation = static_cast<uint32_t>(spec.speculative_clipping);
  TS_CHECK(speculation <= static_cast<uint32_t>(Speculation::kAuto) &&
               (request || spec.speculative_clipping != Speculation::kAuto),
           Code::kInvalidArgument, "speculative_clipping {} must be off (0), on (1){}", speculation,
           request ? " or automatic (2)" : "");
  if (spec.speculative_clipping != Speculation::kOn) return;
  TS_CHECK(spec.max_grad_norm > 0 || spec.step_terms, Code::kInvalidArgument,
           "speculative_clipping is on, but max_grad_norm is 0: there is no clipping to speculate about");
  TS_CHECK(spec.state_halves != 1, Code::kInvalidArgument,
           "speculative_clipping needs two state halves (the update it redoes starts again from the committed "
           "one), but state_halves is 1");
}

void Validate(const LayoutSpec& spec, bool request) {
  ValidateStateOptions(spec, request);
  TS_CHECK(!spec.params.empty(), Code::kInvalidArgument, "layout has no parameters");
  TS_CHECK(spec.params.size() < (1u << 24), Code::kInvalidArgument, "layout has {} parameters (limit 16M)",
           spec.params.size());
  TS_CHECK(spec.num_groups >= 1 && spec.num_groups <= 4096, Code::kInvalidArgument,
           "num_groups {} out of range [1, 4096]", spec.num_groups);
  TS_CHECK(spec.bucket_bytes >= kMinBucketBytes, Code::kInvalidArgument, "bucket_bytes {} is below {}",
           spec.bucket_bytes, kMinBucketBytes);
  TS_CHECK(spec.moment_dtype == DType::kFloat32 || spec.moment_dtype == DType::kBFloat16, Code::kInvalidArgument,
           "moment dtype {} (code {}) unsupported (float32 or bfloat16)", NameOf(spec.moment_dtype),
           static_cast<int>(spec.moment_dtype));
  TS_CHECK(spec.optimizer == OptimizerKind::kAdamW || spec.optimizer == OptimizerKind::kAdam, Code::kInvalidArgument,
           "unknown optimizer kind {} (0 AdamW, 1 Adam)", static_cast<int>(spec.optimizer));
  TS_CHECK((spec.accumulation_steps >= 1 || spec.step_terms) && spec.accumulation_steps <= kMaxAccumulationSteps,
           Code::kInvalidArgument, "accumulation_steps {} out of range [1, {}]{}", spec.accumulation_steps,
           kMaxAccumulationSteps, spec.step_terms ? " (or 0: counted)" : "");
  TS_CHECK(spec.accumulation_steps != 0 || spec.peers.size() <= 1, Code::kInvalidArgument,
           "a job spanning {} nodes needs its accumulation_steps (the all-reduce starts with the last micro-batch)",
           spec.peers.size());
  TS_CHECK(spec.world_size >= 1 && spec.world_size <= 256, Code::kInvalidArgument,
           "world_size {} out of range [1, 256]", spec.world_size);
  TS_CHECK(std::isfinite(spec.max_grad_norm) && spec.max_grad_norm >= 0, Code::kInvalidArgument,
           "max_grad_norm {} must be finite and >= 0", spec.max_grad_norm);
  TS_CHECK(spec.peers.size() <= 256, Code::kInvalidArgument, "{} peers (limit 256)", spec.peers.size());
  TS_CHECK(spec.node_rank < spec.nodes(), Code::kInvalidArgument, "node_rank {} out of range for {} node(s)",
           spec.node_rank, spec.nodes());
  TS_CHECK(spec.frozen.size() < (1u << 24), Code::kInvalidArgument, "layout has {} frozen parameters (limit 16M)",
           spec.frozen.size());
  uint64_t total = 0;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const ParamSpec& p = spec.params[i];
    ValidateParam(p, "parameter", i, &total);
    TS_CHECK(p.group < spec.num_groups, Code::kInvalidArgument, "parameter {} ({}) is in group {} of {}", i, p.name,
             p.group, spec.num_groups);
  }
  uint64_t frozen = 0;
  for (size_t i = 0; i < spec.frozen.size(); ++i) ValidateParam(spec.frozen[i], "frozen parameter", i, &frozen);
}

}  // namespace

void ValidateRequest(const LayoutSpec& spec) {
  Validate(spec, /*request=*/true);
}

JobLayout ComputeLayout(const LayoutSpec& spec) {
  Validate(spec, /*request=*/false);
  JobLayout layout;
  layout.state_halves = spec.state_halves;
  layout.speculative_clipping = spec.speculative_clipping == Speculation::kOn;
  layout.params.resize(spec.params.size());

  // Reverse registration order, one open bucket per dtype; a new partition closes it.
  int open[3] = {-1, -1, -1};
  for (size_t i = spec.params.size(); i-- > 0;) {
    const ParamSpec& p = spec.params[i];
    const uint64_t elem_align = kAlign / SizeOf(p.dtype);
    const uint64_t numel = p.numel();
    int& b = open[static_cast<int>(p.dtype)];
    if (b >= 0) {
      const BucketLayout& bucket = layout.buckets[b];
      if ((AlignUp(bucket.numel, elem_align) + numel) * SizeOf(p.dtype) > spec.bucket_bytes ||
          bucket.partition != p.partition) {
        b = -1;
      }
    }
    if (b < 0) {
      b = static_cast<int>(layout.buckets.size());
      BucketLayout& bucket = layout.buckets.emplace_back();
      bucket.dtype = p.dtype;
      bucket.partition = p.partition;
    }
    BucketLayout& bucket = layout.buckets[b];
    bucket.numel = AlignUp(bucket.numel, elem_align);
    layout.params[i] =
        ParamLayout{.bucket = static_cast<uint32_t>(b), .offset_in_bucket = bucket.numel, .numel = numel};
    bucket.params.push_back(static_cast<uint32_t>(i));
    bucket.numel += numel;
  }

  const bool one_slot_reader = spec.world_size == 1 && !spec.uses_accumulator() &&
                               spec.speculative_clipping == Speculation::kOff;  // a redo reads them again
  for (BucketLayout& bucket : layout.buckets) {
    bucket.numel = AlignUp(bucket.numel, kAlign / SizeOf(bucket.dtype));
    bucket.elem_offset = layout.total_elems;
    layout.total_elems = AlignUp(layout.total_elems + bucket.numel, 32);  // 64 B in fp32 and in bf16 moments
    bucket.grads_in_upload = one_slot_reader && bucket.partition != 0 && !bucket.uploads_from_master();
    if (!bucket.grads_in_upload) {
      bucket.grad_offset = layout.grad_bytes;
      layout.grad_bytes = AlignUp(layout.grad_bytes + bucket.bytes(), kAlign);
    }
    if (!bucket.uploads_from_master()) {
      bucket.upload_offset = layout.upload_bytes;
      layout.upload_bytes = AlignUp(layout.upload_bytes + bucket.bytes(), kAlign);
    }
  }
  for (const ParamSpec& p : spec.frozen) {
    layout.frozen_offsets.push_back(layout.frozen_bytes);
    layout.frozen_bytes = AlignUp(layout.frozen_bytes + p.numel() * SizeOf(p.dtype), kAlign);
  }
  layout.hash = HashSpec(spec);

  const size_t moment_bytes = layout.total_elems * SizeOf(spec.moment_dtype);
  size_t at = AlignUp(sizeof(StateHeader), kAlign);
  auto take = [&at](size_t bytes) {
    const size_t offset = at;
    at = AlignUp(at + bytes, kAlign);
    return offset;
  };
  // Per half; with one half, [1] names [0]'s memory.
  auto take_halves = [&](size_t(&offsets)[2], size_t bytes) {
    offsets[0] = take(bytes);
    offsets[1] = spec.state_halves == 2 ? take(bytes) : offsets[0];
  };
  take_halves(layout.param_state_offset, sizeof(ParamState) * spec.params.size());
  layout.bucket_state_offset = take(sizeof(BucketState) * layout.buckets.size());
  take_halves(layout.master_offset, layout.total_elems * sizeof(float));
  take_halves(layout.exp_avg_offset, moment_bytes);
  take_halves(layout.exp_avg_sq_offset, moment_bytes);
  layout.accum_offset = spec.uses_accumulator() ? take(layout.total_elems * sizeof(float)) : 0;
  layout.upload_offset = take(layout.upload_bytes);
  layout.frozen_offset = take(layout.frozen_bytes);
  layout.state_bytes = at;

  at = AlignUp(sizeof(RankHeader), kAlign);
  layout.request_ring_offset = take(RingBytes(kRingCapacity));
  layout.completion_ring_offset = take(RingBytes(kRingCapacity));
  layout.hparams_offset = take(sizeof(HParams) * 2 * spec.num_groups);
  layout.presence_offset = take(spec.params.size());
  layout.grads_offset = take(layout.grad_bytes);
  layout.rank_bytes = at;
  return layout;
}

StateView ViewState(void* base, const JobLayout& layout, const LayoutSpec& spec) {
  auto* bytes = static_cast<std::byte*>(base);
  auto half = [&](int h) {
    return StateHalf{
        .param_state = reinterpret_cast<ParamState*>(bytes + layout.param_state_offset[h]),
        .master = reinterpret_cast<float*>(bytes + layout.master_offset[h]),
        .exp_avg = bytes + layout.exp_avg_offset[h],
        .exp_avg_sq = bytes + layout.exp_avg_sq_offset[h],
    };
  };
  return StateView{
      .header = reinterpret_cast<StateHeader*>(bytes),
      .bucket_state = reinterpret_cast<BucketState*>(bytes + layout.bucket_state_offset),
      .halves = {half(0), half(1)},
      .accum = spec.uses_accumulator() ? reinterpret_cast<float*>(bytes + layout.accum_offset) : nullptr,
      .upload = bytes + layout.upload_offset,
      .frozen = bytes + layout.frozen_offset,
  };
}

RankView ViewRank(void* base, const JobLayout& layout) {
  auto* bytes = static_cast<std::byte*>(base);
  return RankView{
      .header = reinterpret_cast<RankHeader*>(bytes),
      .request_ring = reinterpret_cast<RingHeader*>(bytes + layout.request_ring_offset),
      .completion_ring = reinterpret_cast<RingHeader*>(bytes + layout.completion_ring_offset),
      .hparams = reinterpret_cast<HParams*>(bytes + layout.hparams_offset),
      .presence = reinterpret_cast<uint8_t*>(bytes + layout.presence_offset),
      .grads = bytes + layout.grads_offset,
  };
}

std::byte* GradsOf(const BucketLayout& bucket, const StateView& state, const RankView& rank) {
  return bucket.grads_in_upload ? state.upload + bucket.upload_offset : rank.grads + bucket.grad_offset;
}

void InitStateSegment(void* base, const JobLayout& layout) {
  auto* header = new (base) StateHeader();
  header->layout_hash = layout.hash;
  header->state_halves = layout.state_halves;
  header->speculative_clipping =
      static_cast<uint32_t>(layout.speculative_clipping ? Speculation::kOn : Speculation::kOff);
  auto* buckets = reinterpret_cast<BucketState*>(static_cast<std::byte*>(base) + layout.bucket_state_offset);
  for (size_t b = 0; b < layout.buckets.size(); ++b) new (&buckets[b]) BucketState();
}

void InitRankSegment(void* base, const JobLayout& layout, uint32_t rank) {
  auto* header = new (base) RankHeader();
  header->rank = rank;
  header->layout_hash = layout.hash;
  auto* bytes = static_cast<std::byte*>(base);
  InitRing(bytes + layout.request_ring_offset, kRingCapacity);
  InitRing(bytes + layout.completion_ring_offset, kRingCapacity);
}

void CheckStateSegment(const void* base, size_t size, const JobLayout& layout) {
  TS_CHECK(size >= layout.state_bytes, Code::kInvalidArgument, "state segment has {} bytes, layout needs {}", size,
           layout.state_bytes);
  const auto* header = static_cast<const StateHeader*>(base);
  TS_CHECK(header->magic == StateHeader::kMagic && header->version == kSegmentVersion, Code::kInvalidArgument,
           "state segment has a foreign format (magic {:#x}, version {})", header->magic, header->version);
  TS_CHECK(header->layout_hash == layout.hash, Code::kInvalidArgument,
           "state segment was laid out for another layout (hash {:#x}, expected {:#x})", header->layout_hash,
           layout.hash);
}

void CheckRankSegment(const void* base, size_t size, const JobLayout& layout, uint32_t rank) {
  TS_CHECK(size >= layout.rank_bytes, Code::kInvalidArgument, "rank segment has {} bytes, layout needs {}", size,
           layout.rank_bytes);
  const auto* header = static_cast<const RankHeader*>(base);
  TS_CHECK(header->magic == RankHeader::kMagic && header->version == kSegmentVersion, Code::kInvalidArgument,
           "rank segment has a foreign format (magic {:#x}, version {})", header->magic, header->version);
  TS_CHECK(header->layout_hash == layout.hash && header->rank == rank, Code::kInvalidArgument,
           "rank segment belongs to another layout or rank");
}

}  // namespace trainstream::shm
