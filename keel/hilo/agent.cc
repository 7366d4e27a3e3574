#include "keel/hilo/agent.h"

#include <algorithm>

namespace keel::hilo {

Result<StateAgent> StateAgent::Create(Catalog catalog, AgentOptions options) {
  KEEL_RETURN_IF_ERROR(ValidateCatalog(catalog));
  if (!(options.hold_s >= 0 && options.fallback_s >= options.hold_s)) {
    return Status::InvalidArgument("agent options: expected 0 <= hold_s <= fallback_s");
  }
  return StateAgent(std::move(catalog), options);
}

Result<bool> StateAgent::Push(int64_t version, std::string_view state, int64_t now_ms) {
  const int index = catalog_.IndexOf(state);
  if (index < 0) return Status::InvalidArgument("pushed state '" + std::string(state.substr(0, 64)) + "' is not in the catalog");
  if (heard_ && version < version_) return false;
  const bool changed = !heard_ || version > version_;
  if (changed) {
    version_ = version;
    index_ = index;
  }
  heard_ = true;
  heard_ms_ = std::max(heard_ms_, now_ms);
  return changed;
}

StateAgent::View StateAgent::Current(int64_t now_ms) const {
  const int safe = catalog_.SafeIndex();
  if (!heard_) return At(safe, Mode::kNeverHeard);
  const double unheard_s = (now_ms - heard_ms_) / 1000.0;
  if (unheard_s <= opt_.hold_s) return At(index_, Mode::kFollowing);
  if (unheard_s <= opt_.fallback_s) return At(index_, Mode::kHolding);
  return At(std::max(index_, safe), Mode::kFallback);
}

}  // namespace keel::hilo
