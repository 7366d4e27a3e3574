#include "keel/engine/hilo_levels.h"

#include <algorithm>
#include <map>

#include "keel/core/log.h"
#include "keel/core/mapped_file.h"
#include "keel/core/socket.h"
#include "keel/kv/registry.h"

namespace keel::engine {
namespace {

// A state's answer-length clamp. Catalog values are 1..2^20 (docs/hilo.md), so they fit an int.
int MaxNewTokens(const hilo::State& st) { return static_cast<int>(std::max<int64_t>(1, st.engine.max_new_tokens)); }

}  // namespace

Result<std::unique_ptr<HiloLevels>> HiloLevels::Create(hilo::ServiceLink& link, Engine& engine,
                                                       HiloLevelOptions options) {
  if (link.service() != hilo::Service::kEngine) {
    return Status::InvalidArgument("hilo: the engine needs a link for service 'engine', not '" +
                                   std::string(hilo::ServiceName(link.service())) + "'");
  }
  std::unique_ptr<HiloLevels> h(new HiloLevels(link, engine, options));
  const hilo::Catalog& catalog = link.catalog();
  const std::string current = engine.scheduler().codec_spec();
  std::map<std::string, Result<std::string>> resolved;  // catalog name -> canonical spec (built once)
  for (size_t i = 0; i < catalog.states.size(); ++i) {
    const hilo::State& st = catalog.states[i];
    const std::string& name = st.engine.kv_codec;
    const std::string where = "hilo catalog state '" + st.name + "': engine.kv_codec '" + name + "'";
    // A misspelt codec is the catalog's error; a known one this engine cannot build (bellows
    // without a calibration) falls back at run time, below.
    if (!kv::IsLosslessCodec(name).has_value()) {
      return Status::InvalidArgument(where + " is not a KV codec (known: " + kv::KnownCodecs() + ")");
    }
    if (st.engine.lossless && kv::IsLosslessCodec(name) == false) {
      return Status::InvalidArgument(where + " is a lossy codec but engine.lossless is true");
    }
    auto it = resolved.find(name);
    if (it == resolved.end()) it = resolved.emplace(name, engine.ResolveCodec(name)).first;
    StateCodec sc;
    if (it->second.ok()) {
      sc.spec = *it->second;
    } else {
      sc.error = it->second.status().message();
    }
    if (!engine.can_switch_codec() && sc.spec != current) {
      return Status::InvalidArgument(where + " differs from this engine's codec " + current +
                                     ", and an engine with a kvstore link cannot switch codecs");
    }
    h->codecs_.push_back(std::move(sc));
  }
  Result<std::string> raw = engine.ResolveCodec("raw");
  if (!raw.ok()) return raw.status();
  h->lossless_fallback_ = *raw;
  h->seq_len_ = engine.model().config.max_seq_len;

  Scheduler* s = &engine.scheduler();
  link.meter().SetQueueDepthProbe([s] { return static_cast<int64_t>(s->QueueDepth()); });
  const double slots = std::max(1, s->options().max_running);
  link.meter().SetUtilisationProbe([s, slots] { return static_cast<double>(s->Stats().running) / slots; });
  HiloLevels* self = h.get();
  link.OnChange([self](const hilo::State&, const hilo::State&) { self->Apply(); });
  h->Apply();
  return h;
}

HiloLevels::~HiloLevels() {
  // The link may outlive us: its probes must not call into a scheduler that may go next. (Its
  // OnChange callback is the owner's business: the link is stopped before we go.)
  link_.meter().SetQueueDepthProbe(nullptr);
  link_.meter().SetUtilisationProbe(nullptr);
}

void HiloLevels::Apply() {
  std::lock_guard<std::mutex> lock(mu_);
  const int index = link_.CurrentIndex();
  if (index == applied_.load()) return;
  const hilo::State& st = link_.catalog().states[static_cast<size_t>(index)];
  StateCodec& sc = codecs_[static_cast<size_t>(index)];
  Scheduler& sched = engine_.scheduler();
  std::string want = sc.spec;
  if (want.empty()) {
    // A codec this engine lacks: keep the one in use (or about to be), unless that would put a
    // lossless level on a lossy codec.
    want = sched.target_codec_spec();
    if (st.engine.lossless && kv::IsLosslessCodec(want) != true) want = lossless_fallback_;
    if (!sc.logged) {
      sc.logged = true;
      Log().error("hilo: state '{}' asks for KV codec '{}', which this engine cannot build ({}); using {}", st.name,
                  st.engine.kv_codec, sc.error, want);
    }
  }
  if (Status s = sched.RequestCodec(want, options_.switch_drain); !s.ok() && want != sched.codec_spec()) {
    Log().error("hilo: state '{}': {}", st.name, s.ToString());
  }
  // The new limit also reaches requests already queued or running, so a degrade sheds the
  // backlog's cost at once instead of serving it at the old level.
  sched.ClampMaxTokens(MaxNewTokens(st));
  Log().info("hilo: engine applies state '{}' (kv codec {}, max_context {}, max_new_tokens {})", st.name, want,
             st.engine.max_context, st.engine.max_new_tokens);
  applied_.store(index);
}

AppliedLevel HiloLevels::Current() {
  const int index = link_.CurrentIndex();
  if (index != applied_.load()) Apply();
  const hilo::State& st = link_.catalog().states[static_cast<size_t>(index)];
  AppliedLevel out;
  out.state = &st;
  out.max_new_tokens = MaxNewTokens(st);
  // One token short of the model's context, so that a cut prompt always leaves room to answer.
  out.max_prompt_tokens = static_cast<int>(std::clamp<int64_t>(st.engine.max_context, 1, std::max(1, seq_len_ - 1)));
  return out;
}

Result<std::unique_ptr<hilo::ServiceLink>> OpenHiloLink(const HiloFlags& f, int workers, MetricsRegistry* metrics) {
  hilo::ServiceLinkOptions o;
  o.service = hilo::Service::kEngine;
  o.workers = std::max(workers, 1);
  o.metrics = metrics;
  return hilo::OpenServiceLink(f, std::move(o));
}

}  // namespace keel::engine
