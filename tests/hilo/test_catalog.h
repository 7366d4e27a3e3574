// A valid five-state catalog shared by the hilo tests. Capacities (req/s) per state:
//   index name          quality answer vector engine gateway
//   0     full          100     100    400    100    1000
//   1     small_model   99.8    150    400    150    1000
//   2     fewer_docs    99.6    200    600    200    1000
//   3     no_rerank     99.5    300    800    300    1000
//   4     bare          97      500    5000   500    1000   (safe_state)
#pragma once

#include <string>

#include "keel/hilo/catalog.h"

namespace keel::hilo::testing {

inline constexpr int64_t kValidatedAt = 1764900000;  // 2025-12-05T02:00:00Z

inline State MakeState(std::string name, double quality, double answer, double vector, double engine,
                       double gateway) {
  State s;
  s.name = std::move(name);
  s.answer = {true, 8};
  s.vector = {64, 10, true, 4};
  s.engine = {"zipfusion", true, 4096, 256};
  s.gateway = {"large", 256};
  s.figures = Figures{quality, {answer, vector, engine, gateway}, kValidatedAt};
  return s;
}

inline Catalog TestCatalog() {
  Catalog c;
  c.states.push_back(MakeState("full", 100, 100, 400, 100, 1000));
  c.states.push_back(MakeState("small_model", 99.8, 150, 400, 150, 1000));
  c.states.back().gateway = {"small", 256};
  c.states.push_back(MakeState("fewer_docs", 99.6, 200, 600, 200, 1000));
  c.states.back().answer.context_docs = 3;
  c.states.back().vector.nprobe = 16;
  c.states.push_back(MakeState("no_rerank", 99.5, 300, 800, 300, 1000));
  c.states.back().vector.rerank = false;
  c.states.back().engine = {"bellows", false, 2048, 128};
  c.states.push_back(MakeState("bare", 97, 500, 5000, 500, 1000));
  c.states.back().answer = {false, 0};
  c.states.back().engine = {"bellows", false, 1024, 64};
  c.states.back().gateway = {"small", 64};
  c.safe_state = "bare";
  c.max_quality_drop = 0.5;
  c.binaries = "keel-0.9.0+abc123";
  return c;
}

}  // namespace keel::hilo::testing
