#include "daemon/engine/bucket_passes.h"

#include <array>
#include <cstring>
#include <span>

namespace trainstream::daemon {

namespace {

// The gradient slots of the ranks that have a piece's parameter, at the piece's first element.
struct SlotList {
  std::array<const void*, 256> pointers{};
  size_t count = 0;
  [[nodiscard]] std::span<const void* const> span() const { return {pointers.data(), count}; }
};

SlotList Slots(const shm::BucketLayout& bucket, uint32_t param, uint64_t byte_in_bucket, const Sources& sources) {
  SlotList list;
  for (const auto& channel : sources) {
    if (channel && channel->view.presence[param] != 0) {
      list.pointers[list.count++] = channel->view.grads + bucket.grad_offset + byte_in_bucket;
    }
  }
  return list;
}

}  // namespace

const shm::BucketLayout& BucketPasses::BucketOf(const Piece& piece) const {
  return layout_.buckets[layout_.params[piece.param].bucket];
}

uint64_t BucketPasses::Element(const Piece& piece) const {
  return BucketOf(piece).elem_offset + layout_.params[piece.param].offset_in_bucket + piece.begin;
}

uint64_t BucketPasses::ByteInBucket(const Piece& piece) const {
  return (layout_.params[piece.param].offset_in_bucket + piece.begin) * SizeOf(BucketOf(piece).dtype);
}

// Where the new weights go besides the master weights: nowhere for fp32 buckets (the client reads
// the master weights), the upload region in the bucket's dtype otherwise.
optimizer::Upload BucketPasses::Upload(const Piece& piece) const {
  const shm::BucketLayout& bucket = BucketOf(piece);
  if (bucket.uploads_from_master()) return {nullptr, bucket.dtype};
  return {state_.upload + bucket.upload_offset + ByteInBucket(piece), bucket.dtype};
}

void BucketPasses::Accumulate(const Piece& piece, const Sources& sources, bool overwrite) const {
  const shm::BucketLayout& bucket = BucketOf(piece);
  const SlotList slots = Slots(bucket, piece.param, ByteInBucket(piece), sources);
  if (slots.count == 0 && !overwrite) return;
  const optimizer::GradSources grads{.slots = slots.span(), .dtype = bucket.dtype, .accum = nullptr, .scale = 1.0f};
  optimizer::Accumulate(grads, state_.accum + Element(piece), overwrite, piece.count);
}

double BucketPasses::SumOfSquares(const Piece& piece, const Sources& sources, float scale, bool* nonfinite) const {
  const shm::BucketLayout& bucket = BucketOf(piece);
  const SlotList slots = Slots(bucket, piece.param, ByteInBucket(piece), sources);
  const optimizer::GradSources grads{.slots = slots.span(),
                                     .dtype = bucket.dtype,
                                     .accum = state_.accum != nullptr ? state_.accum + Element(piece) : nullptr,
                                     .scale = scale};
  return optimizer::SumOfSquares(grads, piece.count, nonfinite);
}

bool BucketPasses::Update(const Piece& piece, const Sources& sources, float scale, const optimizer::AdamWStep& step,
                          uint64_t sr_seed) const {
  const shm::BucketLayout& bucket = BucketOf(piece);
  const SlotList slots = Slots(bucket, piece.param, ByteInBucket(piece), sources);
  const uint64_t element = Element(piece);
  const size_t moment_size = SizeOf(moment_dtype_);
  const optimizer::GradSources grads{.slots = slots.span(),
                                     .dtype = bucket.dtype,
                                     .accum = state_.accum != nullptr ? state_.accum + element : nullptr,
                                     .scale = scale};
  const optimizer::MomentBuffers moments{
      .exp_avg = static_cast<std::byte*>(state_.exp_avg) + element * moment_size,
      .exp_avg_sq = static_cast<std::byte*>(state_.exp_avg_sq) + element * moment_size,
      .dtype = moment_dtype_,
      .sr_seed = sr_seed,
      .element_base = element};
  optimizer::AdamWUpdate(grads, step, state_.master + element, moments, Upload(piece), piece.count);
  return optimizer::AnyNonFinite(state_.master + element, piece.count);
}

void BucketPasses::UploadMaster(const Piece& piece) const {
  const optimizer::Upload upload = Upload(piece);
  if (upload.data != nullptr) optimizer::ConvertMaster(state_.master + Element(piece), upload, piece.count);
}

void BucketPasses::Touch(const Piece& piece) const {
  const uint64_t element = Element(piece);
  const size_t moment_size = SizeOf(moment_dtype_);
  std::memset(state_.master + element, 0, piece.count * sizeof(float));
  std::memset(static_cast<std::byte*>(state_.exp_avg) + element * moment_size, 0, piece.count * moment_size);
  std::memset(static_cast<std::byte*>(state_.exp_avg_sq) + element * moment_size, 0, piece.count * moment_size);
  if (state_.accum != nullptr) std::memset(state_.accum + element, 0, piece.count * sizeof(float));
  const optimizer::Upload upload = Upload(piece);
  if (upload.data != nullptr) std::memset(upload.data, 0, piece.count * SizeOf(upload.dtype));
}

}  // namespace trainstream::daemon
