// The LayoutSpec's wire form (proto/layout_spec_proto.h): every field survives the way to the daemon and
// back, requests included (state halves and speculation left to the daemon), and an enum the C++ side
// cannot hold is refused rather than wrapped into range.
#include "proto/layout_spec_proto.h"

#include <gtest/gtest.h>

#include "shm/error.h"
#include "tests/cpp/shm/full_spec.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream {
namespace {

TEST(LayoutSpecProto, EveryFieldRoundTrips) {
  const shm::LayoutSpec spec = testing::FullSpec();
  EXPECT_EQ(FromProto(ToProto(spec)), spec);
  EXPECT_EQ(FromProto(ToProto(shm::LayoutSpec{})), shm::LayoutSpec{});
}

TEST(LayoutSpecProto, ARequestsOpenChoicesRoundTrip) {
  for (const shm::Speculation speculation : {shm::Speculation::kOff, shm::Speculation::kOn, shm::Speculation::kAuto}) {
    shm::LayoutSpec request = testing::FullSpec();
    request.state_halves = 0;
    request.speculative_clipping = speculation;
    EXPECT_EQ(FromProto(ToProto(request)), request);
  }
}

// The wire's enums are 32-bit: a value past the C++ enum's byte would wrap into a valid one.
TEST(LayoutSpecProto, EnumsOutsideTheirCppTypeAreRefused) {
  v1::LayoutSpec proto = ToProto(testing::FullSpec());
  proto.mutable_params(0)->set_dtype(static_cast<v1::DType>(256));
  TS_EXPECT_ERROR(FromProto(proto), Code::kInvalidArgument, "parameter dtype code 256 is out of range");
  proto = ToProto(testing::FullSpec());
  proto.set_optimizer(static_cast<v1::OptimizerKind>(-1));
  TS_EXPECT_ERROR(FromProto(proto), Code::kInvalidArgument, "optimizer kind code -1 is out of range");
  proto = ToProto(testing::FullSpec());
  proto.set_speculative_clipping(static_cast<v1::Speculation>(3));
  TS_EXPECT_ERROR(FromProto(proto), Code::kInvalidArgument, "unknown speculative_clipping 3 (AUTO, OFF or ON)");
}

// Within the byte, what the values may be is the validation's: it names the parameter and the code.
TEST(LayoutSpecProto, AnUnknownDTypeReachesTheValidation) {
  v1::LayoutSpec proto = ToProto(testing::FullSpec());
  proto.mutable_params(1)->set_dtype(static_cast<v1::DType>(9));
  TS_EXPECT_ERROR(shm::ValidateRequest(FromProto(proto)), Code::kInvalidArgument,
                  "parameter 1 (b) has an unknown dtype code 9");
}

}  // namespace
}  // namespace trainstream
