// The peer watch's server; see watch.h. One request per connection, one line each way:
//   request "<stack 0|1> <world rank>,<world rank>,...\n"
//   answer  "<started, or -1> <exiting 0|1> <pid> <prints its stack 0|1>\n"
#include "watch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "mpi.h"

namespace spmd {
namespace {

std::atomic<bool> leaving{false}, dumps{false}, stopping{false};
std::mutex mu;  // guards the thread and the socket
std::thread* server = nullptr;  // never destroyed while running: a process may exit without Stop
int listen_fd = -1;

constexpr int kPollMs = 250;
constexpr size_t kMaxRequest = 1 << 20;

// Reads one line (without its newline) within the socket's timeout; false on EOF or error.
bool ReadLine(int fd, std::string* line) {
  char buf[4096];
  while (line->size() < kMaxRequest) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return false;
    line->append(buf, static_cast<size_t>(n));
    const size_t end = line->find('\n');
    if (end != std::string::npos) {
      line->resize(end);
      return true;
    }
  }
  return false;
}

void Answer(int fd) {
  timeval tv{0, 500000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  std::string line;
  if (!ReadLine(fd, &line)) return;
  const bool stack = !line.empty() && line[0] == '1';
  std::vector<int> ranks;
  const char* p = line.c_str() + std::min<size_t>(line.size(), 2);
  while (*p != 0) {
    char* end = nullptr;
    const long r = std::strtol(p, &end, 10);
    if (end == p) break;
    ranks.push_back(static_cast<int>(r));
    p = *end == ',' ? end + 1 : end;
  }
  long long started = -1;
  if (!ranks.empty()) {
    for (const auto& w : MpiWatches()) {
      if (w->world_ranks == ranks) {
        started = std::max(started, static_cast<long long>(w->started.load()));
      }
    }
  }
  const bool prints = dumps.load();
  const std::string out = std::to_string(started) + " " + (leaving.load() ? "1" : "0") + " " +
                          std::to_string(getpid()) + " " + (prints ? "1" : "0") + "\n";
  (void)!send(fd, out.data(), out.size(), MSG_NOSIGNAL);
  if (stack && prints) kill(getpid(), SIGUSR1);  // faulthandler prints the stack
}

void Serve(int fd) {
  while (!stopping.load()) {
    pollfd pfd{fd, POLLIN, 0};
    const int ready = poll(&pfd, 1, kPollMs);
    if (ready <= 0) continue;
    const int conn = accept(fd, nullptr, nullptr);
    if (conn < 0) continue;
    Answer(conn);
    close(conn);
  }
}

}  // namespace

Status WatchListen(const std::string& host, int* port) {
  std::lock_guard<std::mutex> lock(mu);
  if (listen_fd >= 0) return Status::Error("the peer watch is already listening");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return Status::Error("the peer watch's address " + host + " is not an IPv4 address");
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::Error(std::string("socket: ") + std::strerror(errno));
  socklen_t len = sizeof addr;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(fd, 64) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    close(fd);
    return Status::Error("cannot listen on " + host + ": " + std::strerror(err));
  }
  *port = ntohs(addr.sin_port);
  listen_fd = fd;
  stopping.store(false);
  server = new std::thread(Serve, fd);
  return Status::Ok();
}

void WatchStop() {
  std::lock_guard<std::mutex> lock(mu);
  if (listen_fd < 0) return;
  stopping.store(true);
  server->join();
  delete server;
  server = nullptr;
  close(listen_fd);
  listen_fd = -1;
}

void WatchMarkLeaving() { leaving.store(true); }

void WatchSetDumpsStack(bool on) { dumps.store(on); }

}  // namespace spmd
