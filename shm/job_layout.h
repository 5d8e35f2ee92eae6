// The fixed memory layout of one job: how parameters are grouped into buckets and where every region
// lies in the job's two kinds of segments. Computed by the same code (ComputeLayout) in the daemon and
// in the client from the same LayoutSpec, so both sides agree byte for byte; the daemon additionally
// compares a hash of the spec when a rank attaches.
//
// State segment ("state", one per job, owned by the daemon):
//   StateHeader | ParamState[H][P] | BucketState[B] | master f32 [H] | exp_avg [H] | exp_avg_sq [H]
//   | accum f32? | upload | frozen
// H = state_halves. With two halves the optimizer state (master weights, moments, step counts) is double
// buffered: each bucket's BucketState names the half that holds its last committed step, an update reads
// that half and writes the other, and one atomic store of the BucketState word commits it (step and half
// together). So the state never holds a half-written step: a daemon killed during an update leaves the
// committed half intact, and the other half holds the step before it (a bucket can be rolled back one
// step). With one half both names are the same memory: updates run in place, and the word marks a bucket
// `updating` while one does.
// The upload region holds the new weights of 16-bit buckets in their dtype; an fp32 bucket's new
// weights are its master weights, read in place (no second copy to write, store or pin). The frozen
// region holds parameters outside the optimizer that the trainer pages (a LoRA base's weights), in
// their own dtype, one after another: the daemon keeps them for the ranks and never touches them.
// A paged 16-bit bucket of a job with one rank, no accumulator and no speculation takes its gradients in
// its own upload copy (`grads_in_upload`): once the bucket's block has run its backward nothing reads
// that copy until the update overwrites it with the new weights, element by element after reading the
// gradient there, so a separate gradient slot would only cost host memory (2 bytes per parameter: a
// 10B model's job did not fit the GPU machine's 125 GiB with it). The copy can always be rebuilt from
// the committed master weights, which a resumed job does for these buckets.
// Rank segment ("rank<r>", one per attached rank):
//   RankHeader | request ring | completion ring | HParams[2][G] | presence u8[P] | grads
//
// Buckets follow the design document: parameters in reverse registration order (≈ backward order), one
// dtype and one partition per bucket, about `bucket_bytes` each; a parameter is never split, a larger
// one gets its own bucket. Partitions keep apart what must not share a bucket: each paged block's
// parameters (partition 1 + its index) from the resident ones (0) and from the other blocks'.
// Every parameter starts on a 64-byte boundary inside its bucket, and every region on a 64-byte
// boundary in its segment, so kernels see aligned data and GPU views are aligned alike.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "shm/dtype.h"
#include "shm/error.h"
#include "shm/ring.h"

namespace trainstream::shm {

constexpr uint32_t kSegmentVersion = 9;
constexpr size_t kMaxJobName = 256;
constexpr uint32_t kRingCapacity = 1024;
constexpr size_t kAlign = 64;
constexpr uint64_t kMinBucketBytes = 4096;         // a LayoutSpec's smallest bucket_bytes
constexpr uint32_t kMaxAccumulationSteps = 65536;  // and its largest accumulation_steps

enum class OptimizerKind : uint8_t { kAdamW = 0, kAdam = 1 };

// Speculative clipping (with max_grad_norm and two state halves): each bucket's update starts as soon as
// its gradients are in, before the global norm is known, and is committed or redone once it is. A job
// has it on or off; kAuto is only asked for, in an attach request (the daemon decides).
enum class Speculation : uint8_t { kOff = 0, kOn = 1, kAuto = 2 };

// One of the spec's enums from a number that crossed a boundary (the wire, Python): refused only where it
// does not fit the enum's byte, so that validation (ValidateRequest) sees the number itself, not one
// wrapped into range, and names what is allowed.
template <typename Enum>
Enum EnumFromCode(int64_t code, const char* what) {
  TS_CHECK(code >= 0 && code <= std::numeric_limits<std::underlying_type_t<Enum>>::max(), Code::kInvalidArgument,
           "{} code {} is out of range", what, code);
  return static_cast<Enum>(code);
}

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  uint32_t group = 0;      // the optimizer's param group (frozen parameters: unused)
  uint32_t partition = 0;  // parameters of different partitions never share a bucket
  [[nodiscard]] uint64_t numel() const;
  bool operator==(const ParamSpec&) const = default;
};

// Everything that fixes the job's memory layout and semantics. Ranks of one job must agree on all of it.
struct LayoutSpec {
  std::vector<ParamSpec> params;  // in the optimizer's order (the state_dict's parameter indices)
  std::vector<ParamSpec> frozen;  // paged parameters outside the optimizer, in the frozen region's order
  uint32_t num_groups = 1;
  uint64_t bucket_bytes = 32ull << 20;
  DType moment_dtype = DType::kFloat32;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  // Backward passes summed per step; 0 (only with step_terms): counted, as the ranks' step terms say.
  uint32_t accumulation_steps = 1;
  uint32_t world_size = 1;     // ranks on this node
  double max_grad_norm = 0.0;  // 0: no clipping (with step_terms: the steps that clip say so themselves)
  // The ranks send each step's terms (kStepTerms: how many micro-batches, clipping, the loss scale) and
  // a step's updates commit once every rank's optimizer.step() said how (daemon/engine/step_gate.h).
  // Without: every step has accumulation_steps micro-batches and clips to max_grad_norm.
  bool step_terms = false;
  std::vector<std::string> peers;  // the job's daemons in node order ("host:port"); empty: one node
  uint32_t node_rank = 0;          // this node's index in peers
  // 1 or 2 (see the header comment); 0 only in an attach request: the daemon decides.
  uint32_t state_halves = 1;
  Speculation speculative_clipping = Speculation::kOff;

  [[nodiscard]] uint32_t nodes() const { return peers.empty() ? 1 : static_cast<uint32_t>(peers.size()); }
  // Gradients are summed into the state segment's fp32 accumulator: across micro-batches, and before a
  // multi-node all-reduce. A job that counts its micro-batches (accumulation_steps 0) gets one from
  // the daemon when its first step has several (StepEngine).
  [[nodiscard]] bool uses_accumulator() const { return accumulation_steps > 1 || nodes() > 1; }
  bool operator==(const LayoutSpec&) const = default;
};

// Every option of a LayoutSpec beside its two parameter lists, each once with its name, in the order the
// layout hash takes them: the hash, the comparison of two ranks' specs (daemon/control/job_registry.cpp)
// and a snapshot's JSON (daemon/snapshot/snapshot_format.cpp) walk this list, so a new option is added
// here, in ValidateRequest, in the proto (proto/layout_spec_proto.cpp), in the Python binding, and in
// snapshot_format.cpp's AddedLater with its default (snapshots written before it lack it and would not
// restore); it changes the layout hash, so kSegmentVersion goes up with it.
// `visit(name, member)`: Spec is LayoutSpec or const LayoutSpec.
template <typename Spec, typename Visit>
void ForEachOption(Spec& spec, Visit&& visit) {
  visit("num_groups", spec.num_groups);
  visit("bucket_bytes", spec.bucket_bytes);
  visit("moment_dtype", spec.moment_dtype);
  visit("optimizer", spec.optimizer);
  visit("accumulation_steps", spec.accumulation_steps);
  visit("world_size", spec.world_size);
  visit("max_grad_norm", spec.max_grad_norm);
  visit("peers", spec.peers);
  visit("node_rank", spec.node_rank);
  visit("state_halves", spec.state_halves);
  visit("speculative_clipping", spec.speculative_clipping);
  visit("step_terms", spec.step_terms);
}

struct BucketLayout {
  DType dtype = DType::kFloat32;
  uint32_t partition = 0;
  std::vector<uint32_t> params;  // parameter indices, in bucket order
  uint64_t numel = 0;            // elements including alignment padding
  uint64_t elem_offset = 0;      // into master / moments / accum (elements)
  uint64_t upload_offset = 0;    // bytes into the upload region (16-bit buckets only)
  uint64_t grad_offset = 0;      // bytes into a rank's grad region (unless grads_in_upload)
  bool grads_in_upload = false;  // the gradients land in the upload copy (see the header comment)
  [[nodiscard]] uint64_t bytes() const { return numel * SizeOf(dtype); }
  // New weights are read from the master weights themselves (fp32 parameters).
  [[nodiscard]] bool uploads_from_master() const { return dtype == DType::kFloat32; }
};

struct ParamLayout {
  uint32_t bucket = 0;
  uint64_t offset_in_bucket = 0;  // elements
  uint64_t numel = 0;
};

// Per-group hyperparameters, written by the client at the first gradient of each step (double-buffered
// by step parity), read by the daemon. Doubles, as in Python, so bias corrections match torch exactly.
struct HParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

struct ParamState {
  uint64_t step = 0;  // AdamW step count of this parameter (torch keeps one per parameter)
};

// A bucket's committed progress: the last step applied to it, the half that holds it, and (one half)
// whether an update is rewriting it in place now. One word, so one atomic store commits an update.
struct BucketCommit {
  uint64_t step = 0;  // below 2^62
  uint32_t half = 0;
  bool updating = false;
  [[nodiscard]] uint64_t Word() const { return step << 2 | uint64_t{updating} << 1 | half; }
  static BucketCommit Of(uint64_t word) { return {word >> 2, static_cast<uint32_t>(word & 1), (word & 2) != 0}; }
  bool operator==(const BucketCommit&) const = default;
};

struct alignas(64) BucketState {
  std::atomic<uint64_t> word{0};
  [[nodiscard]] BucketCommit Load() const { return BucketCommit::Of(word.load(std::memory_order_acquire)); }
  // After every write of the step it commits (release: a reader that sees the word sees them).
  void Store(const BucketCommit& commit) { word.store(commit.Word(), std::memory_order_release); }
};

struct alignas(64) StateHeader {
  static constexpr uint64_t kMagic = 0x5453544154450001ull;  // "TSTATE" + 1
  uint64_t magic = kMagic;
  uint32_t version = kSegmentVersion;
  uint32_t initialized = 0;  // master weights hold real values
  uint64_t layout_hash = 0;
  uint32_t state_halves = 1;          // the job's LayoutSpec's, for a daemon that re-adopts it
  uint32_t speculative_clipping = 0;  // likewise (Speculation::kOn or kOff)
  std::atomic<uint64_t> completed_step{0};
  // The daemon that owns the job's memory (daemon/control/orphaned_jobs.h: its pid and start time in one
  // word), so that a daemon started after it died can tell its jobs from a live daemon's.
  std::atomic<uint64_t> owner{0};
  uint64_t daemon_socket = 0;           // hash of the owner's socket path: only its successor adopts
  char job_name[kMaxJobName + 1] = {};  // for re-adoption by name
  Doorbell doorbell;                    // rung by every rank's request ring and by the daemon's workers
};

struct alignas(64) RankHeader {
  static constexpr uint64_t kMagic = 0x5452414E4B000001ull;  // "TRANK" + 1
  uint64_t magic = kMagic;
  uint32_t version = kSegmentVersion;
  uint32_t rank = 0;
  uint64_t layout_hash = 0;
  Doorbell completion_doorbell;  // rung by the daemon when it pushes a completion
  // cuda-ipc: how many of the rank's kWeightsWanted events the daemon's copy stream has been made to
  // wait for; the client records an event again only after its previous use was waited for.
  std::atomic<uint64_t> weights_wanted_waits{0};
};

struct JobLayout {
  std::vector<BucketLayout> buckets;
  std::vector<ParamLayout> params;
  uint64_t total_elems = 0;  // master / moments elements, padding included
  uint64_t upload_bytes = 0;
  uint64_t grad_bytes = 0;
  std::vector<uint64_t> frozen_offsets;  // bytes into the frozen region, per frozen parameter
  uint64_t frozen_bytes = 0;
  uint64_t hash = 0;
  uint32_t state_halves = 1;
  bool speculative_clipping = false;

  // state segment; per half h (with one half, [1] == [0])
  size_t param_state_offset[2] = {}, master_offset[2] = {}, exp_avg_offset[2] = {}, exp_avg_sq_offset[2] = {};
  size_t bucket_state_offset = 0, accum_offset = 0, upload_offset = 0, frozen_offset = 0, state_bytes = 0;
  // rank segment
  size_t request_ring_offset = 0, completion_ring_offset = 0, hparams_offset = 0, presence_offset = 0, grads_offset = 0,
         rank_bytes = 0;
};

// Validates the spec (throws Error kInvalidArgument naming what is wrong) and lays it out. The spec must
// be decided (state_halves 1 or 2, speculation on or off).
JobLayout ComputeLayout(const LayoutSpec& spec);
// Validates what an attach request asks for: as ComputeLayout, with state_halves 0 and Speculation::kAuto
// allowed (the daemon decides them and answers with its choice).
void ValidateRequest(const LayoutSpec& spec);

// One half of the optimizer state, indexed by parameter (param_state) and by element (the others).
struct StateHalf {
  ParamState* param_state;
  float* master;
  void* exp_avg;
  void* exp_avg_sq;
};

// Views of the regions of mapped segments.
struct StateView {
  StateHeader* header;
  BucketState* bucket_state;
  StateHalf halves[2];  // with one half, halves[1] is halves[0]
  float* accum;         // nullptr unless spec.uses_accumulator()
  std::byte* upload;
  std::byte* frozen;
  // The half that holds bucket b's last committed step (what readers read), and the other one (what its
  // next update writes: the same with one half).
  [[nodiscard]] const StateHalf& Committed(uint32_t b) const { return halves[bucket_state[b].Load().half]; }
  [[nodiscard]] const StateHalf& Other(uint32_t b) const { return halves[1 - bucket_state[b].Load().half]; }
};
struct RankView {
  RankHeader* header;
  RingHeader* request_ring;
  RingHeader* completion_ring;
  HParams* hparams;  // [2][num_groups]
  uint8_t* presence;
  std::byte* grads;
};

StateView ViewState(void* base, const JobLayout& layout, const LayoutSpec& spec);
RankView ViewRank(void* base, const JobLayout& layout);
// Where a rank's gradients of `bucket` lie: its gradient slot, or the bucket's upload copy.
std::byte* GradsOf(const BucketLayout& bucket, const StateView& state, const RankView& rank);

// Initializes freshly created (zeroed) segments: headers, rings.
void InitStateSegment(void* base, const JobLayout& layout);
void InitRankSegment(void* base, const JobLayout& layout, uint32_t rank);

// Checks that mapped memory holds a segment of this layout (magic, version, hash, size).
void CheckStateSegment(const void* base, size_t size, const JobLayout& layout);
void CheckRankSegment(const void* base, size_t size, const JobLayout& layout, uint32_t rank);

}  // namespace trainstream::shm
