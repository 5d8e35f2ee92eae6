// The one conversion between a job's LayoutSpec (shm/job_layout.h) and its wire form (control.proto's
// LayoutSpec), for the client that sends it and the daemon that receives it. FromProto checks only
// that each enum fits its C++ type; what the values may be is ValidateRequest's (shm/job_layout.cpp).
#pragma once

#include "shm/job_layout.h"
#include "trainstream/v1/control.pb.h"

namespace trainstream {

v1::LayoutSpec ToProto(const shm::LayoutSpec& spec);
// Throws Error kInvalidArgument for an enum value outside its C++ type (a speculation outside the
// proto's three).
shm::LayoutSpec FromProto(const v1::LayoutSpec& proto);

}  // namespace trainstream
