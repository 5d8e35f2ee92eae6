#include "daemon/snapshot/snapshot_format.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string_view>
#include <utility>

#include "daemon/snapshot/bounded_json.h"
#include "shm/error.h"
#include "shm/version.h"

namespace trainstream::daemon {

namespace {

const char* SafetensorsDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "F32";
    case DType::kBFloat16: return "BF16";
    case DType::kFloat16: return "F16";
  }
  return "";
}

DType DTypeNamed(const std::string& name) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    if (NameOf(dtype) == name) return dtype;
  }
  Throw(Code::kInvalidArgument, "unknown dtype '{}' (expected float32, bfloat16 or float16)", name);
}

nlohmann::json ParamsToJson(const std::vector<shm::ParamSpec>& params) {
  nlohmann::json list = nlohmann::json::array();
  for (const shm::ParamSpec& p : params) {
    list.push_back({{"name", p.name},
                    {"shape", p.shape},
                    {"dtype", std::string(NameOf(p.dtype))},
                    {"group", p.group},
                    {"partition", p.partition}});
  }
  return list;
}

std::vector<shm::ParamSpec> ParamsFromJson(const nlohmann::json& list) {
  std::vector<shm::ParamSpec> params;
  for (const nlohmann::json& p : list) {
    params.push_back(shm::ParamSpec{.name = p.at("name").get<std::string>(),
                                    .shape = p.at("shape").get<std::vector<int64_t>>(),
                                    .dtype = DTypeNamed(p.at("dtype").get<std::string>()),
                                    .group = p.at("group").get<uint32_t>(),
                                    .partition = p.at("partition").get<uint32_t>()});
  }
  return params;
}

// An option's value in a snapshot's layout JSON, and back.
template <typename T>
nlohmann::json OptionToJson(const T& value) {
  return value;
}
nlohmann::json OptionToJson(DType dtype) {
  return std::string(NameOf(dtype));
}
nlohmann::json OptionToJson(shm::OptimizerKind optimizer) {
  return optimizer == shm::OptimizerKind::kAdam ? "adam" : "adamw";
}
nlohmann::json OptionToJson(shm::Speculation speculation) {  // a job's is on or off
  return speculation == shm::Speculation::kOn;
}

template <typename T>
void OptionFromJson(const nlohmann::json& json, T* value) {
  *value = json.get<T>();
}
void OptionFromJson(const nlohmann::json& json, DType* dtype) {
  *dtype = DTypeNamed(json.get<std::string>());
}
void OptionFromJson(const nlohmann::json& json, shm::OptimizerKind* optimizer) {
  const std::string name = json.get<std::string>();
  TS_CHECK(name == "adam" || name == "adamw", Code::kInvalidArgument, "unknown optimizer '{}'", name);
  *optimizer = name == "adam" ? shm::OptimizerKind::kAdam : shm::OptimizerKind::kAdamW;
}
void OptionFromJson(const nlohmann::json& json, shm::Speculation* speculation) {
  *speculation = json.get<bool>() ? shm::Speculation::kOn : shm::Speculation::kOff;
}

// Options that older snapshots lack: they restore with the LayoutSpec's defaults (one state half, no
// speculation; no step terms before protocol 5).
bool AddedLater(std::string_view option) {
  return option == "state_halves" || option == "speculative_clipping" || option == "step_terms";
}

std::string LayoutToJson(const shm::LayoutSpec& spec) {
  nlohmann::json json{{"params", ParamsToJson(spec.params)}, {"frozen", ParamsToJson(spec.frozen)}};
  shm::ForEachOption(spec, [&json](const char* name, const auto& value) { json[name] = OptionToJson(value); });
  return json.dump();
}

shm::LayoutSpec LayoutFromJson(const std::string& text) {
  const nlohmann::json json = ParseBoundedJson(text, "layout metadata");
  shm::LayoutSpec spec;
  spec.params = ParamsFromJson(json.at("params"));
  spec.frozen = ParamsFromJson(json.at("frozen"));
  shm::ForEachOption(spec, [&json](const char* name, auto& value) {
    if (!AddedLater(name) || json.contains(name)) OptionFromJson(json.at(name), &value);
  });
  return spec;
}

std::string HParamsToJson(const std::vector<shm::HParams>& hparams) {
  nlohmann::json list = nlohmann::json::array();
  for (const shm::HParams& h : hparams) list.push_back({h.lr, h.beta1, h.beta2, h.eps, h.weight_decay});
  return list.dump();
}

std::vector<shm::HParams> HParamsFromJson(const std::string& text) {
  std::vector<shm::HParams> hparams;
  for (const nlohmann::json& h : ParseBoundedJson(text, "hparams metadata")) {
    const auto v = h.get<std::vector<double>>();
    TS_CHECK(v.size() == 5, Code::kInvalidArgument, "hparams entries need 5 numbers");
    hparams.push_back(shm::HParams{.lr = v[0], .beta1 = v[1], .beta2 = v[2], .eps = v[3], .weight_decay = v[4]});
  }
  return hparams;
}

const std::string& Required(const std::map<std::string, std::string>& metadata, const char* key) {
  auto found = metadata.find(key);
  TS_CHECK(found != metadata.end(), Code::kInvalidArgument, "its metadata has no '{}'", key);
  return found->second;
}

// Steps stay below 2^62 (shm::BucketCommit keeps them in 62 bits), and a bucket may hold the step after
// the snapshot's.
constexpr uint64_t kStepLimit = uint64_t{1} << 62;
constexpr uint64_t kMaxSnapshotStep = kStepLimit - 2;
// (uid_t)-1 is no user: chown() and setfsuid() take it for "leave as it is".
constexpr uint64_t kMaxUid = std::numeric_limits<uint32_t>::max() - 1;

// A metadata number: decimal digits only (no sign, no space), at most `max`.
uint64_t NumberIn(const std::map<std::string, std::string>& metadata, const char* key, uint64_t max) {
  const std::string& text = Required(metadata, key);
  uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  TS_CHECK(!text.empty() && error == std::errc() && end == text.data() + text.size() && value <= max,
           Code::kInvalidArgument, "its {} metadata '{}' is not a number from 0 to {}", key, Excerpt(text), max);
  return value;
}

SnapshotMeta MetaFromMetadata(const std::map<std::string, std::string>& metadata) {
  auto format = metadata.find("format");
  TS_CHECK(format != metadata.end() && format->second == kSnapshotFormat, Code::kInvalidArgument,
           "it is not a trainstream snapshot (metadata 'format' is {}, expected '{}')",
           format == metadata.end() ? "missing" : "'" + Excerpt(format->second) + "'", kSnapshotFormat);
  SnapshotMeta meta{.job = Required(metadata, "job"),
                    .uid = static_cast<uint32_t>(NumberIn(metadata, "uid", kMaxUid)),
                    .seed = NumberIn(metadata, "seed", std::numeric_limits<uint64_t>::max()),
                    .step = NumberIn(metadata, "step", kMaxSnapshotStep),
                    .hparams = {},
                    .spec = {}};
  try {
    meta.hparams = HParamsFromJson(Required(metadata, "hparams"));
    meta.spec = LayoutFromJson(Required(metadata, "layout"));
  } catch (const nlohmann::json::exception& e) {  // a value of the wrong type: its messages print no value
    Throw(Code::kInvalidArgument, "its layout or hparams metadata is malformed: {}", e.what());
  }
  TS_CHECK(meta.hparams.empty() || meta.hparams.size() == meta.spec.num_groups, Code::kInvalidArgument,
           "its hparams metadata has {} groups, its layout {} (expected as many, or none)", meta.hparams.size(),
           meta.spec.num_groups);
  return meta;
}

// The first inf or NaN among `bytes` of a tensor of `dtype` (F32 or BF16), as (element, value).
std::optional<std::pair<uint64_t, double>> FirstNonFinite(std::span<const std::byte> bytes, const std::string& dtype) {
  if (dtype == "F32") {
    const size_t n = bytes.size() / sizeof(uint32_t);
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits = 0;
      std::memcpy(&bits, bytes.data() + i * sizeof(bits), sizeof(bits));
      if ((bits & 0x7f800000u) == 0x7f800000u) return std::pair{i, static_cast<double>(std::bit_cast<float>(bits))};
    }
  } else if (dtype == "BF16") {
    const size_t n = bytes.size() / sizeof(uint16_t);
    for (size_t i = 0; i < n; ++i) {
      uint16_t bits = 0;
      std::memcpy(&bits, bytes.data() + i * sizeof(bits), sizeof(bits));
      if ((bits & 0x7f80u) == 0x7f80u) {
        return std::pair{i, static_cast<double>(std::bit_cast<float>(static_cast<uint32_t>(bits) << 16))};
      }
    }
  }
  return std::nullopt;
}

}  // namespace

std::string TensorName(const char* kind, uint32_t index) {
  return fmt::format("{}.{}", kind, index);
}

SafetensorsHeader SnapshotHeader(const SnapshotMeta& meta) {
  const shm::LayoutSpec& spec = meta.spec;
  SafetensorsHeader header;
  const char* moments = SafetensorsDType(spec.moment_dtype);
  for (uint32_t i = 0; i < spec.params.size(); ++i) {
    header.tensors.push_back(TensorEntry::Of(TensorName("master", i), "F32", spec.params[i].shape));
    header.tensors.push_back(TensorEntry::Of(TensorName("exp_avg", i), moments, spec.params[i].shape));
    header.tensors.push_back(TensorEntry::Of(TensorName("exp_avg_sq", i), moments, spec.params[i].shape));
  }
  for (uint32_t j = 0; j < spec.frozen.size(); ++j) {
    header.tensors.push_back(
        TensorEntry::Of(TensorName("frozen", j), SafetensorsDType(spec.frozen[j].dtype), spec.frozen[j].shape));
  }
  const auto buckets = static_cast<int64_t>(shm::ComputeLayout(spec).buckets.size());
  header.tensors.push_back(TensorEntry::Of("step", "I64", {static_cast<int64_t>(spec.params.size())}));
  header.tensors.push_back(TensorEntry::Of("bucket_step", "I64", {buckets}));
  header.metadata = {{"format", kSnapshotFormat},
                     {"job", meta.job},
                     {"uid", std::to_string(meta.uid)},
                     {"seed", std::to_string(meta.seed)},
                     {"step", std::to_string(meta.step)},
                     {"layout", LayoutToJson(spec)},
                     {"hparams", HParamsToJson(meta.hparams)},
                     {"daemon_version", std::string(kVersion)}};
  EncodeHeader(header);  // fills in the offsets
  return header;
}

SnapshotFile::SnapshotFile(const std::string& path, RestoreOptions options)
    : file_(path), options_(std::move(options)) {
  try {
    TS_CHECK(file_.size() >= 8, Code::kInvalidArgument, "the file has {} bytes, fewer than a safetensors header needs",
             file_.size());
    std::array<std::byte, 8> length_word{};
    file_.ReadAt(0, length_word);
    std::string json(HeaderLength(length_word, file_.size()), '\0');
    file_.ReadAt(8, std::as_writable_bytes(std::span(json)));
    header_ = DecodeHeader(json, file_.size());
    json = std::string();  // before the layout's own parse: one header in memory at a time
    meta_ = MetaFromMetadata(header_.metadata);
    layout_ = shm::ComputeLayout(meta_.spec);
    CheckTensors();
    ReadSteps();
  } catch (const Error& e) {
    if (e.code() == Code::kFailedPrecondition) throw;  // truncated while read: the file was valid, as far as read
    Throw(e.code(), "snapshot '{}' is not valid: {}", path, e.what());
  }
}

// Every tensor the layout needs, with its dtype and shape, and nothing else.
void SnapshotFile::CheckTensors() const {
  // Counted first: a forged layout of many parameters costs no expected header of as many tensors.
  const size_t needed = 3 * meta_.spec.params.size() + meta_.spec.frozen.size() + 2;
  TS_CHECK(header_.tensors.size() == needed, Code::kInvalidArgument, "it holds {} tensors, its layout needs {}",
           header_.tensors.size(), needed);
  const SafetensorsHeader expected = SnapshotHeader(meta_);
  std::map<std::string, const TensorEntry*> found;
  for (const TensorEntry& tensor : header_.tensors) found[tensor.name] = &tensor;
  for (const TensorEntry& want : expected.tensors) {
    auto have = found.find(want.name);
    TS_CHECK(have != found.end(), Code::kInvalidArgument, "tensor '{}' is missing", want.name);
    TS_CHECK(have->second->dtype == want.dtype && have->second->shape == want.shape, Code::kInvalidArgument,
             "tensor '{}' is {} [{}], its layout needs {} [{}]", want.name, have->second->dtype,
             fmt::join(have->second->shape, ", "), want.dtype, fmt::join(want.shape, ", "));
  }
}

void SnapshotFile::ReadSteps() {
  steps_.resize(meta_.spec.params.size());
  bucket_steps_.resize(layout_.buckets.size());
  file_.ReadAt(header_.data_start + Tensor("step").begin, std::as_writable_bytes(std::span(steps_)));
  file_.ReadAt(header_.data_start + Tensor("bucket_step").begin, std::as_writable_bytes(std::span(bucket_steps_)));
  for (uint32_t i = 0; i < steps_.size(); ++i) {
    TS_CHECK(steps_[i] >= 0 && static_cast<uint64_t>(steps_[i]) < kStepLimit, Code::kInvalidArgument,
             "parameter {} ({}) has AdamW step {} (expected 0 to 2^62 - 1)", i, Excerpt(meta_.spec.params[i].name),
             steps_[i]);
  }
  const auto step = static_cast<int64_t>(meta_.step);
  for (uint32_t b = 0; b < bucket_steps_.size(); ++b) {
    TS_CHECK(bucket_steps_[b] == step || bucket_steps_[b] == step + 1, Code::kInvalidArgument,
             "bucket {} holds step {}, but the snapshot's step is {} (a bucket holds that step or the next)", b,
             bucket_steps_[b], step);
  }
  TS_CHECK(std::find(bucket_steps_.begin(), bucket_steps_.end(), step) != bucket_steps_.end(), Code::kInvalidArgument,
           "no bucket holds the snapshot's step {} (its step is the lowest of its buckets')", step);
}

const TensorEntry& SnapshotFile::Tensor(const std::string& name) const {
  for (const TensorEntry& tensor : header_.tensors) {
    if (tensor.name == name) return tensor;
  }
  Throw(Code::kInternal, "snapshot tensor '{}' vanished", name);  // CheckTensors saw every one
}

void SnapshotFile::RestoreInto(const CommittedState& state) const {
  struct Copy {
    const TensorEntry* tensor;
    std::span<std::byte> into;
    bool checked;  // for inf and NaN
  };
  std::vector<Copy> copies;
  const bool check = !options_.allow_nonfinite;
  for (uint32_t i = 0; i < meta_.spec.params.size(); ++i) {
    const ParamStateRef param = state.Param(i);
    copies.push_back({&Tensor(TensorName("master", i)), std::as_writable_bytes(param.master), check});
    copies.push_back({&Tensor(TensorName("exp_avg", i)), param.exp_avg, check});
    copies.push_back({&Tensor(TensorName("exp_avg_sq", i)), param.exp_avg_sq, check});
  }
  for (uint32_t j = 0; j < meta_.spec.frozen.size(); ++j) {
    copies.push_back({&Tensor(TensorName("frozen", j)), state.Frozen(j), false});
  }
  // In the file's order: one pass forward through it.
  std::sort(copies.begin(), copies.end(),
            [](const Copy& a, const Copy& b) { return a.tensor->begin < b.tensor->begin; });
  for (const Copy& copy : copies) {
    file_.ReadAt(header_.data_start + copy.tensor->begin, copy.into,
                 [&](std::span<const std::byte> chunk, uint64_t offset) {
                   TS_CHECK(!options_.cancelled || !options_.cancelled(), Code::kAborted,
                            "the restore from '{}' was cancelled (the caller went away, or trainstreamd is shutting "
                            "down)",
                            path());
                   if (!copy.checked) return;
                   const auto found = FirstNonFinite(chunk, copy.tensor->dtype);
                   TS_CHECK(!found, Code::kInvalidArgument,
                            "snapshot '{}': tensor '{}' holds a non-finite value ({}) at element {}: the job had "
                            "diverged when it was taken. Restore from an earlier snapshot, or pass --allow-nonfinite "
                            "(RestoreRequest.allow_nonfinite) to restore it as it is",
                            path(), copy.tensor->name, found->second,
                            offset / SafetensorsDTypeSize(copy.tensor->dtype) + found->first);
                 });
  }
  for (uint32_t i = 0; i < meta_.spec.params.size(); ++i) state.Param(i).step = static_cast<uint64_t>(steps_[i]);
  for (uint32_t b = 0; b < layout_.buckets.size(); ++b) {
    state.SetBucketStep(b, static_cast<uint64_t>(bucket_steps_[b]));
    state.MakeUploadCopy(b);
  }
  state.Publish(meta_.step);
}

}  // namespace trainstream::daemon
