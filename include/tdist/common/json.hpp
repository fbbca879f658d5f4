// A small JSON value and writer for the tools' result files: strings are escaped, non-finite
// numbers are written as null, so the output is always valid JSON. Objects keep insertion order.
//
//   json::Value row = json::Object{{"op", "all_gather"}, {"bytes", 4096}, {"tdist_us", 12.5}};
//   doc["rows"].push_back(row);
//   json::write_file("out.json", doc);
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace tdist::json {

class Value;
using Array = std::vector<Value>;
using Object = std::vector<std::pair<std::string, Value>>;

class Value {
 public:
  Value() : v_(nullptr) {}
  Value(std::nullptr_t) : v_(nullptr) {}
  Value(bool b) : v_(b) {}
  Value(int i) : v_(static_cast<int64_t>(i)) {}
  Value(long i) : v_(static_cast<int64_t>(i)) {}
  Value(long long i) : v_(static_cast<int64_t>(i)) {}
  Value(unsigned i) : v_(static_cast<int64_t>(i)) {}
  Value(unsigned long i) : v_(static_cast<uint64_t>(i)) {}
  Value(unsigned long long i) : v_(static_cast<uint64_t>(i)) {}
  Value(double d) : v_(d) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(Array a) : v_(std::make_shared<Array>(std::move(a))) {}
  Value(Object o) : v_(std::make_shared<Object>(std::move(o))) {}
  // Copies are deep: a value copied into a document and changed later does not change the copy.
  Value(const Value& other) : v_(other.v_) { detach(); }
  Value& operator=(const Value& other) {
    if (this != &other) {
      v_ = other.v_;
      detach();
    }
    return *this;
  }
  Value(Value&&) noexcept = default;
  Value& operator=(Value&&) noexcept = default;

  bool is_object() const { return std::holds_alternative<std::shared_ptr<Object>>(v_); }
  bool is_array() const { return std::holds_alternative<std::shared_ptr<Array>>(v_); }

  // Object member, added (null) when missing. A null value becomes an object first.
  Value& operator[](const std::string& key) {
    if (std::holds_alternative<std::nullptr_t>(v_)) v_ = std::make_shared<Object>();
    Object& o = object();
    for (auto& [k, v] : o)
      if (k == key) return v;
    o.emplace_back(key, Value());
    return o.back().second;
  }
  // Appends to an array. A null value becomes an array first.
  void push_back(Value v) {
    if (std::holds_alternative<std::nullptr_t>(v_)) v_ = std::make_shared<Array>();
    array().push_back(std::move(v));
  }

  // Objects and arrays over `indent` spaces per level; an array of objects gets one object per line.
  std::string dump(int indent = 2) const {
    std::string out;
    write(out, indent, 0, false);
    return out;
  }

 private:
  Object& object() {
    if (!is_object()) throw std::logic_error("json: not an object");
    return *std::get<std::shared_ptr<Object>>(v_);
  }
  Array& array() {
    if (!is_array()) throw std::logic_error("json: not an array");
    return *std::get<std::shared_ptr<Array>>(v_);
  }

  void detach() {
    if (auto* a = std::get_if<std::shared_ptr<Array>>(&v_))
      v_ = std::make_shared<Array>(**a);
    else if (auto* o = std::get_if<std::shared_ptr<Object>>(&v_))
      v_ = std::make_shared<Object>(**o);
  }

  static void write_string(std::string& out, const std::string& s) {
    out += '"';
    for (unsigned char c : s) {
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
          if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            out += buf;
          } else {
            out += static_cast<char>(c);  // UTF-8 passes through unchanged
          }
      }
    }
    out += '"';
  }

  static void write_number(std::string& out, double d) {
    if (!std::isfinite(d)) {
      out += "null";  // JSON has no NaN or infinity
      return;
    }
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.17g", d);
    // The shortest form that reads back the same double.
    for (int prec = 1; prec < 17; ++prec) {
      char shorter[32];
      std::snprintf(shorter, sizeof(shorter), "%.*g", prec, d);
      if (std::strtod(shorter, nullptr) == d) {
        std::snprintf(buf, sizeof(buf), "%s", shorter);
        break;
      }
    }
    out += buf;
  }

  void write(std::string& out, int indent, int depth, bool compact) const {
    const std::string nl = compact || indent <= 0 ? "" : "\n";
    const std::string pad = compact || indent <= 0 ? "" : std::string(static_cast<size_t>(indent) * (depth + 1), ' ');
    const std::string close_pad = compact || indent <= 0 ? "" : std::string(static_cast<size_t>(indent) * depth, ' ');
    const std::string sep = compact || indent <= 0 ? ", " : ",";
    if (std::holds_alternative<std::nullptr_t>(v_))
      out += "null";
    else if (auto* b = std::get_if<bool>(&v_))
      out += *b ? "true" : "false";
    else if (auto* i = std::get_if<int64_t>(&v_))
      out += std::to_string(*i);
    else if (auto* u = std::get_if<uint64_t>(&v_))
      out += std::to_string(*u);
    else if (auto* d = std::get_if<double>(&v_))
      write_number(out, *d);
    else if (auto* s = std::get_if<std::string>(&v_))
      write_string(out, *s);
    else if (is_array()) {
      const Array& a = *std::get<std::shared_ptr<Array>>(v_);
      if (a.empty()) {
        out += "[]";
        return;
      }
      out += "[" + nl;
      for (size_t k = 0; k < a.size(); ++k) {
        out += pad;
        // Rows of a table: each object on one line.
        a[k].write(out, indent, depth + 1, compact || a[k].is_object());
        out += (k + 1 < a.size() ? sep : "") + nl;
      }
      out += close_pad + "]";
    } else {
      const Object& o = *std::get<std::shared_ptr<Object>>(v_);
      if (o.empty()) {
        out += "{}";
        return;
      }
      out += "{" + nl;
      for (size_t k = 0; k < o.size(); ++k) {
        out += pad;
        write_string(out, o[k].first);
        out += ": ";
        o[k].second.write(out, indent, depth + 1, compact);
        out += (k + 1 < o.size() ? sep : "") + nl;
      }
      out += close_pad + "}";
    }
  }

  std::variant<std::nullptr_t, bool, int64_t, uint64_t, double, std::string, std::shared_ptr<Array>,
               std::shared_ptr<Object>>
      v_;
};

// Writes `v` and a newline to `path` through a temporary file renamed into place, so that a reader
// never sees half a file; throws std::runtime_error naming the path on failure.
inline void write_file(const std::string& path, const Value& v) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error("cannot write '" + tmp + "'");
    f << v.dump() << "\n";
    f.close();
    if (!f) throw std::runtime_error("cannot write '" + tmp + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("cannot rename '" + tmp + "' to '" + path + "'");
}

}  // namespace tdist::json
