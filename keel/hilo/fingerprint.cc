#include "keel/hilo/fingerprint.h"

#include "keel/core/hash.h"
#include "keel/core/mapped_file.h"

namespace keel::hilo {

Result<std::string> FileFingerprint(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  return "keel-xxh3-" + Xxh3_128(file->data(), file->size()).hex();
}

Result<std::string> ExecutableFingerprint() { return FileFingerprint("/proc/self/exe"); }

}  // namespace keel::hilo
