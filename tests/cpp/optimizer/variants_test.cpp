// Every kernel variant this CPU supports against the portable scalar reference, bit for bit: all dtype
// combinations, 1..4 ranks, with and without accumulator, sizes 1 through several vector widths plus
// tails, misaligned starts, and sizes large enough to take the streaming-store path. Bit-exact (0 ulp)
// is the contract: the variants perform the same IEEE operations in the same order (adamw_element.h).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "daemon/optimizer/adamw_kernels.h"
#include "daemon/optimizer/kernel_table.h"
#include "shm/error.h"
#include "tests/cpp/optimizer/test_util.h"

namespace trainstream::optimizer {
namespace {

using testing::Buffer;
using testing::FillUniform;

std::vector<size_t> TestSizes() {
  std::vector<size_t> sizes;
  for (size_t n = 1; n <= 70; ++n) sizes.push_back(n);  // 16-lane AVX-512: up to 4 vectors + tails
  for (size_t n : {127, 128, 129, 255, 257, 1000, 1023}) sizes.push_back(n);
  return sizes;
}

struct Grads {
  std::vector<Buffer> slots;
  std::vector<const void*> pointers;
  Buffer accum;
  GradSources sources;

  Grads(DType dtype, size_t ranks, bool with_accum, size_t n, size_t misalign, std::mt19937_64& rng) {
    for (size_t r = 0; r < ranks; ++r) {
      slots.emplace_back(dtype, n, (misalign + r) % 5);
      FillUniform(slots.back(), rng, -2.0f, 2.0f);
    }
    for (auto& slot : slots) pointers.push_back(slot.data());
    if (with_accum) {
      accum = Buffer(DType::kFloat32, n, misalign);
      FillUniform(accum, rng, -1.0f, 1.0f);
    }
    sources.slots = pointers;
    sources.dtype = dtype;
    sources.accum = with_accum ? accum.f32() : nullptr;
    sources.scale = 1.0f / static_cast<float>(ranks + 1) * 0.7f;
  }
};

// How an update reaches its state: in place, or out of place (the update reads the state and writes
// another one, the other half of a double buffer, at the given misalignment).
struct Placement {
  bool out_of_place = false;
  size_t misalign = 0;
};

// The state one update touches, so two copies can run side by side and be compared.
struct State {
  Buffer master, exp_avg, exp_avg_sq, upload;
  bool has_upload;
  bool nonfinite = false;  // what the last update returned

  State(size_t n, DType moment, bool has_upload_, DType upload_dtype, size_t misalign, std::mt19937_64& rng)
      : master(DType::kFloat32, n, misalign),
        exp_avg(moment, n, misalign + 1),
        exp_avg_sq(moment, n, misalign + 2),
        upload(upload_dtype, n, misalign + 3),
        has_upload(has_upload_) {
    FillUniform(master, rng, -1.0f, 1.0f);
    FillUniform(exp_avg, rng, -0.1f, 0.1f);
    FillUniform(exp_avg_sq, rng, 0.0f, 0.01f);
  }
  State Copy() const {
    State copy = *this;
    return copy;
  }
  // Out of place the state read must stay as it was, and the state written (which starts as garbage)
  // becomes this state.
  void Run(const KernelTable& kernel, const GradSources& grads, const AdamWStep& step, uint64_t seed, size_t n,
           Placement placement = {}) {
    Upload up{has_upload ? upload.data() : nullptr, upload.dtype()};
    if (!placement.out_of_place) {
      MomentBuffers moments{exp_avg.data(), exp_avg_sq.data(), exp_avg.dtype(), seed, 1000003};
      nonfinite = testing::UpdateInPlace(kernel, grads, step, master.f32(), moments, up, n);
      return;
    }
    const State read = *this;
    State written = *this;
    for (Buffer* buffer : {&written.master, &written.exp_avg, &written.exp_avg_sq}) {
      *buffer = buffer->CopyAt(placement.misalign);
      if (buffer->bytes() != 0) std::memset(buffer->data(), 0xA5, buffer->bytes());
    }
    const StateIn in{master.f32(), exp_avg.data(), exp_avg_sq.data()};
    MomentBuffers moments{written.exp_avg.data(), written.exp_avg_sq.data(), exp_avg.dtype(), seed, 1000003};
    nonfinite = kernel.update(grads, step, in, written.master.f32(), moments, up, n);
    EXPECT_TRUE(master.SameBytes(read.master) && exp_avg.SameBytes(read.exp_avg) &&
                exp_avg_sq.SameBytes(read.exp_avg_sq))
        << "the out-of-place update changed the state it read";
    master = written.master, exp_avg = written.exp_avg, exp_avg_sq = written.exp_avg_sq;
  }
};

class VariantTest : public ::testing::TestWithParam<std::string> {
 protected:
  const KernelTable& kernel() const { return KernelByName(GetParam()); }
  const KernelTable& reference() const { return PortableKernels(); }
};

void ExpectSameState(State& a, State& b, const std::string& what) {
  EXPECT_TRUE(a.master.SameBytes(b.master)) << what << ": master";
  EXPECT_TRUE(a.exp_avg.SameBytes(b.exp_avg)) << what << ": exp_avg";
  EXPECT_TRUE(a.exp_avg_sq.SameBytes(b.exp_avg_sq)) << what << ": exp_avg_sq";
  if (a.has_upload) {
    EXPECT_TRUE(a.upload.SameBytes(b.upload)) << what << ": upload";
  }
}

void CheckUpdate(const KernelTable& kernel, size_t n, size_t misalign, DType grad, size_t ranks, bool accum,
                 DType moment, int upload, bool decoupled, int* failures, Placement placement = {}) {
  std::mt19937_64 rng(n * 1315423911u + misalign * 7 + ranks * 131 + static_cast<size_t>(grad) * 17);
  Grads grads(grad, ranks, accum, n, misalign, rng);
  const bool has_upload = upload >= 0;
  const DType upload_dtype = has_upload ? static_cast<DType>(upload) : DType::kFloat32;
  State expected(n, moment, has_upload, upload_dtype, misalign, rng);
  State actual = expected.Copy();
  const AdamWStep step = AdamWStep::For(1e-3, 0.9, 0.999, 1e-8, decoupled ? 0.01 : 0.1, decoupled, 7);
  expected.Run(PortableKernels(), grads.sources, step, 0xC0FFEE, n);
  actual.Run(kernel, grads.sources, step, 0xC0FFEE, n, placement);
  const std::string what = ::testing::PrintToString(std::make_tuple(
      n, misalign, NameOf(grad), ranks, accum, NameOf(moment), upload, decoupled, placement.out_of_place));
  ExpectSameState(expected, actual, what);
  EXPECT_FALSE(actual.nonfinite) << what;
  if (::testing::Test::HasFailure()) ++*failures;
}

TEST_P(VariantTest, UpdateMatchesReferenceBitForBit) {
  int failures = 0;
  for (size_t n : TestSizes()) {
    for (DType grad : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (DType moment : {DType::kFloat32, DType::kBFloat16}) {
        for (int upload : {-1, 0, 1, 2}) {
          for (size_t ranks : {1, 2, 4}) {
            const size_t misalign = (n + ranks) % 3;
            const bool accum = (n % 2) == 1;
            const bool decoupled = (n % 4) != 0;
            CheckUpdate(kernel(), n, misalign, grad, ranks, accum, moment, upload, decoupled, &failures);
            CheckUpdate(kernel(), n, misalign, grad, ranks, accum, moment, upload, decoupled, &failures,
                        {.out_of_place = true, .misalign = (n + 1) % 3});
            if (failures > 0) return;
          }
        }
      }
    }
  }
}

TEST_P(VariantTest, UpdateMatchesReferenceOnStreamingSizes) {
  // Large enough for non-temporal stores (>= 64 KiB of upload; out of place, of master weights too), with
  // an unaligned start and a tail; out of place with the written state aligned like the read one or not.
  int failures = 0;
  for (size_t misalign : {0, 1, 7}) {
    for (DType moment : {DType::kFloat32, DType::kBFloat16}) {
      for (int upload : {-1, 0, 1, 2}) {
        for (Placement placement : {Placement{}, Placement{true, misalign}, Placement{true, misalign + 3}}) {
          CheckUpdate(kernel(), 40000 + 13, misalign, DType::kBFloat16, 2, false, moment, upload, true, &failures,
                      placement);
          CheckUpdate(kernel(), 20000 + 5, misalign, DType::kFloat32, 1, true, moment, upload, false, &failures,
                      placement);
          if (failures > 0) return;
        }
      }
    }
  }
}

// The update writes exactly its range: the AVX-512 variants run heads and tails as masked vectors, and a
// store past either end would corrupt the neighbouring block in the daemon. Every buffer gets guard elements
// on both sides of the range; they must keep their bytes (also the upload's, ordinary and streamed), in
// place and out of place (where the state read must not change at all).
TEST_P(VariantTest, UpdateTouchesNothingOutsideItsRange) {
  constexpr size_t kGuard = 40;
  std::vector<size_t> sizes = TestSizes();
  sizes.push_back(40000 + 13);  // streamed stores, with the alignment head
  for (size_t n : sizes) {
    for (DType moment : {DType::kFloat32, DType::kBFloat16}) {
      for (int upload : {0, 1, 2}) {
        for (size_t ranks : {size_t{1}, size_t{2}}) {
          for (bool out_of_place : {false, true}) {
            const size_t misalign = n % 7;
            std::mt19937_64 rng(n * 31 + ranks);
            Grads grads(DType::kBFloat16, ranks, ranks == 2, n + 2 * kGuard, misalign, rng);
            for (const void*& pointer : grads.pointers) pointer = static_cast<const uint16_t*>(pointer) + kGuard;
            grads.sources.slots = grads.pointers;
            if (grads.sources.accum != nullptr) grads.sources.accum += kGuard;
            State state(n + 2 * kGuard, moment, true, static_cast<DType>(upload), misalign, rng);
            const State before = state.Copy();
            const State source = state.Copy();  // what an out-of-place update reads
            const size_t moment_bytes = SizeOf(moment), upload_bytes = SizeOf(static_cast<DType>(upload));
            const AdamWStep step = AdamWStep::For(1e-3, 0.9, 0.999, 1e-8, 0.01, true, 7);
            auto at = [&](const Buffer& buffer, size_t element) {
              return static_cast<char*>(const_cast<void*>(buffer.data())) + kGuard * element;
            };
            MomentBuffers moments{at(state.exp_avg, moment_bytes), at(state.exp_avg_sq, moment_bytes), moment, 99,
                                  12345};
            Upload up{at(state.upload, upload_bytes), static_cast<DType>(upload)};
            float* master = state.master.f32() + kGuard;
            const StateIn in = out_of_place
                                   ? StateIn{reinterpret_cast<const float*>(at(source.master, 4)),
                                             at(source.exp_avg, moment_bytes), at(source.exp_avg_sq, moment_bytes)}
                                   : StateIn::InPlace(master, moments);
            kernel().update(grads.sources, step, in, master, moments, up, n);
            const std::string what =
                ::testing::PrintToString(std::make_tuple(n, NameOf(moment), upload, ranks, out_of_place));
            for (auto [after, original] : {std::pair{&state.master, &before.master},
                                           {&state.exp_avg, &before.exp_avg},
                                           {&state.exp_avg_sq, &before.exp_avg_sq},
                                           {&state.upload, &before.upload}}) {
              const size_t bytes = SizeOf(after->dtype());
              const auto* a = static_cast<const char*>(after->data());
              const auto* b = static_cast<const char*>(original->data());
              ASSERT_EQ(std::memcmp(a, b, kGuard * bytes), 0) << what << ": before the range";
              ASSERT_EQ(std::memcmp(a + (kGuard + n) * bytes, b + (kGuard + n) * bytes, kGuard * bytes), 0)
                  << what << ": after the range";
              if (after == &state.master) {  // and the range itself was updated
                ASSERT_NE(std::memcmp(a + kGuard * bytes, b + kGuard * bytes, n * bytes), 0) << what << ": not updated";
              }
            }
            ASSERT_TRUE(source.master.SameBytes(before.master) && source.exp_avg.SameBytes(before.exp_avg) &&
                        source.exp_avg_sq.SameBytes(before.exp_avg_sq))
                << what << ": the state read changed";
          }
        }
      }
    }
  }
}

TEST_P(VariantTest, RepeatedStepsStayIdentical) {
  // 20 steps of every variant against 20 of the reference: no drift from any 1-ulp difference.
  const size_t n = 1000 + 3;
  std::mt19937_64 rng(42);
  State expected(n, DType::kBFloat16, true, DType::kBFloat16, 1, rng);
  State actual = expected.Copy();
  for (uint64_t t = 1; t <= 20; ++t) {
    Grads grads(DType::kBFloat16, 2, false, n, 2, rng);
    const AdamWStep step = AdamWStep::For(1e-2, 0.9, 0.999, 1e-8, 0.01, true, t);
    expected.Run(PortableKernels(), grads.sources, step, 1000 + t, n);
    actual.Run(kernel(), grads.sources, step, 1000 + t, n, {.out_of_place = t % 2 == 0, .misalign = t % 3});
  }
  ExpectSameState(expected, actual, "20 steps, every other one out of place");
}

// Speculative clipping's pass: the update of update_with_norm equals update's, and its squared norm equals
// sum_of_squares's, bit for bit (the engine compares a speculated step with one that waited for the norm),
// in the fused case (stores aligned: no peel, the main loop's reads summed as they come) and every other
// (misaligned, tails, several sources and an accumulator, streamed stores, a non-finite gradient).
void CheckUpdateWithNorm(const KernelTable& kernel, size_t n, size_t misalign, DType grad, size_t ranks, DType moment,
                         bool poisoned, int* failures) {
  std::mt19937_64 rng(n * 2654435761u + misalign * 7 + ranks);
  Grads grads(grad, ranks, ranks > 1, n, misalign, rng);
  if (poisoned) grads.slots[0].Set(n / 2, INFINITY);
  State plain(n, moment, true, DType::kBFloat16, misalign, rng);
  State fused = plain.Copy();
  const AdamWStep step = AdamWStep::For(1e-3, 0.9, 0.999, 1e-8, 0.01, true, 7);
  auto buffers = [&](State& state) {
    return MomentBuffers{state.exp_avg.data(), state.exp_avg_sq.data(), moment, 0xC0FFEE, 1000003};
  };
  MomentBuffers m = buffers(plain);
  plain.nonfinite = kernel.update(grads.sources, step, StateIn::InPlace(plain.master.f32(), m), plain.master.f32(), m,
                                  Upload{plain.upload.data(), DType::kBFloat16}, n);
  m = buffers(fused);
  double sum = 0;
  bool bad = false;
  fused.nonfinite =
      kernel.update_with_norm(grads.sources, step, StateIn::InPlace(fused.master.f32(), m), fused.master.f32(), m,
                              Upload{fused.upload.data(), DType::kBFloat16}, n, &sum, &bad);
  bool expected_bad = false;
  const double expected = kernel.sum_of_squares(grads.sources, n, &expected_bad);
  const std::string what =
      ::testing::PrintToString(std::make_tuple(n, misalign, NameOf(grad), ranks, NameOf(moment), poisoned));
  ExpectSameState(plain, fused, what);
  EXPECT_EQ(plain.nonfinite, fused.nonfinite) << what;
  EXPECT_EQ(std::bit_cast<uint64_t>(sum), std::bit_cast<uint64_t>(expected))
      << what << ": " << sum << " vs " << expected;
  EXPECT_EQ(bad, expected_bad) << what;
  EXPECT_EQ(bad, poisoned) << what;
  if (::testing::Test::HasFailure()) ++*failures;
}

TEST_P(VariantTest, UpdateWithNormEqualsTheUpdateAndTheNormPass) {
  int failures = 0;
  std::vector<size_t> sizes = TestSizes();
  sizes.insert(sizes.end(), {20000 + 5, 40000 + 13, size_t{1} << 16});  // streamed stores; the engine's block
  for (size_t n : sizes) {
    for (DType grad : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (DType moment : {DType::kFloat32, DType::kBFloat16}) {
        for (size_t ranks : {1, 2}) {
          for (size_t misalign : {size_t{0}, n % 5 + 1}) {
            CheckUpdateWithNorm(kernel(), n, misalign, grad, ranks, moment, /*poisoned=*/n == 37 || n == 40013,
                                &failures);
            if (failures > 0) return;
          }
        }
      }
    }
  }
}

TEST_P(VariantTest, SumOfSquaresMatchesReference) {
  for (size_t n : TestSizes()) {
    for (DType grad : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (size_t ranks : {1, 3}) {
        std::mt19937_64 rng(n + ranks);
        Grads grads(grad, ranks, n % 2 == 0, n, n % 3, rng);
        bool bad_ref = false, bad = false;
        const double expected = reference().sum_of_squares(grads.sources, n, &bad_ref);
        const double actual = kernel().sum_of_squares(grads.sources, n, &bad);
        // Summation order differs (per-lane partial sums); each term is exact in double.
        EXPECT_NEAR(actual, expected, 1e-12 * expected) << n;
        EXPECT_FALSE(bad);
        EXPECT_FALSE(bad_ref);
      }
    }
  }
}

TEST_P(VariantTest, SumOfSquaresFlagsNonFinite) {
  for (float special : {INFINITY, -INFINITY, NAN}) {
    for (size_t where : {0, 5, 16, 37, 99}) {
      std::mt19937_64 rng(where);
      Grads grads(DType::kFloat32, 2, false, 100, 0, rng);
      grads.slots[1].Set(where, special);
      bool bad = false;
      const double sum = kernel().sum_of_squares(grads.sources, 100, &bad);
      EXPECT_TRUE(bad) << where;
      EXPECT_FALSE(std::isfinite(sum));
    }
  }
  std::mt19937_64 rng(1);
  Grads grads(DType::kFloat32, 1, false, 100, 0, rng);
  grads.slots[0].Set(3, 3.0e38f);  // large but finite: no false alarm
  bool bad = false;
  kernel().sum_of_squares(grads.sources, 100, &bad);
  EXPECT_FALSE(bad);
}

TEST_P(VariantTest, AccumulateMatchesReferenceBitForBit) {
  for (size_t n : TestSizes()) {
    for (DType grad : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (bool overwrite : {false, true}) {
        std::mt19937_64 rng(n * 3 + overwrite);
        Grads grads(grad, 1 + n % 4, false, n, n % 5, rng);
        Buffer expected(DType::kFloat32, n, n % 3);
        FillUniform(expected, rng, -1.0f, 1.0f);
        Buffer actual = expected.CopyAt((n + 1) % 3);
        reference().accumulate(grads.sources, expected.f32(), overwrite, n);
        kernel().accumulate(grads.sources, actual.f32(), overwrite, n);
        ASSERT_TRUE(expected.SameBytes(actual)) << n << " " << NameOf(grad) << " " << overwrite;
      }
    }
  }
}

// Floats that exercise every conversion corner: all bf16 and fp16 values as floats, their midpoints
// (ties), neighbours of ties, denormals, overflow, inf, NaN.
std::vector<float> ConversionInputs() {
  std::vector<float> values;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float b = BF16ToFloat(static_cast<uint16_t>(h));
    values.push_back(b);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    for (uint32_t low : {0x8000u, 0x7FFFu, 0x8001u, 0x1000u}) values.push_back(std::bit_cast<float>(bits | low));
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    const uint32_t fbits = std::bit_cast<uint32_t>(f);
    for (uint32_t low : {0u, 0x1000u, 0xFFFu, 0x1001u}) values.push_back(std::bit_cast<float>(fbits | low));
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 100000; ++i) values.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  return values;
}

TEST_P(VariantTest, ConvertMasterMatchesReference) {
  const std::vector<float> values = ConversionInputs();
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (size_t misalign : {0, 1}) {
      Buffer master(DType::kFloat32, values.size(), misalign);
      std::memcpy(master.data(), values.data(), master.bytes());
      Buffer expected(dtype, values.size(), 0), actual(dtype, values.size(), misalign + 2);
      reference().convert_master(master.f32(), Upload{expected.data(), dtype}, values.size());
      kernel().convert_master(master.f32(), Upload{actual.data(), dtype}, values.size());
      size_t mismatches = 0;
      for (size_t i = 0; i < values.size(); ++i) {
        const float e = expected.Get(i), a = actual.Get(i);
        // fp16 NaN payloads may differ (VCVTPS2PH keeps payload bits); NaN-ness must not.
        const bool same = std::isnan(e) ? std::isnan(a) : std::bit_cast<uint32_t>(e) == std::bit_cast<uint32_t>(a);
        if (!same && ++mismatches < 5) {
          ADD_FAILURE() << NameOf(dtype) << " input bits 0x" << std::hex << std::bit_cast<uint32_t>(values[i])
                        << " expected 0x" << std::bit_cast<uint32_t>(e) << " got 0x" << std::bit_cast<uint32_t>(a);
        }
      }
      EXPECT_EQ(mismatches, 0u) << NameOf(dtype);
    }
  }
}

// The fused update's own conversions on every corner value: the master weights are the conversion inputs
// (denormals, ties, inf, NaN) and stay as they are (lr = 0), so the upload converts each of them, in the
// two-vector path of the bf16-moment loop too; the gradients are the same values, so the moments see
// denormals, inf and NaN as well. Streaming and ordinary stores, bit for bit against the reference.
TEST_P(VariantTest, UpdateConvertsEveryCornerValueLikeTheReference) {
  const std::vector<float> values = ConversionInputs();
  for (size_t n : {values.size(), size_t{4099}}) {  // >= 64 KiB of upload streams; small: ordinary stores
    for (DType moment : {DType::kFloat32, DType::kBFloat16}) {
      for (DType upload : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        Buffer grad(DType::kFloat32, n, 1);
        std::memcpy(grad.data(), values.data() + (values.size() - n), grad.bytes());
        const void* slot = grad.data();
        const GradSources grads{std::span<const void* const>(&slot, 1), DType::kFloat32, nullptr, 1.0f};
        std::mt19937_64 rng(n);
        State expected(n, moment, true, upload, 0, rng);
        std::memcpy(expected.master.data(), values.data(), expected.master.bytes());
        State actual = expected.Copy();
        const AdamWStep step = AdamWStep::For(0.0, 0.9, 0.999, 1e-8, 0.01, true, 3);
        expected.Run(PortableKernels(), grads, step, 0xBEEF, n);
        actual.Run(kernel(), grads, step, 0xBEEF, n);
        if (upload == DType::kFloat16) {  // fp16 NaN payloads may differ (see above): compare without them
          for (size_t i = 0; i < n; ++i) {
            if (std::isnan(expected.upload.Get(i)) && std::isnan(actual.upload.Get(i))) {
              expected.upload.Set(i, NAN), actual.upload.Set(i, NAN);
            }
          }
        }
        ExpectSameState(expected, actual, ::testing::PrintToString(std::make_tuple(n, NameOf(moment), NameOf(upload))));
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

TEST_P(VariantTest, GradientLoadsAreExactForEveryHalfValue) {
  // bf16/fp16 -> fp32 widening on all 65536 bit patterns (via Accumulate with scale 1, overwrite).
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    Buffer grads(dtype, 0x10000, 1);
    for (uint32_t h = 0; h < 0x10000; ++h) static_cast<uint16_t*>(grads.data())[h] = static_cast<uint16_t>(h);
    const void* slot = grads.data();
    GradSources sources{std::span<const void* const>(&slot, 1), dtype, nullptr, 1.0f};
    Buffer expected(DType::kFloat32, 0x10000, 0), actual(DType::kFloat32, 0x10000, 3);
    reference().accumulate(sources, expected.f32(), true, 0x10000);
    kernel().accumulate(sources, actual.f32(), true, 0x10000);
    for (uint32_t h = 0; h < 0x10000; ++h) {
      const float e = expected.Get(h), a = actual.Get(h);
      if (std::isnan(e)) {
        ASSERT_TRUE(std::isnan(a)) << h;
      } else {
        ASSERT_EQ(std::bit_cast<uint32_t>(e), std::bit_cast<uint32_t>(a)) << NameOf(dtype) << " 0x" << std::hex << h;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Supported, VariantTest, ::testing::ValuesIn(testing::SupportedKernelNames()),
                         [](const auto& info) { return info.param; });

TEST(Dispatch, ActiveKernelIsTheBestSupportedOrTheForcedOne) {
  const char* forced = std::getenv("TRAINSTREAM_KERNEL");
  const std::string expected = forced != nullptr && *forced != '\0'
                                   ? (std::string(forced) == "scalar" ? "portable" : forced)
                                   : SupportedKernels().front()->name;
  EXPECT_EQ(ActiveKernelName(), expected);
  EXPECT_EQ(std::string(SupportedKernels().back()->name), "portable");
}

// The update's return value: whether a new master weight is inf or NaN, wherever it lies (vector body,
// masked or scalar head and tail), in place and out of place, and nothing for large finite values.
TEST_P(VariantTest, UpdateReportsNonFiniteWeightsAnywhere) {
  const AdamWStep step = AdamWStep::For(1e-3, 0.9, 0.999, 0.0, 0.0, true, 1);  // eps 0: 0/0 where g = v = 0
  for (const size_t n : {size_t{1}, size_t{7}, size_t{64}, size_t{1000}, size_t{40000 + 13}}) {
    for (Placement placement : {Placement{}, Placement{true, 0}}) {
      std::mt19937_64 rng(n);
      Grads grads(DType::kFloat32, 1, false, n, 1, rng);
      State clean(n, DType::kFloat32, false, DType::kFloat32, 1, rng);
      clean.master.Set(0, 3.0e38f);
      clean.Run(kernel(), grads.sources, step, 1, n, placement);
      EXPECT_FALSE(clean.nonfinite) << n;
      for (const float bad : {INFINITY, -INFINITY, NAN}) {
        for (const size_t where : {size_t{0}, n / 2, n - 1}) {
          Grads bad_grads(DType::kFloat32, 1, false, n, 1, rng);
          bad_grads.slots[0].Set(where, bad);
          State state(n, DType::kFloat32, false, DType::kFloat32, 1, rng);
          state.Run(kernel(), bad_grads.sources, step, 1, n, placement);
          EXPECT_TRUE(state.nonfinite) << n << " at " << where << " " << bad << " " << placement.out_of_place;
        }
      }
    }
  }
}

TEST(Dispatch, UnknownOrUnsupportedKernelIsAClearError) {
  EXPECT_THROW(KernelByName("sse9"), Error);
  EXPECT_EQ(std::string(KernelByName("scalar").name), "portable");
}

}  // namespace
}  // namespace trainstream::optimizer
