// Internal to keel/gateway/vendors/openai/: the pull scanner the OpenAI fast readers
// (answer_openai.cc, request_openai.cc, stream_decode_openai.cc's chunk reader) read JSON with,
// and their repeated-key guard. Not thread-safe; one per text.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "keel/gateway/stream.h"

namespace keel::gateway::internal {

// A validating pull scanner over a strict subset of JSON: every text it accepts is JSON that
// ParseUntrustedJson accepts (within `max_values`) with the same strings and numbers. Anything
// else makes a call return false, and the reader declines. The subset: no BOM; numbers whose
// value is plainly finite (nlohmann refuses overflowing ones); nesting at most kMaxDepth (below
// the DOM's limit); values counted as CheckJsonLimits counts them.
class Scanner {
 public:
  enum class Num { kInt, kOther };  // kInt: an integer nlohmann reads as one, value in *v

  // `max_values`: the limit of the JsonLimits the DOM reader parses with.
  Scanner(std::string_view t, size_t max_values) : t_(t), max_values_(max_values) {}

  // The next byte after whitespace, 0 at the end.
  char Peek() {
    Ws();
    return i_ < t_.size() ? t_[i_] : 0;
  }
  bool Eat(char c) {
    if (Peek() != c) return false;
    ++i_;
    return true;
  }
  bool AtEnd() { return Peek() == 0 && i_ == t_.size(); }

  // '{' or '['.
  bool Open(char c) {
    if (Peek() != c || depth_ == kMaxDepth || !Count()) return false;
    ++i_;
    in_object_[depth_++] = c == '{';
    return true;
  }
  // '}' or ']' of the innermost container.
  bool Close() {
    if (depth_ == 0 || !Eat(in_object_[depth_ - 1] ? '}' : ']')) return false;
    --depth_;
    return true;
  }
  // "key" ':' (a key counts as a value, as CheckJsonLimits counts it).
  bool Key(std::string* key) { return Peek() == '"' && String(key) && Eat(':'); }

  bool String(std::string* out) {
    if (Peek() != '"' || !Count()) return false;
    out->clear();
    size_t run = ++i_;
    const size_t n = t_.size();
    while (i_ < n) {
      const unsigned char c = static_cast<unsigned char>(t_[i_]);
      if (c == '"') {
        out->append(t_.data() + run, i_ - run);
        ++i_;
        return true;
      }
      if (c < 0x20) return false;
      if (c >= 0x80) {
        const size_t len = Utf8SequenceLength(t_, i_);
        if (len == 0) return false;
        i_ += len;
        continue;
      }
      if (c != '\\') {
        ++i_;
        continue;
      }
      out->append(t_.data() + run, i_ - run);
      if (i_ + 1 >= n) return false;
      switch (t_[i_ + 1]) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u':
          if (!Unicode(out)) return false;
          run = i_;
          continue;
        default: return false;
      }
      i_ += 2;
      run = i_;
    }
    return false;
  }

  // A number. kInt for an integer of at most 18 digits (nlohmann's integer types hold it
  // exactly); kOther for a finite non-integer. Longer integers return false (nlohmann turns
  // them into unsigned, wrapped or float values: the DOM reader decides).
  // *text (optional) gets the number's text.
  bool Number(Num* kind, int64_t* v, std::string_view* text = nullptr) {
    Ws();
    if (!Count()) return false;
    const size_t n = t_.size();
    const bool neg = i_ < n && t_[i_] == '-';
    size_t j = i_ + neg;
    const size_t digits_at = j;
    int64_t x = 0;
    while (j < n && t_[j] >= '0' && t_[j] <= '9') {
      if (j - digits_at < 18) x = x * 10 + (t_[j] - '0');
      ++j;
    }
    const size_t digits = j - digits_at;
    if (digits == 0 || (digits > 1 && t_[digits_at] == '0')) return false;
    bool integer = true;
    if (j < n && t_[j] == '.') {
      integer = false;
      const size_t frac_at = ++j;
      while (j < n && t_[j] >= '0' && t_[j] <= '9') ++j;
      if (j == frac_at) return false;
    }
    int64_t exp = 0;
    if (j < n && (t_[j] == 'e' || t_[j] == 'E')) {
      integer = false;
      ++j;
      const bool exp_neg = j < n && t_[j] == '-';
      if (j < n && (t_[j] == '-' || t_[j] == '+')) ++j;
      const size_t exp_at = j;
      while (j < n && t_[j] >= '0' && t_[j] <= '9') {
        if (j - exp_at < 6) exp = exp * 10 + (t_[j] - '0');
        ++j;
      }
      if (j == exp_at || (!exp_neg && j - exp_at > 5)) return false;
      if (exp_neg) exp = 0;  // small values underflow to 0 or a subnormal: finite either way
    }
    // The value is below 10^(digits + exp): finite while that stays well under DBL_MAX.
    if (static_cast<int64_t>(digits) + exp > 300) return false;
    if (integer && digits > 18) return false;
    if (text) *text = t_.substr(i_, j - i_);
    i_ = j;
    *kind = integer ? Num::kInt : Num::kOther;
    *v = neg ? -x : x;
    return true;
  }

  // An object, member by member: `member(key)` reads that member's value (Skip for one it does
  // not read) and returns false to stop. False when the next value is not an object, a member
  // returns false, or the text is malformed.
  template <class F>
  bool Object(F&& member) {
    if (!Open('{')) return false;
    if (Close()) return true;
    std::string key;
    do {
      if (!Key(&key) || !member(static_cast<const std::string&>(key))) return false;
    } while (Eat(','));
    return Close();
  }

  // One value, walked in document order, telling `h` what it meets -- Begin(bool object) after
  // '{' or '[', End() after its close, Key(std::string&) for a member's key, String(std::string&),
  // Number(Num, int64_t) as Number reads it, Null(), Bool(bool) -- for a reader that takes values
  // wherever they stand (a SAX-style handler). A hook returning false stops the walk (false).
  template <class H>
  bool Walk(H& h) {
    const int base = depth_;
    for (;;) {
      const char c = Peek();
      if (c == '{' || c == '[') {
        if (!Open(c) || !h.Begin(c == '{')) return false;
        if (Eat(c == '{' ? '}' : ']')) {
          --depth_;
          if (!h.End()) return false;
        } else {
          if (c == '{' && !(Key(&scratch_) && h.Key(scratch_))) return false;
          continue;
        }
      } else if (!Scalar(c, h)) {
        return false;
      }
      for (;;) {  // after a value: a comma, or the ends of containers
        if (depth_ == base) return true;
        if (Eat(',')) {
          if (in_object_[depth_ - 1] && !(Key(&scratch_) && h.Key(scratch_))) return false;
          break;
        }
        if (!Close() || !h.End()) return false;
      }
    }
  }

  // Any value, validated and dropped.
  bool Skip() {
    Drop drop;
    return Walk(drop);
  }

 private:
  static constexpr int kMaxDepth = 64;  // kUpstreamJsonLimits allows deeper: the DOM reader decides

  void Ws() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\n' || t_[i_] == '\r' || t_[i_] == '\t')) ++i_;
  }
  bool Count() { return ++values_ <= max_values_; }

  // Walk's hooks for Skip.
  struct Drop {
    bool Begin(bool) { return true; }
    bool End() { return true; }
    bool Key(std::string&) { return true; }
    bool String(std::string&) { return true; }
    bool Number(Num, int64_t) { return true; }
    bool Null() { return true; }
    bool Bool(bool) { return true; }
  };

  template <class H>
  bool Scalar(char c, H& h) {
    if (c == '"') return String(&scratch_) && h.String(scratch_);
    if (c == '-' || (c >= '0' && c <= '9')) {
      Num kind;
      int64_t v;
      return Number(&kind, &v) && h.Number(kind, v);
    }
    if (Literal("null")) return h.Null();
    if (Literal("true")) return h.Bool(true);
    if (Literal("false")) return h.Bool(false);
    return false;
  }
  bool Literal(std::string_view lit) {
    if (t_.substr(i_, lit.size()) != lit) return false;
    i_ += lit.size();
    return Count();
  }

  // At "\u": the escape (a surrogate pair when it is one, as nlohmann requires) as UTF-8.
  bool Unicode(std::string* out) {
    uint32_t cp;
    if (!Hex4(i_ + 2, &cp)) return false;
    i_ += 6;
    if (cp >= 0xDC00 && cp <= 0xDFFF) return false;
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      uint32_t lo;
      if (i_ + 1 >= t_.size() || t_[i_] != '\\' || t_[i_ + 1] != 'u' || !Hex4(i_ + 2, &lo) || lo < 0xDC00 ||
          lo > 0xDFFF) {
        return false;
      }
      i_ += 6;
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    return true;
  }
  bool Hex4(size_t at, uint32_t* cp) const {
    if (at + 4 > t_.size()) return false;
    *cp = 0;
    for (size_t k = at; k < at + 4; ++k) {
      const char h = t_[k];
      const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) return false;
      *cp = *cp * 16 + static_cast<uint32_t>(d);
    }
    return true;
  }

  std::string_view t_;
  size_t max_values_;
  size_t i_ = 0;
  int depth_ = 0;
  size_t values_ = 0;
  bool in_object_[kMaxDepth];
  std::string scratch_;  // the strings and keys Walk reads
};

// Members of one object, read once each: a repeated key among them declines (a DOM keeps the
// last; declining leaves that rule to the DOM reader).
class Seen {
 public:
  bool First(unsigned bit) {
    if (bits_ & bit) return false;
    bits_ |= bit;
    return true;
  }
  bool Has(unsigned bit) const { return bits_ & bit; }

 private:
  unsigned bits_ = 0;
};

}  // namespace keel::gateway::internal
