// The `keel` command line: each module's commands register themselves here (one Add*Commands per
// apps/cmd_*.cc), and main runs the one that was parsed. A new command is one registration
// function and one line in main's list, not edits across a long main.
#pragma once

#include <functional>
#include <vector>

#include <CLI/CLI.hpp>

#include "keel/core/status.h"

namespace keel::cli {

// A runnable (sub)command. Its options are bound to state the registration owns (held by `run`),
// so `run` reads what the parse wrote.
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
  bool logs_kernels = false;  // engine commands log which CPU kernels run at info level
};
using Commands = std::vector<Command>;

// Logs the error; exit status 2 for invalid arguments, else 1.
int Fail(const Status& s);

// A server command's end: waits for SIGTERM or SIGINT, logs it, runs `stop` and returns the exit
// status (`stop`'s error, or waiting's, through Fail).
int StopOnSignal(const std::function<Status()>& stop, const char* what = "stopping");

// A secret (token or key) from a file: its first line, 16..256 printable ASCII bytes without
// spaces, so a short guessable one is refused. `what` names it in errors ("admin token").
Result<std::string> ReadSecretFile(const std::string& path, const char* what);

void AddEngineCommands(CLI::App& app, Commands& out);   // generate, serve, bench, inspect, convert, make-model
void AddKvstoreCommands(CLI::App& app, Commands& out);  // kvstore
void AddVectorCommands(CLI::App& app, Commands& out);   // vector (+ keygen), vector-router
void AddGatewayCommands(CLI::App& app, Commands& out);  // gateway, gateway-policy, fake-vendor
void AddBellowsCommands(CLI::App& app, Commands& out);  // bellows calibrate|inspect
void AddHiloCommands(CLI::App& app, Commands& out);     // hilo serve|check|validate|fingerprint|replay
void AddAnswerCommands(CLI::App& app, Commands& out);   // answer serve|index

}  // namespace keel::cli
