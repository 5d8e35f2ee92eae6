#include "daemon/snapshot/snapshot_format.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
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

std::string LayoutToJson(const shm::LayoutSpec& spec) {
  return nlohmann::json{{"params", ParamsToJson(spec.params)},
                        {"frozen", ParamsToJson(spec.frozen)},
                        {"num_groups", spec.num_groups},
                        {"bucket_bytes", spec.bucket_bytes},
                        {"moment_dtype", std::string(NameOf(spec.moment_dtype))},
                        {"optimizer", spec.optimizer == shm::OptimizerKind::kAdam ? "adam" : "adamw"},
                        {"accumulation_steps", spec.accumulation_steps},
                        {"world_size", spec.world_size},
                        {"max_grad_norm", spec.max_grad_norm},
                        {"peers", spec.peers},
                        {"node_rank", spec.node_rank},
                        {"state_halves", spec.state_halves},
                        {"speculative_clipping", spec.speculative_clipping == shm::Speculation::kOn}}
      .dump();
}

shm::LayoutSpec LayoutFromJson(const std::string& text) {
  const nlohmann::json json = ParseBoundedJson(text, "layout metadata");
  shm::LayoutSpec spec;
  spec.params = ParamsFromJson(json.at("params"));
  spec.frozen = ParamsFromJson(json.at("frozen"));
  spec.num_groups = json.at("num_groups").get<uint32_t>();
  spec.bucket_bytes = json.at("bucket_bytes").get<uint64_t>();
  spec.moment_dtype = DTypeNamed(json.at("moment_dtype").get<std::string>());
  const std::string optimizer = json.at("optimizer").get<std::string>();
  TS_CHECK(optimizer == "adam" || optimizer == "adamw", Code::kInvalidArgument, "unknown optimizer '{}'", optimizer);
  spec.optimizer = optimizer == "adam" ? shm::OptimizerKind::kAdam : shm::OptimizerKind::kAdamW;
  spec.accumulation_steps = json.at("accumulation_steps").get<uint32_t>();
  spec.world_size = json.at("world_size").get<uint32_t>();
  spec.max_grad_norm = json.at("max_grad_norm").get<double>();
  spec.peers = json.at("peers").get<std::vector<std::string>>();
  spec.node_rank = json.at("node_rank").get<uint32_t>();
  // A snapshot written before the state halves restores as a job of one half, without speculation.
  spec.state_halves = json.value("state_halves", uint32_t{1});
  spec.speculative_clipping =
      json.value("speculative_clipping", false) ? shm::Speculation::kOn : shm::Speculation::kOff;
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

SnapshotMeta MetaFromMetadata(const std::map<std::string, std::string>& metadata) {
  auto format = metadata.find("format");
  TS_CHECK(format != metadata.end() && format->second == kSnapshotFormat, Code::kInvalidArgument,
           "it is not a trainstream snapshot (metadata 'format' is {}, expected '{}')",
           format == metadata.end() ? "missing" : "'" + Excerpt(format->second) + "'", kSnapshotFormat);
  try {
    return SnapshotMeta{.job = Required(metadata, "job"),
                        .uid = static_cast<uint32_t>(std::stoul(Required(metadata, "uid"))),
                        .seed = std::stoull(Required(metadata, "seed")),
                        .step = std::stoull(Required(metadata, "step")),
                        .hparams = HParamsFromJson(Required(metadata, "hparams")),
                        .spec = LayoutFromJson(Required(metadata, "layout"))};
  } catch (const nlohmann::json::exception& e) {
    Throw(Code::kInvalidArgument, "its layout or hparams metadata is malformed: {}", e.what());
  } catch (const std::logic_error& e) {  // std::stoul and friends
    Throw(Code::kInvalidArgument, "its uid, seed or step metadata is not a number");
  }
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
    TS_CHECK(steps_[i] >= 0, Code::kInvalidArgument, "parameter {} has step {}", i, steps_[i]);
  }
  for (uint32_t b = 0; b < bucket_steps_.size(); ++b) {
    TS_CHECK(bucket_steps_[b] >= 0 && bucket_steps_[b] < (int64_t{1} << 62), Code::kInvalidArgument,
             "bucket {} has step {}", b, bucket_steps_[b]);
  }
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
  };
  std::vector<Copy> copies;
  for (uint32_t i = 0; i < meta_.spec.params.size(); ++i) {
    const ParamStateRef param = state.Param(i);
    copies.push_back({&Tensor(TensorName("master", i)), std::as_writable_bytes(param.master)});
    copies.push_back({&Tensor(TensorName("exp_avg", i)), param.exp_avg});
    copies.push_back({&Tensor(TensorName("exp_avg_sq", i)), param.exp_avg_sq});
  }
  for (uint32_t j = 0; j < meta_.spec.frozen.size(); ++j)
    copies.push_back({&Tensor(TensorName("frozen", j)), state.Frozen(j)});
  // In the file's order: one pass forward through it.
  std::sort(copies.begin(), copies.end(),
            [](const Copy& a, const Copy& b) { return a.tensor->begin < b.tensor->begin; });
  for (const Copy& copy : copies) {
    file_.ReadAt(header_.data_start + copy.tensor->begin, copy.into, [&](std::span<const std::byte>, uint64_t) {
      TS_CHECK(!options_.cancelled || !options_.cancelled(), Code::kAborted,
               "the restore from '{}' was cancelled (the caller went away, or trainstreamd is shutting "
               "down)",
               path());
    });
  }
  for (uint32_t i = 0; i < meta_.spec.params.size(); ++i) state.Param(i).step = static_cast<uint64_t>(steps_[i]);
  uint64_t lowest = UINT64_MAX;
  for (uint32_t b = 0; b < layout_.buckets.size(); ++b) {
    state.SetBucketStep(b, static_cast<uint64_t>(bucket_steps_[b]));
    state.MakeUploadCopy(b);
    lowest = std::min(lowest, static_cast<uint64_t>(bucket_steps_[b]));
  }
  state.Publish(lowest);
}

}  // namespace trainstream::daemon
