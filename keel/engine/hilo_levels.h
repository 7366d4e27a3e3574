// HiloLevels: the engine's side of HiLO (docs/hilo.md; docs/engine.md "HiLO levels"). It follows a
// hilo::ServiceLink and applies the current product state's EngineLevel at run time:
//  - max_new_tokens clamps each request's max_tokens (the answer then ends with "length"),
//    including requests already queued or running when the state changes (Scheduler::
//    ClampMaxTokens: one past the new limit ends at the next step with what it has);
//  - max_context cuts a longer prompt from the front, keeping a leading BOS and the newest
//    tokens (never refused), and is never more than the model's context minus one token;
//  - kv_codec switches the scheduler's KV cache (Scheduler::RequestCodec: drain, then swap), and
//    `lossless` keeps a lossless level off lossy codecs.
// The Server (ServerOptions::hilo) asks Current() for each generation request, names the state in
// an `x-keel-hilo-state` response header, and meters the request into the link's LoadMeter.
//
// Thread safety: Current() from any thread (cheap while the state is unchanged: two atomic loads).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "keel/core/metrics.h"
#include "keel/core/status.h"
#include "keel/engine/engine.h"
#include "keel/hilo/service_link.h"

namespace keel::engine {

struct HiloLevelOptions {
  // How long a codec switch lets running sequences finish before preempting them.
  std::chrono::milliseconds switch_drain{1000};
};

// One request's share of the current level.
struct AppliedLevel {
  const hilo::State* state = nullptr;  // never null from Current()
  int max_new_tokens = 1;              // clamp on max_tokens
  int max_prompt_tokens = 1;           // min(max_context, model context - 1)
};

class HiloLevels {
 public:
  // Checks the link's catalog against this engine and refuses (InvalidArgument naming the state):
  //  - a state with lossless=true whose kv_codec is a lossy codec;
  //  - any state needing another codec than the engine's when the engine cannot switch (kvstore).
  // A kv_codec the engine cannot build (unknown family, bellows without its calibration file) is
  // allowed: that state keeps the codec in use (logged once per state), except that a lossless
  // state never keeps a lossy codec: it falls back to "raw". Sets the link meter's probes (queue
  // depth = the scheduler's queue, utilisation = running sequences / max_running), registers
  // OnChange (so call this before link.Start()) and applies the current state's codec. `link` and
  // `engine` must outlive the result, and the link must be stopped (ServiceLink::Stop) before the
  // result is destroyed: its OnChange callback points here.
  static Result<std::unique_ptr<HiloLevels>> Create(hilo::ServiceLink& link, Engine& engine,
                                                    HiloLevelOptions options = {});
  ~HiloLevels();
  HiloLevels(const HiloLevels&) = delete;
  HiloLevels& operator=(const HiloLevels&) = delete;

  // The level to apply to a request arriving now. Applies a state change first when it has not
  // been applied yet (a pinned link without a controller has no thread to call OnChange).
  AppliedLevel Current();
  // The codec each state gets, as the engine builds it ("" where the state keeps the current one).
  const std::string& codec_for(int state_index) const { return codecs_[static_cast<size_t>(state_index)].spec; }

  hilo::LoadMeter& meter() { return link_.meter(); }
  hilo::ServiceLink& link() { return link_; }

 private:
  struct StateCodec {
    std::string spec;    // canonical spec the engine builds; empty when unavailable
    std::string error;   // why unavailable
    bool logged = false; // the unavailability was logged (once per state)
  };
  HiloLevels(hilo::ServiceLink& link, Engine& engine, HiloLevelOptions options)
      : link_(link), engine_(engine), options_(options) {}
  void Apply();  // makes the scheduler follow the link's current state (idempotent)

  hilo::ServiceLink& link_;
  Engine& engine_;
  HiloLevelOptions options_;
  std::vector<StateCodec> codecs_;  // per catalog state
  std::string lossless_fallback_;   // canonical "raw"
  int seq_len_ = 1;
  std::mutex mu_;                   // Apply
  std::atomic<int> applied_{-1};    // the state index last applied
};

// `keel serve`'s HiLO flags (docs/engine.md "HiLO levels").
// --hilo, --hilo-catalog, --hilo-state, --hilo-instance (keel/hilo/service_link.h).
using HiloFlags = hilo::LinkSource;

// The engine's link for `flags`, not started (HiloLevels::Create registers OnChange first): null
// when no HiLO flag is given. `workers` is the scheduler's max_running; `metrics` (may be null)
// gets the link's gauges. InvalidArgument for conflicting or missing flags, a bad catalog file or
// URL; the controller's errors when its catalog cannot be fetched.
Result<std::unique_ptr<hilo::ServiceLink>> OpenHiloLink(const HiloFlags& flags, int workers,
                                                        MetricsRegistry* metrics);

}  // namespace keel::engine
