// The peer watch's server; see watch.h. One request per connection, one line each way:
//   request "<token> <stack 0|1> <world rank>,<world rank>,...\n"
//   answer  "<started, or -1> <exiting 0|1> <pid> <prints its stack 0|1>\n"
// or one line, unanswered, that tells of a peer's failure of a collective over MPI:
//   "<token> F <collective> <its world rank> <world rank>,<world rank>,... <its error>\n"
// or a question about this process's wait (the job's wait board across nodes, board.h):
//   request "<token> W\n", answer board::Mine()'s line and "\n"
// or one line, unanswered, that declares a deadlock this process's waits are part of:
//   "<token> D <its description>\n"
// Texts carry "\\" for a backslash and "\n" for a newline.
// A request without this process's token gets no answer (the connection is closed) and does
// nothing. The clients are served together (poll): one that sends nothing, or sends slowly,
// delays nobody; it is dropped at its deadline, or when kMaxClients newer ones are waiting.
#include "watch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "board.h"
#include "mpi.h"

namespace spmd {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<bool> leaving{false}, dumps{false}, stopping{false};
std::mutex mu;  // guards the thread, the socket and the token
std::thread* server = nullptr;  // never destroyed while running: a process may exit without Stop
int listen_fd = -1;
std::string token;  // set before the thread starts, constant while it runs

constexpr int kPollMs = 250;
constexpr size_t kMaxRequest = 1 << 20;
constexpr size_t kMaxClients = 64;
constexpr auto kClientTime = std::chrono::milliseconds(500);

struct Client {
  int fd;
  Clock::time_point deadline;
  std::string line;
};

// Compares in a time that does not depend on where the strings differ.
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size() || a.empty()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// Reads "<rank>,<rank>,..." from p; returns where it stopped.
const char* ReadRanks(const char* p, std::vector<int>* ranks) {
  while (*p != 0) {
    char* end = nullptr;
    const long r = std::strtol(p, &end, 10);
    if (end == p) break;
    ranks->push_back(static_cast<int>(r));
    p = end;
    if (*p != ',') break;
    ++p;
  }
  return p;
}

// A text as sent: "\\" for a backslash and "\n" for a newline.
std::string Unescaped(const char* p) {
  std::string out;
  for (const char* c = p; *c != 0; ++c) {
    if (*c == '\\' && (c[1] == 'n' || c[1] == '\\')) {
      out += c[1] == 'n' ? '\n' : '\\';
      ++c;
    } else {
      out += *c;
    }
  }
  return out;
}

// A peer's failure of collective #call on the communicators of `ranks`: kept (the first one)
// for their next collective and their waits (MpiComm::PeerFailed).
void Told(const char* p) {
  char* end = nullptr;
  const unsigned long long call = std::strtoull(p, &end, 10);
  if (end == p || *end != ' ' || call == 0) return;
  const long peer = std::strtol(end + 1, &end, 10);
  if (*end != ' ') return;
  std::vector<int> ranks;
  p = ReadRanks(end + 1, &ranks);
  if (ranks.empty() || *p != ' ') return;
  const std::string error = Unescaped(p + 1);
  for (const auto& w : MpiWatches()) {
    if (w->world_ranks != ranks) continue;
    std::lock_guard<std::mutex> lock(w->mu);
    const uint64_t known = w->peer_failed.load();
    if (known != 0 && known <= call) continue;
    w->peer_rank = static_cast<int>(peer);
    w->peer_failure = error;
    w->peer_failed.store(call, std::memory_order_release);  // after the text
  }
}

// Answers one request line (without its newline), unless it lacks the token.
void Answer(int fd, const std::string& line) {
  const size_t space = line.find(' ');
  if (space == std::string::npos || !SameSecret(line.substr(0, space), token)) return;
  const char* p = line.c_str() + space + 1;
  if (p[0] == 'F' && p[1] == ' ') return Told(p + 2);
  if (p[0] == 'D' && p[1] == ' ') return board::Declare(Unescaped(p + 2));
  if (p[0] == 'W' && p[1] == 0) {
    const std::string out = board::Mine() + "\n";
    (void)!send(fd, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    return;
  }
  const bool stack = *p == '1';
  if (*p != 0) ++p;
  if (*p == ' ') ++p;
  std::vector<int> ranks;
  ReadRanks(p, &ranks);
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
  // A few bytes into a new connection's empty buffer: a non-blocking send takes them whole.
  (void)!send(fd, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  if (stack && prints) kill(getpid(), SIGUSR1);  // faulthandler prints the stack
}

// Reads what a client has sent; true when it is done with (answered, closed, or misbehaving).
bool Read(Client* c) {
  char buf[4096];
  while (true) {
    const ssize_t n = recv(c->fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return true;
    const size_t old = c->line.size();
    c->line.append(buf, static_cast<size_t>(n));
    const size_t end = c->line.find('\n', old);
    if (end != std::string::npos) {
      c->line.resize(end);
      Answer(c->fd, c->line);
      return true;
    }
    if (c->line.size() > kMaxRequest) return true;
  }
}

void Serve(int fd) {
  std::deque<Client> clients;  // oldest first
  std::vector<pollfd> fds;
  while (!stopping.load()) {
    fds.assign(1, pollfd{fd, POLLIN, 0});
    for (const Client& c : clients) fds.push_back(pollfd{c.fd, POLLIN, 0});
    if (poll(fds.data(), fds.size(), kPollMs) < 0 && errno != EINTR) continue;
    const auto now = Clock::now();
    std::deque<Client> kept;
    for (size_t i = 0; i < clients.size(); ++i) {
      Client& c = clients[i];
      const bool done = (fds[i + 1].revents != 0 && Read(&c)) || now >= c.deadline;
      if (done) {
        close(c.fd);
      } else {
        kept.push_back(std::move(c));
      }
    }
    clients.swap(kept);
    if ((fds[0].revents & POLLIN) == 0) continue;
    while (true) {  // every connection waiting (the listening socket does not block)
      const int conn = accept4(fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (conn < 0) break;
      if (clients.size() >= kMaxClients) {  // too many at once: the oldest goes
        close(clients.front().fd);
        clients.pop_front();
      }
      clients.push_back(Client{conn, now + kClientTime, {}});
      if (Read(&clients.back())) {  // its request may be there already
        close(conn);
        clients.pop_back();
      }
    }
  }
  for (const Client& c : clients) close(c.fd);
}

}  // namespace

Status WatchListen(const std::string& host, const std::string& secret, int* port) {
  std::lock_guard<std::mutex> lock(mu);
  if (listen_fd >= 0) return Status::Error("the peer watch is already listening");
  if (secret.size() < 16 || secret.find_first_of(" \n") != std::string::npos) {
    return Status::Error("the peer watch's token must be 16 or more characters, no blank");
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return Status::Error("the peer watch's address " + host + " is not an IPv4 address");
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
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
  token = secret;
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
