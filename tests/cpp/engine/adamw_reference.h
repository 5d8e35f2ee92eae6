// torch.optim.AdamW in double precision for the step engine tests' job (rank_client.h): what the
// daemon's master weights must hold after the same steps.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "tests/cpp/engine/rank_client.h"

namespace trainstream::daemon {

inline constexpr double kTolerance = 1e-6;

// torch.optim.AdamW, element by element in double, for every parameter of TwoParamSpec.
class AdamWReference {
 public:
  explicit AdamWReference(const shm::LayoutSpec& spec) : world_size_(spec.world_size) {
    for (uint32_t p = 0; p < spec.params.size(); ++p) {
      State& s = params_.emplace_back();
      const uint64_t numel = spec.params[p].numel();
      for (uint64_t i = 0; i < numel; ++i) s.p.push_back(InitialWeight(p, i));
      s.m.assign(numel, 0);
      s.v.assign(numel, 0);
    }
  }
  // One step with the ranks' gradients of `step` averaged; `updated[p]` false skips parameter p. With
  // `max_grad_norm`, the gradients are clipped first as torch.nn.utils.clip_grad_norm_ does.
  void Step(uint64_t step, const shm::HParams& h, const std::vector<bool>& updated = {}, double max_grad_norm = 0) {
    std::vector<std::vector<double>> grads(params_.size());
    double sum_of_squares = 0;
    for (uint32_t p = 0; p < params_.size(); ++p) {
      if (!updated.empty() && !updated[p]) continue;
      for (uint64_t i = 0; i < params_[p].p.size(); ++i) {
        double g = 0;
        for (uint32_t r = 0; r < world_size_; ++r) g += Gradient(p, r, step, i);
        grads[p].push_back(g / world_size_);
        sum_of_squares += grads[p].back() * grads[p].back();
      }
    }
    const double clip = max_grad_norm > 0 ? std::min(1.0, max_grad_norm / (std::sqrt(sum_of_squares) + 1e-6)) : 1.0;
    last_clip_ = clip;
    for (uint32_t p = 0; p < params_.size(); ++p) {
      if (grads[p].empty()) continue;
      State& s = params_[p];
      const uint64_t t = ++s.t;
      const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(t));
      const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(t));
      for (uint64_t i = 0; i < s.p.size(); ++i) {
        const double g = grads[p][i] * clip;
        s.p[i] *= 1 - h.lr * h.weight_decay;
        s.m[i] = h.beta1 * s.m[i] + (1 - h.beta1) * g;
        s.v[i] = h.beta2 * s.v[i] + (1 - h.beta2) * g * g;
        s.p[i] -= h.lr / bc1 * s.m[i] / (std::sqrt(s.v[i]) / std::sqrt(bc2) + h.eps);
      }
    }
  }
  // The clip coefficient of the last Step (1: no clipping).
  [[nodiscard]] double last_clip() const { return last_clip_; }
  // The daemon's master weights and upload staging both hold the reference weights.
  void ExpectMatches(const RankClient& client) const {
    for (uint32_t p = 0; p < params_.size(); ++p) {
      const std::span<float> master = client.Master(p), upload = client.Upload(p);
      size_t off = 0, upload_off = 0;
      double worst = 0;
      for (uint64_t i = 0; i < master.size(); ++i) {
        const double error = std::abs(master[i] - params_[p].p[i]);
        worst = std::max(worst, error);
        off += error > kTolerance;
        upload_off += upload[i] != master[i];
      }
      EXPECT_EQ(off, 0u) << "param " << p << ": " << off << " master weights off, worst by " << worst;
      EXPECT_EQ(upload_off, 0u) << "param " << p << ": upload differs from master";
    }
  }

 private:
  struct State {
    std::vector<double> p, m, v;
    uint64_t t = 0;
  };
  uint32_t world_size_;
  std::vector<State> params_;
  double last_clip_ = 1;
};

}  // namespace trainstream::daemon
