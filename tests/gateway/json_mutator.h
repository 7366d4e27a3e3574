// Mutations of JSON texts for differential tests of the OpenAI fast readers against their DOM
// readers: byte flips (structural, control, non-ASCII bytes), truncations, inserted members
// (repeated keys, wrong types, huge numbers, bad escapes and UTF-8), value swaps, nesting past the
// limits, duplicated stretches, whitespace and deletions. Deterministic for a seed.
#pragma once

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace keel::gateway::mutation {

class Mutator {
 public:
  // `members`: member texts ("key":value, with the comma) to insert, chosen for the format tested.
  Mutator(uint32_t seed, std::vector<std::string> members) : rng_(seed), members_(std::move(members)) {}

  std::string Mutate(std::string s) {
    const int n = 1 + Pick(3);
    for (int k = 0; k < n; ++k) s = MutateOnce(std::move(s));
    return s;
  }

 private:
  size_t Pick(size_t n) { return n ? std::uniform_int_distribution<size_t>(0, n - 1)(rng_) : 0; }
  template <class T>
  const T& PickOf(const std::vector<T>& v) { return v[Pick(v.size())]; }

  // A position after '{' or ',' (where a member may start), or anywhere when there is none.
  size_t MemberStart(const std::string& s) {
    for (int tries = 0; tries < 20; ++tries) {
      const size_t i = Pick(s.size());
      if (s[i] == '{' || s[i] == ',') return i + 1;
    }
    return Pick(s.size() + 1);
  }

  std::string MutateOnce(std::string s) {
    static const std::vector<std::string> kValues = {
        "null", "true", "false", "0", "-1", "1.5", "\"s\"", "[]", "{}", "1e999", "99999999999999999999",
        "[{\"message\":{\"content\":\"x\"}}]", "{\"content\":\"y\"}", "\"\\u00e9\"", "\"\\ud800\""};
    static const std::vector<char> kBytes = {'"', '\\', '{', '}', '[', ']', ',', ':', '0', '9', '-', 'e', '.', 'n',
                                             ' ', '\n', '\x00', '\x01', '\x7f', '\x80', '\xc3', '\xe4', '\xff', 'u'};
    if (s.empty()) return PickOf(members_);
    switch (Pick(8)) {
      case 0: s[Pick(s.size())] = PickOf(kBytes); break;
      case 1: s[Pick(s.size())] = static_cast<char>(Pick(256)); break;
      case 2: s.resize(Pick(s.size())); break;
      case 3: s.insert(MemberStart(s), PickOf(members_)); break;
      case 4: {  // swap the value after a key
        const size_t at = s.find("\":", Pick(s.size()));
        if (at == std::string::npos) break;
        size_t end = at + 2;
        int depth = 0;
        bool in_str = false;
        for (; end < s.size(); ++end) {
          const char c = s[end];
          if (in_str) {
            if (c == '\\') ++end;
            else if (c == '"') in_str = false;
            continue;
          }
          if (c == '"') in_str = true;
          else if (c == '{' || c == '[') ++depth;
          else if (c == '}' || c == ']') {
            if (depth-- == 0) break;
          } else if (c == ',' && depth == 0) break;
        }
        s.replace(at + 2, end - (at + 2), PickOf(kValues));
        break;
      }
      case 5: {  // nesting around a member, shallow or past the limits
        const size_t d = PickOf(std::vector<size_t>{3, 60, 70, 130});
        s.insert(MemberStart(s), "\"deep\":" + std::string(d, '[') + std::string(d, ']') + ",");
        break;
      }
      case 6: {  // duplicate a stretch of the text
        const size_t a = Pick(s.size()), len = Pick(std::min<size_t>(40, s.size() - a) + 1);
        s.insert(a, s.substr(a, len));
        break;
      }
      case 7: {  // whitespace, or one byte removed
        const size_t a = Pick(s.size());
        if (Pick(2)) s.insert(a, PickOf(std::vector<std::string>{" ", "\t", "\r\n", "\f"}));
        else s.erase(a, 1);
        break;
      }
    }
    return s;
  }

  std::mt19937 rng_;
  std::vector<std::string> members_;
};

}  // namespace keel::gateway::mutation
