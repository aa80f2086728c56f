// A small strict JSON reader for the .fgm header.
//
// Why our own: the header is untrusted input (a hostile or corrupt .fgm must give a precise
// error, never a crash), it is the only JSON the native core reads, and no C++ JSON library
// installs from the package registries our build may use. Limits: nesting depth 64,
// numbers as int64 when integral and in range, otherwise double.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace sg {

class JsonError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct JsonValue {
  enum class Kind { Null, Bool, Int, Double, String, Array, Object };
  Kind kind = Kind::Null;
  bool b = false;
  int64_t i = 0;
  double d = 0.0;
  std::string str;
  std::vector<JsonValue> arr;
  std::vector<std::pair<std::string, JsonValue>> obj;  // keys in file order

  bool is_number() const { return kind == Kind::Int || kind == Kind::Double; }
  double as_double() const { return kind == Kind::Int ? static_cast<double>(i) : d; }
  // Member lookup on an object; nullptr when absent or when this is not an object.
  const JsonValue* get(const std::string& key) const;
};

// Parses exactly one JSON value spanning [text, text+len) (surrounding white space allowed).
// Throws JsonError naming the byte offset of the problem.
JsonValue parse_json(const char* text, size_t len);

}  // namespace sg
