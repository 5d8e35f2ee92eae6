// The client's records of the daemon's replies (client.h) read from their proto messages by field name
// (client/src/proto_records.h): each record lists exactly its message's fields, every field arrives, and a
// record read from the wrong message is a kInternal naming the field, not a protobuf CHECK failure.
#include "client/src/proto_records.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "trainstream/client.h"
#include "trainstream/v1/control.pb.h"

namespace trainstream {
namespace {

namespace v1 = trainstream::v1;
using proto_records::FromProto;

template <typename Record>
std::set<std::string> Listed() {
  std::set<std::string> names;
  Record record;
  Record::VisitFields(record, [&names](const char* name, auto&) { EXPECT_TRUE(names.insert(name).second) << name; });
  return names;
}

std::set<std::string> Declared(const google::protobuf::Descriptor& message) {
  std::set<std::string> names;
  for (int i = 0; i < message.field_count(); ++i) names.insert(std::string(message.field(i)->name()));
  return names;
}

TEST(ProtoRecords, EachRecordListsExactlyTheFieldsOfItsMessage) {
  EXPECT_EQ(Listed<DaemonInfo>(), Declared(*v1::HandshakeReply::descriptor()));
  EXPECT_EQ(Listed<JobReport>(), Declared(*v1::JobStats::descriptor()));
  EXPECT_EQ(Listed<GpuReport>(), Declared(*v1::GpuStats::descriptor()));
  EXPECT_EQ(Listed<StatsReport>(), Declared(*v1::StatsReply::descriptor()));
}

TEST(ProtoRecords, EveryFieldOfAStatsReplyArrives) {
  v1::StatsReply reply;
  reply.set_host_bytes(1);
  reply.set_rss_bytes(2);
  reply.set_worker_threads(3);
  reply.set_kernel("avx512");
  reply.set_daemon_version("9.9");
  reply.set_pid(-4);
  reply.set_uptime_seconds(5.5);
  reply.set_pinned_bytes(6);
  reply.set_max_host_bytes(7);
  reply.set_max_jobs(8);
  v1::GpuStats* gpu = reply.add_gpus();
  gpu->set_gpu("GPU-1");
  gpu->set_to_host_bytes(9);
  gpu->set_to_device_bytes(10);
  v1::JobStats* job = reply.add_jobs();
  job->set_name("run");
  job->set_uid(11);
  job->set_state_halves(2);
  job->add_attached_ranks(0);
  job->add_attached_ranks(3);
  (*job->mutable_transports())[3] = "cuda-ipc on cuda:0";
  job->set_speculative_clipping(true);
  job->set_update_seconds(1.25);
  job->set_last_step_unix_ms(-12);
  job->set_last_snapshot_step(13);
  reply.add_jobs()->set_name("other");

  const StatsReport report = FromProto<StatsReport>(reply);
  EXPECT_EQ(report.host_bytes, 1U);
  EXPECT_EQ(report.rss_bytes, 2U);
  EXPECT_EQ(report.worker_threads, 3U);
  EXPECT_EQ(report.kernel, "avx512");
  EXPECT_EQ(report.daemon_version, "9.9");
  EXPECT_EQ(report.pid, -4);
  EXPECT_EQ(report.uptime_seconds, 5.5);
  EXPECT_EQ(report.pinned_bytes, 6U);
  EXPECT_EQ(report.max_host_bytes, 7U);
  EXPECT_EQ(report.max_jobs, 8U);
  ASSERT_EQ(report.gpus.size(), 1U);
  EXPECT_EQ(report.gpus[0].gpu, "GPU-1");
  EXPECT_EQ(report.gpus[0].to_host_bytes, 9U);
  EXPECT_EQ(report.gpus[0].to_device_bytes, 10U);
  ASSERT_EQ(report.jobs.size(), 2U);
  const JobReport& run = report.jobs[0];
  EXPECT_EQ(run.name, "run");
  EXPECT_EQ(run.uid, 11U);
  EXPECT_EQ(run.state_halves, 2U);
  EXPECT_EQ(run.attached_ranks, (std::vector<uint32_t>{0, 3}));
  EXPECT_EQ(run.transports, (std::map<uint32_t, std::string>{{3, "cuda-ipc on cuda:0"}}));
  EXPECT_TRUE(run.speculative_clipping);
  EXPECT_EQ(run.update_seconds, 1.25);
  EXPECT_EQ(run.last_step_unix_ms, -12);
  EXPECT_EQ(run.last_snapshot_step, 13U);
  EXPECT_EQ(report.jobs[1].name, "other");
  EXPECT_EQ(report.jobs[1].state_halves, 0U);  // the proto's default, not the record's: what the daemon sent
}

struct PidAsUint32 {
  uint32_t pid = 0;
  template <typename Self, typename Visit>
  static void VisitFields(Self& r, Visit&& visit) {
    visit("pid", r.pid);
  }
};

TEST(ProtoRecords, AFieldMissingOrOfAnotherTypeIsAnInternalErrorNamingIt) {
  try {
    (void)FromProto<GpuReport>(v1::JobStats{});
    FAIL() << "a GpuReport was read from a JobStats";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInternal);
    EXPECT_NE(std::string(e.what()).find("'gpu'"), std::string::npos) << e.what();
  }
  try {
    (void)FromProto<PidAsUint32>(v1::HandshakeReply{});
    FAIL() << "an int64 field was read into a uint32";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInternal);
    EXPECT_NE(std::string(e.what()).find("'pid'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace trainstream
