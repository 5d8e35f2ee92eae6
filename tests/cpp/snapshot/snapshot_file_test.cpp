// Snapshot headers against the limit on them (daemon/snapshot/safetensors.h): the sizes of real jobs'
// headers, and a job whose header would be over it.
#include "daemon/snapshot/snapshot_format.h"
#include "daemon/snapshot/snapshot_writer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

using testing::ScopedSegmentName;

shm::ParamSpec Param(std::string name, std::vector<int64_t> shape) {
  return shm::ParamSpec{.name = std::move(name), .shape = std::move(shape), .dtype = DType::kFloat32, .group = 0};
}

// The 10.1B GPT of benchmarks/train_gpt (49 blocks of width 4096, 10.08B parameters): 297 parameters.
shm::LayoutSpec Gpt10B() {
  shm::LayoutSpec spec;
  spec.params = {Param("wte.weight", {50304, 4096}), Param("wpe.weight", {2048, 4096})};
  for (int i = 0; i < 49; ++i) {
    const std::string block = fmt::format("blocks.{}.", i);
    for (const auto& [name, shape] :
         std::vector<std::pair<const char*, std::vector<int64_t>>>{{"ln1.weight", {4096}},
                                                                   {"qkv.weight", {3 * 4096, 4096}},
                                                                   {"proj.weight", {4096, 4096}},
                                                                   {"ln2.weight", {4096}},
                                                                   {"up.weight", {4 * 4096, 4096}},
                                                                   {"down.weight", {4096, 4 * 4096}}}) {
      spec.params.push_back(Param(block + name, shape));
    }
  }
  spec.params.push_back(Param("ln.weight", {4096}));
  return spec;
}

// A mixture of experts with many parameters per element: 48 layers of 128 experts (gate, up and down
// each a parameter of their own, as Hugging Face's MoE models hold them), width 2048 (30.5B parameters).
shm::LayoutSpec ManyExperts() {
  shm::LayoutSpec spec;
  spec.params = {Param("model.embed_tokens.weight", {151936, 2048}), Param("lm_head.weight", {151936, 2048})};
  for (int layer = 0; layer < 48; ++layer) {
    const std::string prefix = fmt::format("model.layers.{}.", layer);
    for (const char* name :
         {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight"}) {
      spec.params.push_back(Param(prefix + name, {2048, 2048}));
    }
    spec.params.push_back(Param(prefix + "input_layernorm.weight", {2048}));
    spec.params.push_back(Param(prefix + "post_attention_layernorm.weight", {2048}));
    spec.params.push_back(Param(prefix + "mlp.gate.weight", {128, 2048}));
    for (int expert = 0; expert < 128; ++expert) {
      const std::string e = fmt::format("{}mlp.experts.{}.", prefix, expert);
      spec.params.push_back(Param(e + "gate_proj.weight", {768, 2048}));
      spec.params.push_back(Param(e + "up_proj.weight", {768, 2048}));
      spec.params.push_back(Param(e + "down_proj.weight", {2048, 768}));
    }
  }
  spec.params.push_back(Param("model.norm.weight", {2048}));
  return spec;
}

uint64_t HeaderBytes(const shm::LayoutSpec& spec) {
  const SnapshotMeta meta{.job = "a-job-name",
                          .uid = 4294967294u,
                          .seed = ~uint64_t{0},
                          .step = uint64_t{1} << 40,
                          .hparams = std::vector<shm::HParams>(
                              spec.num_groups, shm::HParams{-1.2345678901234567e-308, 0.9, 0.999, 1e-8, 0.1}),
                          .spec = spec};
  SafetensorsHeader header = SnapshotHeader(meta);
  return EncodeHeader(header).size() - 8;
}

// The limit on a header is sized from real jobs: a 10B dense model's header is a hundredth of it, a
// large mixture of experts' half of it.
TEST(SnapshotFile, RealJobsHeadersFitTheLimitWithRoom) {
  const uint64_t dense = HeaderBytes(Gpt10B());
  const uint64_t experts = HeaderBytes(ManyExperts());
  std::printf("header bytes: 10.1B GPT (297 parameters) %llu, MoE (%zu parameters) %llu; limit %llu\n",
              static_cast<unsigned long long>(dense), ManyExperts().params.size(),
              static_cast<unsigned long long>(experts), static_cast<unsigned long long>(kMaxHeaderBytes));
  EXPECT_LT(dense * 50, kMaxHeaderBytes);
  EXPECT_LT(experts * 3 / 2, kMaxHeaderBytes);
}

// The daemon refuses to write what it would refuse to restore, before it creates any file.
TEST(SnapshotFile, AJobWhoseHeaderIsOverTheLimitIsNotSnapshotted) {
  SnapshotMeta meta{.job = "many", .uid = 0, .seed = 0, .step = 0, .hparams = {}, .spec = {}};
  for (int i = 0; i < 60'000; ++i) meta.spec.params.push_back(Param(fmt::format("layers.{}.weight", i), {1}));
  const shm::JobLayout layout = shm::ComputeLayout(meta.spec);
  const ScopedSegmentName name;
  shm::Segment segment = shm::Segment::Create(name.str(), layout.state_bytes);
  shm::InitStateSegment(segment.data(), layout);
  const CommittedState state(shm::ViewState(segment.data(), layout, meta.spec), layout, meta.spec);
  SnapshotCapture capture(state, layout, 1, std::nullopt);
  const std::string path = std::filesystem::temp_directory_path() / ("ts-many-" + std::to_string(getpid()));
  const auto no_copy_comes = [] { Throw(Code::kDeadlineExceeded, "the writer waited for copies"); };
  TS_EXPECT_ERROR(WriteSnapshot(meta, state, capture, path, std::nullopt, no_copy_comes), Code::kFailedPrecondition,
                  "job 'many' has 60000 parameters: its snapshot's header would be");
  EXPECT_FALSE(std::filesystem::exists(path));
}

}  // namespace
}  // namespace trainstream::daemon
