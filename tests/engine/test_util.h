// Helpers shared by the engine tests: where the shared test data lives, and scratch directories.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace keel::test {

// $KEEL_SHARED when set, else the checkout's sibling "shared" directory.
inline std::string SharedDir() {
  const char* env = std::getenv("KEEL_SHARED");
  if (env != nullptr && *env != '\0') return env;
  return std::string(KEEL_SOURCE_DIR) + "/../shared";
}

inline std::string ModelsDir() { return SharedDir() + "/data/models"; }

struct CmdResult {
  int code = -1;    // exit status (-1: did not exit normally)
  std::string out;  // stdout, and stderr when merged
};

// Runs the keel CLI (KEEL_BINARY) with `args` through the shell; stderr is merged into out or
// discarded.
inline CmdResult RunKeel(const std::string& args, bool merge_stderr = true) {
  std::string cmd = std::string(KEEL_BINARY) + " " + args + (merge_stderr ? " 2>&1" : " 2>/dev/null");
  CmdResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// A fresh directory under the system temp dir, removed with everything in it on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "keel") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (tag + "-XXXXXX")).string();
    char* p = ::mkdtemp(tmpl.data());
    path_ = p != nullptr ? p : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace keel::test
