// A snapshot file opened for a restore (daemon/snapshot/snapshot_format.h): the header sizes of real
// jobs against the limit, forged metadata and steps, non-finite values, and a file that changes between
// its check and its copy, restored into a real state segment.
#include "daemon/snapshot/snapshot_format.h"
#include "daemon/snapshot/snapshot_writer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <vector>

#include "tests/cpp/shm/full_spec.h"
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

// One fp32 parameter of `numel` elements (one bucket), consistent at step 3 with zero weights.
struct Forged {
  SnapshotMeta meta;
  std::vector<int64_t> steps{3}, bucket_steps{3};
  std::vector<float> master;
  std::map<std::string, std::string> metadata;  // replaces the meta's entries
  explicit Forged(int64_t numel = 64) : master(static_cast<size_t>(numel), 0.5f) {
    meta.job = "forged";
    meta.uid = 65534;
    meta.seed = 7;
    meta.step = 3;
    meta.spec.params = {Param("w", {numel})};
  }
};

std::string Write(const std::filesystem::path& path, const Forged& forged) {
  SafetensorsHeader header = SnapshotHeader(forged.meta);
  for (const auto& [key, value] : forged.metadata) header.metadata[key] = value;
  std::string bytes = EncodeHeader(header);
  for (const TensorEntry& tensor : header.tensors) {
    std::span<const std::byte> data;
    std::vector<std::byte> zeros(tensor.bytes());
    if (tensor.name == "master.0") data = std::as_bytes(std::span(forged.master));
    if (tensor.name == "step") data = std::as_bytes(std::span(forged.steps));
    if (tensor.name == "bucket_step") data = std::as_bytes(std::span(forged.bucket_steps));
    if (data.empty()) data = zeros;
    EXPECT_EQ(data.size(), tensor.bytes()) << tensor.name;
    bytes.append(reinterpret_cast<const char*>(data.data()), data.size());
  }
  std::ofstream(path, std::ios::binary) << bytes;
  return path.string();
}

// A job's state segment of the snapshot's layout, as a restore fills it.
struct State {
  explicit State(const shm::LayoutSpec& spec_of) : spec(spec_of), layout(shm::ComputeLayout(spec)) {
    segment = shm::Segment::Create(name.str(), layout.state_bytes);
    shm::InitStateSegment(segment.data(), layout);
  }
  [[nodiscard]] CommittedState committed() const {
    return CommittedState(shm::ViewState(segment.data(), layout, spec), layout, spec);
  }
  ScopedSegmentName name;
  shm::LayoutSpec spec;
  shm::JobLayout layout;
  shm::Segment segment;
};

class SnapshotFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("ts-snapshot-file-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  [[nodiscard]] std::string Path(const char* name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

// Two parameters of 1024 elements in two buckets of 4 KiB.
Forged TwoBuckets() {
  Forged forged(1024);
  forged.meta.spec.params = {Param("a", {1024}), Param("b", {1024})};
  forged.meta.spec.bucket_bytes = 4096;
  forged.steps = {3, 3};
  forged.bucket_steps = {3, 3};
  return forged;
}

TEST_F(SnapshotFileTest, AConsistentFileRestoresWhatItHolds) {
  Forged forged = TwoBuckets();
  forged.bucket_steps = {4, 3};  // a bucket may hold the step after the snapshot's (a trainer died mid-step)
  const SnapshotFile file(Write(Path("good"), forged));
  EXPECT_EQ(file.meta().uid, 65534u);
  const State state(file.meta().spec);
  file.RestoreInto(state.committed());
  const uint32_t a = 0;
  EXPECT_EQ(state.committed().Param(a).master[1023], 0.5f);
  EXPECT_EQ(state.committed().Param(a).step, 3u);
  EXPECT_EQ(state.committed().BucketStep(0), 4u);
  EXPECT_EQ(state.committed().BucketStep(1), 3u);
}

// The layout metadata carries every option of the job's spec (shm::ForEachOption) and its parameters.
TEST_F(SnapshotFileTest, EveryFieldOfTheSpecRoundTrips) {
  Forged forged(64 * 32);
  forged.meta.spec = testing::FullSpec();
  forged.steps = {3, 3};
  forged.bucket_steps = {3, 3};
  const SnapshotFile file(Write(Path("full"), forged));
  EXPECT_EQ(file.meta().spec, testing::FullSpec());
}

// Snapshots from before the state halves (and before protocol 5's step terms) lack those options: they
// restore as a job of one half, without speculation or step terms.
TEST_F(SnapshotFileTest, OptionsAddedLaterTakeTheirDefaultsWhenMissing) {
  Forged forged = TwoBuckets();
  forged.meta.spec.state_halves = 2;
  forged.meta.spec.speculative_clipping = shm::Speculation::kOn;
  forged.meta.spec.max_grad_norm = 1.0;
  forged.meta.spec.step_terms = true;
  nlohmann::json layout = nlohmann::json::parse(SnapshotHeader(forged.meta).metadata.at("layout"));
  for (const char* option : {"state_halves", "speculative_clipping", "step_terms"}) layout.erase(option);
  forged.metadata["layout"] = layout.dump();
  const SnapshotFile file(Write(Path("old"), forged));
  EXPECT_EQ(file.meta().spec.state_halves, 1u);
  EXPECT_EQ(file.meta().spec.speculative_clipping, shm::Speculation::kOff);
  EXPECT_FALSE(file.meta().spec.step_terms);
  EXPECT_EQ(file.meta().spec.max_grad_norm, 1.0);
  layout.erase("world_size");  // one that every snapshot has
  forged.metadata["layout"] = layout.dump();
  TS_EXPECT_ERROR(SnapshotFile broken(Write(Path("broken"), forged)), Code::kInvalidArgument,
                  "its layout or hparams metadata is malformed");
}

// uid_t -1 means "no change" to chown: a job of it kept root's segment; 2^32 wrapped to root.
TEST_F(SnapshotFileTest, NumbersInMetadataAreDecimalAndInRange) {
  for (const auto& [key, value, why] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"uid", "-1", "its uid metadata '-1' is not a number from 0 to 4294967294"},
           {"uid", "4294967295", "its uid metadata '4294967295' is not"},
           {"uid", "4294967296", "its uid metadata '4294967296' is not"},
           {"uid", " 1", "its uid metadata ' 1' is not"},
           {"uid", "1 ", "its uid metadata '1 ' is not"},
           {"uid", "+1", "its uid metadata '+1' is not"},
           {"uid", "", "its uid metadata '' is not"},
           {"step", "-5", "its step metadata '-5' is not a number from 0 to 4611686018427387902"},
           {"seed", "18446744073709551616", "its seed metadata '18446744073709551616' is not"},
           {"hparams", "[[1,2,3,4,5],[1,2,3,4,5]]", "its hparams metadata has 2 groups, its layout 1"},
           {"hparams", "[[1,2,3,4]]", "hparams entries need 5 numbers"},
       }) {
    Forged forged;
    forged.metadata[key] = value;
    TS_EXPECT_ERROR(SnapshotFile(Write(Path("meta"), forged)), Code::kInvalidArgument, why);
  }
  Forged highest;
  highest.meta.uid = 4294967294u;
  EXPECT_EQ(SnapshotFile(Write(Path("highest"), highest)).meta().uid, 4294967294u);
}

TEST_F(SnapshotFileTest, StepsThatDisagreeAreRefused) {
  const auto refused = [&](int64_t meta_step, int64_t bucket_step, int64_t param_step, const std::string& why) {
    Forged forged;
    forged.meta.step = static_cast<uint64_t>(meta_step);
    forged.bucket_steps = {bucket_step};
    forged.steps = {param_step};
    TS_EXPECT_ERROR(SnapshotFile(Write(Path("steps"), forged)), Code::kInvalidArgument, why);
  };
  refused(3, int64_t{1} << 61, 3, "bucket 0 holds step 2305843009213693952, but the snapshot's step is 3");
  refused(3, 5, 3, "bucket 0 holds step 5, but the snapshot's step is 3");
  refused(3, 2, 3, "bucket 0 holds step 2, but the snapshot's step is 3");
  refused(3, -1, 3, "bucket 0 holds step -1");
  refused(3, 3, -1, "parameter 0 (w) has AdamW step -1");
  refused(3, 3, int64_t{1} << 62, "parameter 0 (w) has AdamW step 4611686018427387904");
  Forged two_buckets = TwoBuckets();
  two_buckets.bucket_steps = {4, 4};  // the snapshot's step is the lowest: 4, not 3
  TS_EXPECT_ERROR(SnapshotFile(Write(Path("none"), two_buckets)), Code::kInvalidArgument,
                  "no bucket holds the snapshot's step 3");
}

// Inf or NaN in master weights or moments: refused by default, naming the tensor and the element.
TEST_F(SnapshotFileTest, NonFiniteValuesAreRefusedUnlessAllowed) {
  Forged forged(3 * (UntrustedFile::kChunkBytes / 4));  // three chunks: the element counts past the first
  forged.master[UntrustedFile::kChunkBytes / 4 + 5] = std::numeric_limits<float>::quiet_NaN();
  const std::string path = Write(Path("nan"), forged);
  const SnapshotFile refused(path);
  const State state(refused.meta().spec);
  TS_EXPECT_ERROR(refused.RestoreInto(state.committed()), Code::kInvalidArgument,
                  fmt::format("tensor 'master.0' holds a non-finite value (nan) at element {}",
                              UntrustedFile::kChunkBytes / 4 + 5));
  const SnapshotFile allowed(path, RestoreOptions{.allow_nonfinite = true, .cancelled = {}});
  const State restored(allowed.meta().spec);
  allowed.RestoreInto(restored.committed());
  EXPECT_TRUE(std::isnan(restored.committed().Param(0).master[UntrustedFile::kChunkBytes / 4 + 5]));
}

// Truncated between its check (the constructor) and its copy: the copy fails, nothing is mapped.
TEST_F(SnapshotFileTest, AFileTruncatedAfterItsCheckFailsTheCopy) {
  const std::string path = Write(Path("shrinking"), Forged(1 << 20));
  const SnapshotFile file(path);
  ASSERT_EQ(truncate(path.c_str(), 4096), 0);
  const State state(file.meta().spec);
  TS_EXPECT_ERROR(file.RestoreInto(state.committed()), Code::kFailedPrecondition,
                  fmt::format("snapshot '{}' was truncated while trainstreamd read it", path));
}

TEST_F(SnapshotFileTest, ACancelledRestoreStops) {
  const SnapshotFile file(Write(Path("cancelled"), Forged(1 << 20)),
                          RestoreOptions{.allow_nonfinite = false, .cancelled = [] { return true; }});
  const State state(file.meta().spec);
  TS_EXPECT_ERROR(file.RestoreInto(state.committed()), Code::kAborted, "was cancelled");
}

}  // namespace
}  // namespace trainstream::daemon
