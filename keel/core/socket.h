// Blocking TCP helpers with poll()-based deadlines, shared by Keel's servers and clients
// (HTTP, kvstore). A deadline is an absolute steady_clock time point; "no deadline" is
// Deadline::max(). Every read and write gives up at the deadline with Unavailable, so a slow or
// silent peer can never hold a thread forever.
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "keel/core/status.h"

namespace keel {

using Deadline = std::chrono::steady_clock::time_point;
inline Deadline DeadlineIn(int timeout_ms) {
  return timeout_ms < 0 ? Deadline::max() : std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
}
// Milliseconds left until `deadline` for poll(): -1 for none, 0 when passed.
int MillisLeft(Deadline deadline);

// Waits for `events` on fd. Returns >0 when ready, 0 on timeout, <0 on error (errno set).
int PollFd(int fd, short events, int timeout_ms, short* revents = nullptr);

struct ListeningSocket {
  int fd = -1;
  int port = 0;          // the bound port (the kernel's choice when 0 was asked for); 0 for Unix
  std::string unix_path;  // the socket file of a Unix-domain listener, else ""
  uint64_t unix_dev = 0, unix_ino = 0;  // its identity, so Unlink never removes a successor's
};
// socket + SO_REUSEADDR + bind + listen on host:port (close-on-exec). IOError names the
// address and the OS error.
Result<ListeningSocket> ListenTcp(const std::string& host, int port, int backlog);

// A Unix-domain stream listener at `path` whose file only its owner may connect to (mode 0600;
// set before listen(), so no other user can connect in between). A stale socket file left by a
// dead server is removed; a live one (something accepts on it) or a non-socket file is refused
// with IOError naming the path. InvalidArgument when the path does not fit sockaddr_un.
Result<ListeningSocket> ListenUnix(const std::string& path, int backlog);
// Removes the socket file of a Unix listener if it is still the one ListenUnix created (same
// device and inode). Call it before closing socket.fd: the bound socket keeps its inode alive, so
// a successor's file, created after ours was removed, cannot have the same inode number.
void UnlinkUnixSocket(const ListeningSocket& socket);

// Connects with a timeout; TCP_NODELAY set. Unavailable names host:port and the error.
Result<int> ConnectTcp(const std::string& host, int port, int timeout_ms);

// Reads exactly n bytes. Unavailable on EOF ("closed"), error or deadline.
Status ReadFull(int fd, void* buf, size_t n, Deadline deadline);
// Writes every byte of iov[0..count) (the array is modified as it is consumed); MSG_NOSIGNAL.
Status WriteFullV(int fd, iovec* iov, int count, Deadline deadline);

// One round of a server's accept loop: waits up to poll_ms for a connection on listen_fd or a
// wake-up on wake_fd (an eventfd written by Stop). kAccepted sets *fd (close-on-exec,
// TCP_NODELAY for TCP) and *peer ("ip:port", or "unix:pid=P,uid=U" from SO_PEERCRED); kStop means woken or a poll failure (logged with `tag`); kNone means
// nothing happened (timeout, transient accept failure — fd exhaustion backs off briefly).
enum class AcceptResult { kAccepted, kStop, kNone };
AcceptResult AcceptConnection(int listen_fd, int wake_fd, int poll_ms, const char* tag, int* fd, std::string* peer);

// "ip:port" ("[ip6]:port") of a peer address.
std::string PeerName(const sockaddr_storage& ss);

// Half-closes the write side, then drains unread input for up to max_ms, so that an error
// response sent before the request was fully read reaches the client instead of being destroyed
// by the RST that closing a socket with unread data causes. Does not close fd.
void LingeringClose(int fd, int max_ms);

}  // namespace keel
