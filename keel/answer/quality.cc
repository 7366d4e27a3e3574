#include "keel/answer/quality.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace keel::answer {

double RecallAt10(std::span<const uint64_t> retrieved, std::span<const int32_t> truth) {
  const size_t nt = std::min<size_t>(truth.size(), kRecallAt);
  if (nt == 0) return 0;
  std::unordered_set<uint64_t> want;
  for (size_t i = 0; i < nt; ++i) {
    if (truth[i] >= 0) want.insert(static_cast<uint64_t>(truth[i]));
  }
  std::unordered_set<uint64_t> found;
  const size_t nr = std::min<size_t>(retrieved.size(), kRecallAt);
  for (size_t i = 0; i < nr; ++i) {
    if (want.count(retrieved[i]) != 0) found.insert(retrieved[i]);
  }
  return static_cast<double>(found.size()) / static_cast<double>(nt);
}

std::vector<std::string> Words(std::string_view text) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) {
      cur.push_back(static_cast<char>(c));
    } else if (c >= 'A' && c <= 'Z') {
      cur.push_back(static_cast<char>(c - 'A' + 'a'));
    } else if (!cur.empty()) {
      out.push_back(std::move(cur));
      cur.clear();
    }
  }
  if (!cur.empty()) out.push_back(std::move(cur));
  return out;
}

double WordF1(std::string_view answer, std::string_view reference) {
  const std::vector<std::string> a = Words(answer);
  const std::vector<std::string> r = Words(reference);
  if (a.empty() && r.empty()) return 1;
  if (a.empty() || r.empty()) return 0;
  std::unordered_map<std::string_view, int64_t> counts;
  for (const std::string& w : r) ++counts[w];
  int64_t common = 0;
  for (const std::string& w : a) {
    auto it = counts.find(w);
    if (it != counts.end() && it->second > 0) {
      --it->second;
      ++common;
    }
  }
  if (common == 0) return 0;
  const double p = static_cast<double>(common) / static_cast<double>(a.size());
  const double rc = static_cast<double>(common) / static_cast<double>(r.size());
  return 2 * p * rc / (p + rc);
}

double RequestQuality(double recall, double agreement) {
  return 100.0 * std::clamp(recall, 0.0, 1.0) * std::clamp(agreement, 0.0, 1.0);
}

std::vector<WindowQuality> WindowMeans(std::span<const RequestOutcome> outcomes, int64_t window_ms) {
  std::vector<WindowQuality> out;
  if (outcomes.empty() || window_ms <= 0) return out;
  int64_t first = outcomes[0].arrival_ms;
  int64_t last = first;
  for (const RequestOutcome& o : outcomes) {
    first = std::min(first, o.arrival_ms);
    last = std::max(last, o.arrival_ms);
  }
  const int64_t n = (last - first) / window_ms + 1;
  out.resize(static_cast<size_t>(n));
  std::vector<double> sum(static_cast<size_t>(n), 0.0);
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)].start_ms = first + i * window_ms;
  for (const RequestOutcome& o : outcomes) {
    const size_t w = static_cast<size_t>((o.arrival_ms - first) / window_ms);
    ++out[w].requests;
    if (o.served) sum[w] += std::clamp(o.quality, 0.0, 100.0);
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].requests > 0) out[i].quality = sum[i] / static_cast<double>(out[i].requests);
  }
  return out;
}

}  // namespace keel::answer
