// Helpers shared by the engine tests: where the shared test data lives, and scratch directories.
#pragma once

#include <unistd.h>

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
