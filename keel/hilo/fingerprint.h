// The fingerprint of the binaries a catalog's figures were measured with (Catalog::binaries).
// Figures measured with one build say nothing certain about another: a faster kernel or a changed
// default moves every capacity. So the controller refuses a catalog whose fingerprint differs from
// the running binaries' (CheckUsable). Every Keel service is the one `keel` executable, so its
// content hash names the whole product build.
#pragma once

#include <string>

#include "keel/core/status.h"

namespace keel::hilo {

// "keel-xxh3-" + 32 hex digits: XXH3-128 of the file's bytes. A content hash, not a version
// string, so a rebuild with any change gets a new fingerprint. NotFound/IOError naming the path.
Result<std::string> FileFingerprint(const std::string& path);
// FileFingerprint of the running executable (/proc/self/exe).
Result<std::string> ExecutableFingerprint();

}  // namespace keel::hilo
