// The peer watch's server (spmd/runtime/_watch.py): a thread that answers, on a TCP port, a peer
// asking how far this process got on a communicator (MpiWatch::started), whether it is exiting
// and its pid, and on request has it print its Python stack: to peers that present this
// process's token only. Native, so that it answers while Python cannot run: in MPI_Finalize at
// exit, or in a C call holding the interpreter lock.
#ifndef SPMD_CPU_WATCH_H_
#define SPMD_CPU_WATCH_H_

#include <string>

#include "spmd/status.h"

namespace spmd {

// Listens on `host` (an IPv4 address), port 0, and starts the thread; *port: the port taken.
// Only requests that start with `secret` (16 or more characters, no blank) are answered.
Status WatchListen(const std::string& host, const std::string& secret, int* port);
// Stops the thread and closes the port (no-op if none).
void WatchStop();
// From now on the answers say that this process is exiting.
void WatchMarkLeaving();
// Whether this process prints its Python stack on SIGUSR1, the stack request (spmd.init sets it).
void WatchSetDumpsStack(bool on);

}  // namespace spmd

#endif  // SPMD_CPU_WATCH_H_
