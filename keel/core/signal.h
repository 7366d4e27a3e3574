// Waiting for SIGINT/SIGTERM: every Keel server's main thread blocks here, then drains.
#pragma once

#include "keel/core/status.h"

namespace keel {

// Installs SIGINT and SIGTERM handlers, blocks until one arrives, restores the previous
// handlers and returns the signal number. One waiter at a time (Internal otherwise).
Result<int> WaitForTerminationSignal();
const char* SignalName(int sig);  // "SIGINT", "SIGTERM", else "signal"

}  // namespace keel
