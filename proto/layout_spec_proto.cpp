#include "proto/layout_spec_proto.h"

namespace trainstream {

namespace {

void ToProto(const shm::ParamSpec& p, v1::ParamSpec* param) {
  param->set_name(p.name);
  for (int64_t d : p.shape) param->add_shape(d);
  param->set_dtype(static_cast<v1::DType>(p.dtype));
  param->set_group(p.group);
  param->set_partition(p.partition);
}

std::vector<shm::ParamSpec> FromProto(const google::protobuf::RepeatedPtrField<v1::ParamSpec>& proto) {
  std::vector<shm::ParamSpec> params;
  params.reserve(proto.size());
  for (const v1::ParamSpec& p : proto) {
    params.push_back(shm::ParamSpec{
        .name = p.name(),
        .shape = {p.shape().begin(), p.shape().end()},
        .dtype = shm::EnumFromCode<DType>(p.dtype(), "parameter dtype"),
        .group = p.group(),
        .partition = p.partition(),
    });
  }
  return params;
}

// The wire numbers AUTO first (proto3's default), shm::Speculation kOff first (a job's own).
v1::Speculation ToProto(shm::Speculation speculation) {
  switch (speculation) {
    case shm::Speculation::kOff: return v1::SPECULATION_OFF;
    case shm::Speculation::kOn: return v1::SPECULATION_ON;
    case shm::Speculation::kAuto: return v1::SPECULATION_AUTO;
  }
  Throw(Code::kInvalidArgument, "speculative_clipping {} must be off (0), on (1) or automatic (2)",
        static_cast<int>(speculation));
}

shm::Speculation FromProto(v1::Speculation speculation) {
  switch (speculation) {
    case v1::SPECULATION_AUTO: return shm::Speculation::kAuto;
    case v1::SPECULATION_OFF: return shm::Speculation::kOff;
    case v1::SPECULATION_ON: return shm::Speculation::kOn;
    default: break;
  }
  Throw(Code::kInvalidArgument, "unknown speculative_clipping {} (AUTO, OFF or ON)", static_cast<int>(speculation));
}

}  // namespace

v1::LayoutSpec ToProto(const shm::LayoutSpec& spec) {
  v1::LayoutSpec proto;
  for (const shm::ParamSpec& p : spec.params) ToProto(p, proto.add_params());
  for (const shm::ParamSpec& p : spec.frozen) ToProto(p, proto.add_frozen());
  proto.set_num_groups(spec.num_groups);
  proto.set_bucket_bytes(spec.bucket_bytes);
  proto.set_moment_dtype(static_cast<v1::DType>(spec.moment_dtype));
  static_assert(v1::ADAMW == static_cast<int>(shm::OptimizerKind::kAdamW) &&
                v1::ADAM == static_cast<int>(shm::OptimizerKind::kAdam));
  proto.set_optimizer(static_cast<v1::OptimizerKind>(spec.optimizer));
  proto.set_accumulation_steps(spec.accumulation_steps);
  proto.set_world_size(spec.world_size);
  proto.set_max_grad_norm(spec.max_grad_norm);
  for (const std::string& peer : spec.peers) proto.add_peers(peer);
  proto.set_node_rank(spec.node_rank);
  proto.set_state_halves(spec.state_halves);
  proto.set_speculative_clipping(ToProto(spec.speculative_clipping));
  proto.set_step_terms(spec.step_terms);
  return proto;
}

shm::LayoutSpec FromProto(const v1::LayoutSpec& proto) {
  shm::LayoutSpec spec;
  spec.params = FromProto(proto.params());
  spec.frozen = FromProto(proto.frozen());
  spec.num_groups = proto.num_groups();
  spec.bucket_bytes = proto.bucket_bytes();
  spec.moment_dtype = shm::EnumFromCode<DType>(proto.moment_dtype(), "moment dtype");
  spec.optimizer = shm::EnumFromCode<shm::OptimizerKind>(proto.optimizer(), "optimizer kind");
  spec.accumulation_steps = proto.accumulation_steps();
  spec.world_size = proto.world_size();
  spec.max_grad_norm = proto.max_grad_norm();
  spec.peers = {proto.peers().begin(), proto.peers().end()};
  spec.node_rank = proto.node_rank();
  spec.state_halves = proto.state_halves();
  spec.speculative_clipping = FromProto(proto.speculative_clipping());
  spec.step_terms = proto.step_terms();
  return spec;
}

}  // namespace trainstream
