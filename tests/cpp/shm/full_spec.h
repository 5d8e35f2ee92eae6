// A LayoutSpec in which every option and every parameter field differs from LayoutSpec{}'s, and which
// ComputeLayout accepts: what a conversion that drops or confuses a field cannot carry unchanged.
#pragma once

#include "shm/job_layout.h"

namespace trainstream::testing {

inline shm::LayoutSpec FullSpec() {
  shm::LayoutSpec spec;
  spec.params = {{.name = "a.weight", .shape = {64, 32}, .dtype = DType::kBFloat16, .group = 1, .partition = 0},
                 {.name = "b", .shape = {7}, .dtype = DType::kFloat32, .group = 0, .partition = 2}};
  spec.frozen = {{.name = "base", .shape = {5, 3}, .dtype = DType::kFloat16, .group = 0, .partition = 0}};
  spec.num_groups = 2;
  spec.bucket_bytes = 1 << 20;
  spec.moment_dtype = DType::kBFloat16;
  spec.optimizer = shm::OptimizerKind::kAdam;
  spec.accumulation_steps = 3;
  spec.world_size = 2;
  spec.max_grad_norm = 1.5;
  spec.step_terms = true;
  spec.peers = {"node-a:7070", "node-b:7070"};
  spec.node_rank = 1;
  spec.state_halves = 2;
  spec.speculative_clipping = shm::Speculation::kOn;
  return spec;
}

}  // namespace trainstream::testing
