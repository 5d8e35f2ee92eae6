// Job ownership by uid, against a real trainstreamd: clients prove their uid (shm/identity_proof.h),
// a root daemon gives each job's segments to its user, and another uid can neither attach to nor
// drop that job. Clients run in forked children that drop to unprivileged uids; the test runs as
// root (as here and in CI) and skips otherwise.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "shm/identity_proof.h"
#include "tests/cpp/shm/test_support.h"
#include "trainstream/client.h"
#include "trainstream/v1/control.grpc.pb.h"

namespace trainstream {
namespace {
using namespace trainstream::testing;  // NOLINT(google-build-using-namespace): the shared test helpers

constexpr uint32_t kAlice = 65534, kMallory = 65533;

shm::LayoutSpec TinySpec() {
  shm::LayoutSpec spec;
  spec.params.push_back(shm::ParamSpec{.name = "w", .shape = {4, 4}, .dtype = DType::kFloat32, .group = 0});
  return spec;
}

// A trainstreamd on a temporary socket that every uid may connect to.
bool Accepts(const std::string& socket_path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  socket_path.copy(address.sun_path, sizeof(address.sun_path) - 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  const bool connected = connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
  close(fd);
  return connected;
}

class DaemonProcess {
 public:
  DaemonProcess() {
    dir_ = std::filesystem::temp_directory_path() / ("ts-identity-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    std::filesystem::permissions(dir_, std::filesystem::perms::all);
    socket_ = (dir_ / "d.sock").string();
    std::ofstream(dir_ / "d.toml") << "socket_mode = 438\n";  // 0666
    const std::string config = (dir_ / "d.toml").string();
    pid_ = fork();
    if (pid_ == 0) {
      execl(TRAINSTREAMD_PATH, "trainstreamd", "--socket", socket_.c_str(), "--config", config.c_str(), "--threads",
            "1", "--log-level", "warn", nullptr);
      _exit(127);
    }
    // The socket file appears at bind(), before listen(): wait until a connection is accepted. (Not
    // through gRPC: these tests fork clients, and gRPC must not have started in the parent then.)
    EXPECT_TRUE(PollUntil([&] { return Accepts(socket_); }, std::chrono::seconds(20)));
  }
  ~DaemonProcess() {
    kill(pid_, SIGTERM);
    WaitChild(pid_);
    std::filesystem::remove_all(dir_);
  }
  [[nodiscard]] const std::string& socket() const { return socket_; }

 private:
  std::filesystem::path dir_;
  std::string socket_;
  pid_t pid_ = -1;
};

// Runs `body` in a child process as `uid`.
int RunAs(uint32_t uid, const std::function<int()>& body) {
  return WaitChild(ForkChild([&] {
    if (setgid(uid) != 0 || setuid(uid) != 0) return 98;
    return body();
  }));
}

class IdentityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to run clients as other uids";
  }
};

TEST_F(IdentityTest, JobSegmentsBelongToTheirUserAndOthersAreRefused) {
  DaemonProcess daemon;
  int ready[2], release[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(release), 0);
  // Alice attaches, checks who owns her segments, and stays attached until released.
  const pid_t alice = ForkChild([&] {
    close(ready[0]);
    close(release[1]);
    if (setgid(kAlice) != 0 || setuid(kAlice) != 0) return 98;
    auto client = Client::Connect(daemon.socket());
    auto session = client->Attach("alice", 0, TinySpec(), 1);
    struct stat info {};
    const std::string state = "/dev/shm/" + shm::SegmentName(kAlice, client->Stats().jobs.at(0).job_key, "state");
    if (stat(state.c_str(), &info) != 0 || info.st_uid != kAlice || (info.st_mode & 0777) != 0600) return 2;
    char byte = 1;
    if (write(ready[1], &byte, 1) != 1 || read(release[0], &byte, 1) != 1) return 3;
    return 0;
  });
  // Each side keeps only its own ends, so a read sees end-of-file when the other side dies.
  close(ready[1]);
  close(release[0]);
  char byte = 0;
  if (read(ready[0], &byte, 1) != 1) {
    ADD_FAILURE() << "alice did not attach";
    WaitChild(alice);
    return;
  }

  EXPECT_TRUE(ExitedWith(RunAs(kMallory,
                               [&] {
                                 auto client = Client::Connect(daemon.socket());
                                 try {
                                   client->Attach("alice", 0, TinySpec(), 1);
                                   return 1;
                                 } catch (const Error& e) {
                                   if (e.code() != Code::kPermissionDenied) return 2;
                                   if (std::string(e.what()).find("belongs to uid 65534") == std::string::npos)
                                     return 3;
                                 }
                                 try {
                                   client->DropJob("alice", true);
                                   return 4;
                                 } catch (const Error& e) {
                                   return e.code() == Code::kPermissionDenied ? 0 : 5;
                                 }
                               }),
                         0));
  ASSERT_EQ(write(release[1], &byte, 1), 1);
  EXPECT_TRUE(ExitedWith(WaitChild(alice), 0));
}

TEST_F(IdentityTest, ForgedOrReusedNoncesAreRefused) {
  DaemonProcess daemon;
  auto stub = v1::Control::NewStub(grpc::CreateChannel("unix:" + daemon.socket(), grpc::InsecureChannelCredentials()));
  auto drop = [&](const std::string& nonce) {
    grpc::ClientContext context;
    v1::DropJobRequest request;
    request.set_job("anything");
    request.set_nonce(nonce);
    v1::DropJobReply reply;
    return stub->DropJob(&context, request, &reply);
  };
  auto challenge = [&] {
    grpc::ClientContext context;
    v1::ChallengeReply reply;
    EXPECT_TRUE(stub->Challenge(&context, v1::ChallengeRequest(), &reply).ok());
    return reply.nonce();
  };

  grpc::Status status = drop("0123456789abcdef");  // never issued
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(status.error_message().find("unknown, used or expired nonce"), std::string::npos);

  const std::string unproven = challenge();  // issued, but no proof file
  status = drop(unproven);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(status.error_message().find("does not exist"), std::string::npos);

  const std::string proven = challenge();
  shm::CreateProof(proven);
  EXPECT_EQ(drop(proven).error_code(), grpc::StatusCode::NOT_FOUND);  // identity accepted: no such job
  EXPECT_FALSE(std::filesystem::exists(shm::ProofPath(proven)));      // the daemon consumed the proof
  status = drop(proven);                                              // a nonce is good once
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

}  // namespace
}  // namespace trainstream
