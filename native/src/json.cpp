#include "json.h"

#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>

namespace sg {

const JsonValue* JsonValue::get(const std::string& key) const {
  if (kind != Kind::Object) return nullptr;
  for (const auto& kv : obj)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

namespace {

constexpr int kMaxDepth = 64;

class Parser {
 public:
  Parser(const char* p, size_t n) : s_(p), n_(n) {}

  JsonValue parse_document() {
    skip_ws();
    JsonValue v = parse_value(0);
    skip_ws();
    if (pos_ != n_) fail("trailing characters after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw JsonError("invalid header JSON at byte " + std::to_string(pos_) + ": " + what);
  }

  // A byte as printable ASCII or hex, so error messages stay valid UTF-8 whatever the input.
  static std::string describe(char c) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7F) return std::string("'") + c + "'";
    char buf[8];
    std::snprintf(buf, sizeof buf, "0x%02X", u);
    return buf;
  }

  // Copies one UTF-8 encoded character starting with lead byte c (already consumed), rejecting
  // malformed, overlong and surrogate encodings.
  void take_utf8(unsigned char c, std::string& out) {
    int extra;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) { extra = 1; cp = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) { extra = 2; cp = c & 0x0F; }
    else if (c >= 0xF0 && c <= 0xF4) { extra = 3; cp = c & 0x07; }
    else fail("invalid UTF-8 in a string");
    if (n_ - pos_ < size_t(extra)) fail("truncated UTF-8 in a string");
    out += static_cast<char>(c);
    for (int k = 0; k < extra; ++k) {
      unsigned char cc = static_cast<unsigned char>(s_[pos_++]);
      if ((cc & 0xC0) != 0x80) fail("invalid UTF-8 in a string");
      cp = (cp << 6) | (cc & 0x3F);
      out += static_cast<char>(cc);
    }
    if ((extra == 2 && cp < 0x800) || (extra == 3 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp < 0xE000))
      fail("invalid UTF-8 in a string");
  }

  void skip_ws() {
    while (pos_ < n_ && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t')) ++pos_;
  }

  char peek() const { return pos_ < n_ ? s_[pos_] : '\0'; }

  void expect_literal(const char* lit) {
    size_t len = std::strlen(lit);
    if (n_ - pos_ < len || std::memcmp(s_ + pos_, lit, len) != 0) fail(std::string("expected '") + lit + "'");
    pos_ += len;
  }

  JsonValue parse_value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than 64 levels");
    if (pos_ >= n_) fail("unexpected end of input");
    JsonValue v;
    char c = s_[pos_];
    if (c == '{') {
      v.kind = JsonValue::Kind::Object;
      ++pos_;
      skip_ws();
      if (peek() == '}') { ++pos_; return v; }
      for (;;) {
        skip_ws();
        if (peek() != '"') fail("expected a string key");
        std::string key = parse_string();
        skip_ws();
        if (peek() != ':') fail("expected ':' after key");
        ++pos_;
        skip_ws();
        JsonValue member = parse_value(depth + 1);
        v.obj.emplace_back(std::move(key), std::move(member));
        skip_ws();
        if (peek() == ',') { ++pos_; continue; }
        if (peek() == '}') { ++pos_; return v; }
        fail("expected ',' or '}' in object");
      }
    }
    if (c == '[') {
      v.kind = JsonValue::Kind::Array;
      ++pos_;
      skip_ws();
      if (peek() == ']') { ++pos_; return v; }
      for (;;) {
        skip_ws();
        v.arr.push_back(parse_value(depth + 1));
        skip_ws();
        if (peek() == ',') { ++pos_; continue; }
        if (peek() == ']') { ++pos_; return v; }
        fail("expected ',' or ']' in array");
      }
    }
    if (c == '"') {
      v.kind = JsonValue::Kind::String;
      v.str = parse_string();
      return v;
    }
    if (c == 't') { expect_literal("true"); v.kind = JsonValue::Kind::Bool; v.b = true; return v; }
    if (c == 'f') { expect_literal("false"); v.kind = JsonValue::Kind::Bool; v.b = false; return v; }
    if (c == 'n') { expect_literal("null"); return v; }
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
    fail("unexpected character " + describe(c));
  }

  JsonValue parse_number() {
    size_t start = pos_;
    bool integral = true;
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
    } else if (peek() >= '1' && peek() <= '9') {
      while (peek() >= '0' && peek() <= '9') ++pos_;
    } else {
      fail("malformed number");
    }
    if (peek() == '.') {
      integral = false;
      ++pos_;
      if (!(peek() >= '0' && peek() <= '9')) fail("malformed number: digit expected after '.'");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    if (peek() == 'e' || peek() == 'E') {
      integral = false;
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (!(peek() >= '0' && peek() <= '9')) fail("malformed number: digit expected in exponent");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    std::string tok(s_ + start, pos_ - start);
    JsonValue v;
    if (integral) {
      errno = 0;
      char* end = nullptr;
      long long x = std::strtoll(tok.c_str(), &end, 10);
      if (errno == 0 && end && *end == '\0') {
        v.kind = JsonValue::Kind::Int;
        v.i = x;
        return v;
      }
    }
    v.kind = JsonValue::Kind::Double;
    v.d = std::strtod(tok.c_str(), nullptr);
    return v;
  }

  static void put_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  uint32_t parse_hex4() {
    if (n_ - pos_ < 4) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char h = s_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= h - '0';
      else if (h >= 'a' && h <= 'f') v |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') v |= h - 'A' + 10;
      else fail("bad hex digit in \\u escape");
    }
    return v;
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    for (;;) {
      if (pos_ >= n_) fail("unterminated string");
      unsigned char c = static_cast<unsigned char>(s_[pos_++]);
      if (c == '"') return out;
      if (c < 0x20) fail("control character inside a string");
      if (c >= 0x80) { take_utf8(c, out); continue; }
      if (c != '\\') { out += static_cast<char>(c); continue; }
      if (pos_ >= n_) fail("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (n_ - pos_ < 2 || s_[pos_] != '\\' || s_[pos_ + 1] != 'u') fail("lone high surrogate");
            pos_ += 2;
            uint32_t lo = parse_hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            fail("lone low surrogate");
          }
          put_utf8(out, cp);
          break;
        }
        default: fail("unknown escape \\" + describe(e));
      }
    }
  }

  const char* s_;
  size_t n_;
  size_t pos_ = 0;
};

}  // namespace

JsonValue parse_json(const char* text, size_t len) { return Parser(text, len).parse_document(); }

}  // namespace sg
