// bf16 stochastic rounding of the moments: unbiased (the mean over many seeds is within 3e-5 of the fp32
// value, and so is the mean over 1M adjacent elements of one value in one step), reproducible (same seed
// and element -> same bits, in every variant, also across the 2^32-element key boundary), element-indexed
// (the rounding of an element does not depend on where a range starts), and driven by well-distributed bits
// (balanced, uncorrelated between neighbouring elements, between exp_avg's low and exp_avg_sq's high 16
// bits, and between consecutive steps).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
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
    testing::UpdateInPlace(kernel, grads, step, master.data(), moments, Upload{}, n);
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
      testing::UpdateInPlace(k, grads, step, master.data() + begin, moments, Upload{}, end - begin);
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

// The step engine's per-step seed (daemon/engine/step_engine.cpp).
uint64_t StepSeed(uint64_t seed, uint64_t step) {
  return seed ^ (step * 0xD1B54A32D192ED03ull);
}

double Correlation(const std::vector<double>& x, const std::vector<double>& y) {
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) mx += x[i], my += y[i];
  mx /= static_cast<double>(x.size()), my /= static_cast<double>(y.size());
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my), sxx += (x[i] - mx) * (x[i] - mx), syy += (y[i] - my) * (y[i] - my);
  }
  return sxy / std::sqrt(sxx * syy);
}

// One step over 1M adjacent elements that all hold the same fp32 value: with beta1 = beta2 = 0 and zero
// moments, exp_avg = g and exp_avg_sq = g*g exactly, so the stored bf16 are roundings of known values. Their
// mean over the elements must be the fp32 value (the random bits are uniform across neighbours, not just
// across seeds), and the up-rounded fraction must be the distance to the lower neighbour in ulps.
TEST_P(StochasticRounding, MeanOverAdjacentElementsOfOneValueIsTheFp32Value) {
  const KernelTable& kernel = KernelByName(GetParam());
  const size_t n = size_t{1} << 20;
  for (float value : {0.3f, -1.2345678f, 7.77e-3f}) {
    std::vector<float> g(n, value), master(n, 0.0f);
    std::vector<uint16_t> m(n, 0), v(n, 0);
    const void* slot = g.data();
    GradSources grads{std::span<const void* const>(&slot, 1), DType::kFloat32, nullptr, 1.0f};
    const AdamWStep step = AdamWStep::For(0.0, 0.0, 0.0, 1e-8, 0.0, true, 1);
    MomentBuffers moments{m.data(), v.data(), DType::kBFloat16, StepSeed(0xABCDEF, 12), 777};
    testing::UpdateInPlace(kernel, grads, step, master.data(), moments, Upload{}, n);
    const float square = value * value;
    for (auto [bits, exact] : {std::pair{&m, value}, std::pair{&v, square}}) {
      // The two bf16 neighbours of `exact` and the probability of rounding away from zero.
      const uint32_t raw = std::bit_cast<uint32_t>(exact);
      const float low = std::bit_cast<float>(raw & 0xFFFF0000u),
                  high = std::bit_cast<float>((raw & 0xFFFF0000u) + 0x10000u);
      const double p_up = static_cast<double>(raw & 0xFFFF) / 65536.0;
      double sum = 0;
      size_t up = 0;
      for (uint16_t b : *bits) {
        const float x = BF16ToFloat(b);
        ASSERT_TRUE(x == low || x == high) << value;
        sum += x;
        up += x == high;
      }
      const double mean = sum / static_cast<double>(n);
      const double sigma_p = std::sqrt(p_up * (1 - p_up) / static_cast<double>(n));
      EXPECT_NEAR(static_cast<double>(up) / static_cast<double>(n), p_up, 6 * sigma_p) << value;
      EXPECT_NEAR(mean, exact, 3e-5 * std::abs(exact)) << value;
      EXPECT_NEAR(mean, exact, 6 * sigma_p * std::abs(high - low) + 1e-12) << value;
    }
  }
}

// The bits themselves, over 1M adjacent elements (the variants are bit-identical to RandomBits, see above
// and variants_test.cpp): every bit balanced; exp_avg's bits (low 16) uncorrelated with exp_avg_sq's (high
// 16); each uncorrelated with the neighbouring element's; and uncorrelated with the same element's bits in
// the next step. With N = 1M, a correlation's standard error is 1e-3: 5e-3 is a 5-sigma bound.
TEST(RandomBitsDistribution, BalancedAndUncorrelatedAcrossHalvesNeighboursAndSteps) {
  const size_t n = size_t{1} << 20;
  for (uint64_t base : {uint64_t{0}, uint64_t{123456789}, (uint64_t{1} << 32) - n / 2, uint64_t{0x123456789ABCull}}) {
    const uint64_t seed = StepSeed(0x5EED, 41), next_seed = StepSeed(0x5EED, 42);
    std::vector<double> low(n), high(n), low_next_step(n);
    std::vector<size_t> ones(32, 0);
    size_t same_as_next_step = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint32_t r = RandomBits(seed, base + i), r_next = RandomBits(next_seed, base + i);
      low[i] = ExpAvgRandom(r), high[i] = ExpAvgSqRandom(r), low_next_step[i] = ExpAvgRandom(r_next);
      same_as_next_step += r == r_next;
      for (int b = 0; b < 32; ++b) ones[b] += (r >> b) & 1;
    }
    for (int b = 0; b < 32; ++b)
      EXPECT_NEAR(static_cast<double>(ones[b]) / n, 0.5, 0.0025) << "bit " << b << " base " << base;
    for (const auto* x : {&low, &high}) {
      const double mean = std::accumulate(x->begin(), x->end(), 0.0) / n;
      EXPECT_NEAR(mean, 32767.5, 65536 * 0.0015) << base;  // uniform on [0, 65535]: sigma 18.9k / 1024
    }
    EXPECT_NEAR(Correlation(low, high), 0.0, 5e-3) << "exp_avg vs exp_avg_sq bits, base " << base;
    const std::vector<double> low_a(low.begin(), low.end() - 1), low_b(low.begin() + 1, low.end());
    const std::vector<double> high_a(high.begin(), high.end() - 1), high_b(high.begin() + 1, high.end());
    EXPECT_NEAR(Correlation(low_a, low_b), 0.0, 5e-3) << "neighbouring elements (low 16), base " << base;
    EXPECT_NEAR(Correlation(high_a, high_b), 0.0, 5e-3) << "neighbouring elements (high 16), base " << base;
    EXPECT_NEAR(Correlation(low_a, high_b), 0.0, 5e-3) << "neighbours, low vs high, base " << base;
    EXPECT_NEAR(Correlation(low, low_next_step), 0.0, 5e-3) << "consecutive steps, base " << base;
    EXPECT_LT(same_as_next_step, 10u) << base;  // 2^-32 per element by chance
  }
}

// Different steps (seeds) round differently; the same step always the same.
TEST_P(StochasticRounding, DifferentStepsRoundDifferently) {
  const KernelTable& kernel = KernelByName(GetParam());
  const size_t n = 4096;
  std::vector<float> g(n);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& x : g) x = dist(rng);
  const void* slot = g.data();
  GradSources grads{std::span<const void* const>(&slot, 1), DType::kFloat32, nullptr, 1.0f};
  const AdamWStep step = AdamWStep::For(0.0, 0.0, 0.0, 1e-8, 0.0, true, 1);
  auto round = [&](uint64_t seed) {
    std::vector<uint16_t> m(n, 0), v(n, 0);
    std::vector<float> master(n, 0.0f);
    testing::UpdateInPlace(kernel, grads, step, master.data(),
                           MomentBuffers{m.data(), v.data(), DType::kBFloat16, seed, 5000}, Upload{}, n);
    m.insert(m.end(), v.begin(), v.end());
    return m;
  };
  const std::vector<uint16_t> a = round(StepSeed(0x5EED, 1)), b = round(StepSeed(0x5EED, 2));
  EXPECT_EQ(a, round(StepSeed(0x5EED, 1)));
  size_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
  // Each element rounds differently with probability 2p(1-p), p uniform-ish: ~1/3 on average.
  EXPECT_GT(differ, a.size() / 5) << differ;
}

// The hash key depends on the high 32 bits of the global index: a range across a multiple of 2^32 (the
// SIMD kernels split it into two key segments) matches the reference element for element, also with the
// streamed upload and a split that leaves the second segment unaligned.
TEST_P(StochasticRounding, RangeAcrossTheKeyBoundaryMatchesTheReference) {
  const KernelTable& kernel = KernelByName(GetParam());
  for (uint64_t base : {(uint64_t{1} << 32) - 20001, (uint64_t{3} << 32) - 7, (uint64_t{1} << 32)}) {
    const size_t n = 40000 + 3;
    std::vector<float> g(n);
    std::mt19937 rng(static_cast<uint32_t>(base));
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (float& x : g) x = dist(rng);
    const AdamWStep step = AdamWStep::For(1e-3, 0.9, 0.999, 1e-8, 0.01, true, 5);
    auto run = [&](const KernelTable& k) {
      std::vector<float> master(n, 0.25f);
      std::vector<uint16_t> m(n, 0x3C00), v(n, 0x3A00), up(n + 64, 0);
      const void* slot = g.data();
      GradSources grads{std::span<const void* const>(&slot, 1), DType::kFloat32, nullptr, 1.0f};
      testing::UpdateInPlace(k, grads, step, master.data(),
                             MomentBuffers{m.data(), v.data(), DType::kBFloat16, 77, base},
                             Upload{up.data() + 3, DType::kBFloat16}, n);
      m.insert(m.end(), v.begin(), v.end());
      m.insert(m.end(), up.begin(), up.end());
      return std::pair{m, master};
    };
    const auto expected = run(PortableKernels());
    const auto actual = run(kernel);
    EXPECT_EQ(actual.first, expected.first) << base;
    EXPECT_EQ(actual.second, expected.second) << base;
  }
}

INSTANTIATE_TEST_SUITE_P(Supported, StochasticRounding, ::testing::ValuesIn(testing::SupportedKernelNames()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace trainstream::optimizer
