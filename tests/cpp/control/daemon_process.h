// A real trainstreamd for the control-plane tests: on a temporary socket that every uid may connect
// to, stopped with SIGTERM at scope exit; a way to run a client as another uid (two unprivileged
// ones, and a fixture that skips where the test cannot switch to them); and a job spec of one fp32
// parameter. The tests fork their clients, so gRPC must not have started in the test process itself.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "shm/job_layout.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::testing {

// True if something accepts connections on the Unix socket at `socket_path`.
inline bool Accepts(const std::string& socket_path) {
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
  // `config`: lines of the daemon's TOML file, after socket_mode.
  explicit DaemonProcess(const std::string& config = "") {
    static int counter = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("ts-control-" + std::to_string(getpid()) + "-" + std::to_string(counter++));
    std::filesystem::create_directories(dir_);
    std::filesystem::permissions(dir_, std::filesystem::perms::all);
    socket_ = (dir_ / "d.sock").string();
    std::ofstream(dir_ / "d.toml") << "socket_mode = 438\n" << config;  // 0666
    const std::string config_path = (dir_ / "d.toml").string();
    const std::string log = (dir_ / "log").string();
    pid_ = fork();
    if (pid_ == 0) {
      const int out = open(log.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
      dup2(out, STDOUT_FILENO);
      dup2(out, STDERR_FILENO);
      execl(TRAINSTREAMD_PATH, "trainstreamd", "--socket", socket_.c_str(), "--config", config_path.c_str(),
            "--threads", "1", "--log-level", "debug", nullptr);
      _exit(127);
    }
    // The socket file appears at bind(), before listen(): wait until a connection is accepted.
    EXPECT_TRUE(PollUntil([&] { return Accepts(socket_); }, std::chrono::seconds(20)));
  }
  ~DaemonProcess() {
    kill(pid_, SIGTERM);
    WaitChild(pid_);
    std::filesystem::remove_all(dir_);
  }
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  [[nodiscard]] const std::string& socket() const { return socket_; }
  [[nodiscard]] pid_t pid() const { return pid_; }
  // The daemon's thread count, from /proc.
  [[nodiscard]] int threads() const {
    std::ifstream status("/proc/" + std::to_string(pid_) + "/status");
    for (std::string line; std::getline(status, line);) {
      if (line.starts_with("Threads:")) return std::stoi(line.substr(8));
    }
    return -1;
  }

 private:
  std::filesystem::path dir_;
  std::string socket_;
  pid_t pid_ = -1;
};

// Runs `body` in a child process as `uid` (and gid `uid`); returns its wait status.
inline int RunAs(uint32_t uid, const std::function<int()>& body,
                 std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  return WaitChild(ForkChild([&] {
                     if (setgid(uid) != 0 || setuid(uid) != 0) return 98;
                     return body();
                   }),
                   timeout);
}

// Unprivileged uids of no account in particular: a job's owner and another user.
constexpr uint32_t kAlice = 65534, kMallory = 65533;

// Tests that run clients as kAlice and kMallory: they need root, as here and in CI.
class AsOtherUids : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to run clients as other uids";
  }
};

// One fp32 parameter "w" of `rows` x `cols`.
inline shm::LayoutSpec OneParamSpec(int64_t rows = 4, int64_t cols = 4) {
  shm::LayoutSpec spec;
  spec.params.push_back(shm::ParamSpec{.name = "w", .shape = {rows, cols}, .dtype = DType::kFloat32, .group = 0});
  return spec;
}

}  // namespace trainstream::testing
