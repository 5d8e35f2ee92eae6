#include "daemon/engine/bucket_passes.h"

#include <array>
#include <cstring>
#include <span>

namespace trainstream::daemon {

namespace {

// The gradient slots of the ranks that have a block's parameter, at the block's first element.
struct SlotList {
  std::array<const void*, 256> pointers{};
  size_t count = 0;
  [[nodiscard]] std::span<const void* const> span() const { return {pointers.data(), count}; }
};

SlotList Slots(const shm::BucketLayout& bucket, uint32_t param, uint64_t byte_in_bucket, const shm::StateView& state,
               const Sources& sources) {
  SlotList list;
  for (const auto& channel : sources) {
    if (channel && channel->view.presence[param] != 0) {
      list.pointers[list.count++] = shm::GradsOf(bucket, state, channel->view) + byte_in_bucket;
    }
  }
  return list;
}

}  // namespace

const shm::BucketLayout& BucketPasses::BucketOf(const Block& block) const {
  return layout_.buckets[layout_.params[block.param].bucket];
}

uint64_t BucketPasses::Element(const Block& block) const {
  return BucketOf(block).elem_offset + layout_.params[block.param].offset_in_bucket + block.begin;
}

uint64_t BucketPasses::ByteInBucket(const Block& block) const {
  return (layout_.params[block.param].offset_in_bucket + block.begin) * SizeOf(BucketOf(block).dtype);
}

// Where the new weights go besides the master weights: nowhere for fp32 buckets (the client reads
// the master weights), the upload region in the bucket's dtype otherwise.
optimizer::Upload BucketPasses::Upload(const Block& block) const {
  const shm::BucketLayout& bucket = BucketOf(block);
  if (bucket.uploads_from_master()) return {nullptr, bucket.dtype};
  return {state_.upload + bucket.upload_offset + ByteInBucket(block), bucket.dtype};
}

void BucketPasses::Accumulate(const Block& block, const Sources& sources, float* accum, bool overwrite) const {
  const shm::BucketLayout& bucket = BucketOf(block);
  const SlotList slots = Slots(bucket, block.param, ByteInBucket(block), state_, sources);
  if (slots.count == 0 && !overwrite) return;
  const optimizer::GradSources grads{.slots = slots.span(), .dtype = bucket.dtype, .accum = nullptr, .scale = 1.0f};
  optimizer::Accumulate(grads, accum + Element(block), overwrite, block.count);
}

double BucketPasses::SumOfSquares(const Block& block, const Sources& sources, const float* accum, float scale,
                                  bool* nonfinite) const {
  const shm::BucketLayout& bucket = BucketOf(block);
  const SlotList slots = Slots(bucket, block.param, ByteInBucket(block), state_, sources);
  const optimizer::GradSources grads{.slots = slots.span(),
                                     .dtype = bucket.dtype,
                                     .accum = accum != nullptr ? accum + Element(block) : nullptr,
                                     .scale = scale};
  return optimizer::SumOfSquares(grads, block.count, nonfinite);
}

std::byte* BucketPasses::Moment(void* region, const Block& block) const {
  return static_cast<std::byte*>(region) + Element(block) * SizeOf(moment_dtype_);
}

bool BucketPasses::Update(const Block& block, const Sources& sources, const float* accum, float scale,
                          const optimizer::AdamWStep& step, uint64_t sr_seed, const shm::StateHalf& from,
                          const shm::StateHalf& to) const {
  return UpdateWithNorm(block, sources, accum, scale, step, sr_seed, from, to, nullptr, nullptr);
}

bool BucketPasses::UpdateWithNorm(const Block& block, const Sources& sources, const float* accum, float scale,
                                  const optimizer::AdamWStep& step, uint64_t sr_seed, const shm::StateHalf& from,
                                  const shm::StateHalf& to, double* sum_of_squares, bool* nonfinite) const {
  const shm::BucketLayout& bucket = BucketOf(block);
  const SlotList slots = Slots(bucket, block.param, ByteInBucket(block), state_, sources);
  const uint64_t element = Element(block);
  const optimizer::GradSources grads{.slots = slots.span(),
                                     .dtype = bucket.dtype,
                                     .accum = accum != nullptr ? accum + element : nullptr,
                                     .scale = scale};
  const optimizer::MomentBuffers moments{.exp_avg = Moment(to.exp_avg, block),
                                         .exp_avg_sq = Moment(to.exp_avg_sq, block),
                                         .dtype = moment_dtype_,
                                         .sr_seed = sr_seed,
                                         // Keyed by (parameter, element of it), not by where the bucket layout put it:
                                         // the same training rounds alike whichever buckets hold the parameter (weight
                                         // paging's partitions regroup them). A block never crosses a 2^32-element
                                         // boundary of its parameter, as the kernels require of the high index bits.
                                         .element_base = (uint64_t{block.param} << 40) + block.begin};
  const optimizer::StateIn in{from.master + element, Moment(from.exp_avg, block), Moment(from.exp_avg_sq, block)};
  if (sum_of_squares == nullptr) {
    return optimizer::AdamWUpdate(grads, step, in, to.master + element, moments, Upload(block), block.count);
  }
  return optimizer::AdamWUpdateWithNorm(grads, step, in, to.master + element, moments, Upload(block), block.count,
                                        sum_of_squares, nonfinite);
}

void BucketPasses::Carry(const Block& block, const shm::StateHalf& from, const shm::StateHalf& to) const {
  if (from.master == to.master) return;
  const uint64_t element = Element(block);
  const size_t moment_bytes = block.count * SizeOf(moment_dtype_);
  std::memcpy(to.master + element, from.master + element, block.count * sizeof(float));
  std::memcpy(Moment(to.exp_avg, block), Moment(from.exp_avg, block), moment_bytes);
  std::memcpy(Moment(to.exp_avg_sq, block), Moment(from.exp_avg_sq, block), moment_bytes);
}

void BucketPasses::UploadMaster(const Block& block, const shm::StateHalf& half) const {
  const optimizer::Upload upload = Upload(block);
  if (upload.data != nullptr) optimizer::ConvertMaster(half.master + Element(block), upload, block.count);
}

void BucketPasses::Touch(const Block& block) const {
  const uint64_t element = Element(block);
  const size_t moment_bytes = block.count * SizeOf(moment_dtype_);
  for (const shm::StateHalf& half : state_.halves) {  // with one half, the same memory twice
    std::memset(half.master + element, 0, block.count * sizeof(float));
    std::memset(Moment(half.exp_avg, block), 0, moment_bytes);
    std::memset(Moment(half.exp_avg_sq, block), 0, moment_bytes);
  }
  if (state_.accum != nullptr) std::memset(state_.accum + element, 0, block.count * sizeof(float));
  const optimizer::Upload upload = Upload(block);
  if (upload.data != nullptr) std::memset(upload.data, 0, block.count * SizeOf(upload.dtype));
}

}  // namespace trainstream::daemon
