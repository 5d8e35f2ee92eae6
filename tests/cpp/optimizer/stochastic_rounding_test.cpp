// bf16 stochastic rounding of the moments: unbiased (the mean over many seeds is within 3e-5 of the fp32
// value), reproducible (same seed and element -> same bits, in every variant), and element-indexed (the
// rounding of an element does not depend on where a range starts).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <random>
#include <span>
#include <vector>

#include "daemon/optimizer/adamw_kernels.h"
#include "daemon/optimizer/float_convert.h"
#include "daemon/optimizer/kernel_table.h"
#include "tests/cpp/optimizer/test_util.h"

namespace trainstream::optimizer {
namespace {

class StochasticRounding : public ::testing::TestWithParam<std::string> {};

// With beta1 = 0 and exp_avg = 0 on entry, the update computes exp_avg = 0 + 1 * (g - 0) = g exactly, so the
// stored bf16 is the stochastic rounding of the known fp32 value g; lr = 0 leaves master alone.
TEST_P(StochasticRounding, MeanOfManyRoundingsIsTheFp32Value) {
  const KernelTable& kernel = KernelByName(GetParam());
  const size_t n = 64;
  // Gradient values that are not bf16-representable; with beta1 = 0, exp_avg becomes g exactly (in fp32).
  std::vector<float> g(n);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& x : g) x = dist(rng);
  const int trials = 20000;
  std::vector<double> mean(n, 0.0);
  std::vector<uint16_t> m(n), v(n);
  std::vector<float> master(n);
  const void* slot = g.data();
  GradSources grads{std::span<const void* const>(&slot, 1), DType::kFloat32, nullptr, 1.0f};
  const AdamWStep step = AdamWStep::For(0.0, 0.0, 0.999, 1e-8, 0.0, true, 1);
  for (int trial = 0; trial < trials; ++trial) {
    std::fill(m.begin(), m.end(), uint16_t{0});
    MomentBuffers moments{m.data(), v.data(), DType::kBFloat16, 0x5EED0000ull + static_cast<uint64_t>(trial) * 7919, 0};
    kernel.update(grads, step, master.data(), moments, Upload{}, n);
    for (size_t i = 0; i < n; ++i) mean[i] += BF16ToFloat(m[i]);
  }
  for (size_t i = 0; i < n; ++i) {
    mean[i] /= trials;
    EXPECT_NEAR(mean[i], g[i], 3e-5) << i;
    // And it is a rounding: every result is one of the two neighbouring bf16 values.
    EXPECT_LE(std::abs(BF16ToFloat(m[i]) - g[i]), std::abs(g[i]) * 0x1p-7f) << i;
  }
}

TEST_P(StochasticRounding, SameSeedAndElementGiveSameBitsWhateverTheRangeStart) {
  const KernelTable& kernel = KernelByName(GetParam());
  const size_t n = 300;
  std::vector<float> g(n);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& x : g) x = dist(rng);
  const AdamWStep step = AdamWStep::For(1e-3, 0.9, 0.999, 1e-8, 0.0, true, 3);
  auto run = [&](const KernelTable& k, size_t split, std::vector<uint16_t>& m, std::vector<uint16_t>& v) {
    std::vector<float> master(n, 0.5f);
    m.assign(n, 0x3C00);
    v.assign(n, 0x3A00);
    for (auto [begin, end] : {std::pair<size_t, size_t>{0, split}, {split, n}}) {
      const void* slot = g.data() + begin;
      GradSources grads{std::span<const void* const>(&slot, 1), DType::kFloat32, nullptr, 1.0f};
      MomentBuffers moments{m.data() + begin, v.data() + begin, DType::kBFloat16, 99, 1000 + begin};
      k.update(grads, step, master.data() + begin, moments, Upload{}, end - begin);
    }
  };
  std::vector<uint16_t> m_ref, v_ref;
  run(PortableKernels(), 0, m_ref, v_ref);
  for (size_t split : {0, 1, 5, 16, 17, 100, 299}) {
    std::vector<uint16_t> m, v;
    run(kernel, split, m, v);
    EXPECT_EQ(m, m_ref) << split;
    EXPECT_EQ(v, v_ref) << split;
  }
}

INSTANTIATE_TEST_SUITE_P(Supported, StochasticRounding, ::testing::ValuesIn(testing::SupportedKernelNames()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace trainstream::optimizer
