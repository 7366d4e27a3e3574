// Running a test body at every CPU level this machine supports (keel/core/cpu.h): kernels' results
// differ between levels in the last bits, and each level must keep every property on its own.
// Shared by the test binaries of every module (tests/<module>/ include it as
// "tests/common/isa_scope.h").
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "keel/core/cpu.h"

namespace keel::test {

// Sets the level for its lifetime and restores the one in force before, whatever the body did.
class IsaScope {
 public:
  explicit IsaScope(cpu::Isa isa) : saved_(cpu::ActiveIsa()) {
    EXPECT_TRUE(cpu::SetActiveIsa(isa).ok()) << cpu::IsaName(isa);
  }
  ~IsaScope() { EXPECT_TRUE(cpu::SetActiveIsa(saved_).ok()); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;

 private:
  cpu::Isa saved_;
};

// f(isa) at every supported level, lowest first, the level named in failure messages; stops at
// the first level that fails.
template <class F>
void ForEachIsa(F&& f) {
  for (cpu::Isa isa : cpu::SupportedIsas()) {
    SCOPED_TRACE("cpu level " + std::string(cpu::IsaName(isa)));
    IsaScope scope(isa);
    f(isa);
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace keel::test
