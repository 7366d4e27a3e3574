// StateAgent: what each service embeds to follow the controller. It holds the last state the
// controller pushed (with the controller's version number) and answers which state to apply now.
// Pure: time is passed in (unix ms). Not thread-safe: the embedding service serialises calls (or
// copies Current()'s answer into an atomic for its hot path).
//
// Rules (docs/hilo.md):
//  - Push(version, state): a version not newer than the one held is ignored, except that an equal
//    version counts as hearing from the controller (a long-poll that returns the same state is a
//    heartbeat). Versions must grow across controller restarts (the controller numbers them from
//    its start time), or a restarted controller would be ignored.
//  - Current(now): the pushed state while the controller was heard within hold_s; after that the
//    same state, held, until fallback_s; then the catalog's safe state, unless the last state is
//    already lower (cheaper) than it. Before any push: the safe state.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "keel/core/status.h"
#include "keel/hilo/catalog.h"

namespace keel::hilo {

struct AgentOptions {
  double hold_s = 3;       // the controller counts as present this long after it was last heard
  double fallback_s = 30;  // after this long unheard, fall back to the safe state; >= hold_s
};

class StateAgent {
 public:
  enum class Mode {
    kNeverHeard,  // no push yet: the safe state
    kFollowing,   // the controller was heard within hold_s
    kHolding,     // not heard for more than hold_s: the last pushed state, held
    kFallback,    // not heard for more than fallback_s: the safe state (or the lower last one)
  };
  struct View {
    int index = 0;
    const State* state = nullptr;  // into the agent's catalog; valid while the agent lives
    Mode mode = Mode::kNeverHeard;
  };

  // `catalog` must pass ValidateCatalog; options must satisfy 0 <= hold_s <= fallback_s.
  static Result<StateAgent> Create(Catalog catalog, AgentOptions options);

  // Applies a push heard at now_ms. Returns true when it was taken (a newer version, or the first),
  // false when it was ignored (older version) or only refreshed the heard time (same version). InvalidArgument for a state
  // name the catalog does not have (nothing changes then).
  Result<bool> Push(int64_t version, std::string_view state, int64_t now_ms);
  View Current(int64_t now_ms) const;

  int64_t version() const { return version_; }
  // A different controller answers now (its epoch changed): its versions owe nothing to the old
  // one's, so the next push is taken whatever its version. The heard time and state stay.
  void ForgetVersion() { version_ = -1; }

 private:
  StateAgent(Catalog catalog, AgentOptions options) : catalog_(std::move(catalog)), opt_(options) {}
  View At(int index, Mode mode) const { return View{index, &catalog_.states[index], mode}; }

  Catalog catalog_;
  AgentOptions opt_;
  bool heard_ = false;
  int64_t version_ = 0;
  int index_ = 0;
  int64_t heard_ms_ = 0;
};

}  // namespace keel::hilo
