// Manifest parsing for tdist-compile.
#include "tdist/jit/manifest.hpp"

#include <sstream>

#include "detail.hpp"
#include "tdist/common/error.hpp"
#include "tdist/jit/cache.hpp"

namespace tdist::jit {
namespace {

std::string trim(const std::string& s) {
  std::size_t a = s.find_first_not_of(" \t\r");
  if (a == std::string::npos) return "";
  std::size_t b = s.find_last_not_of(" \t\r");
  return s.substr(a, b - a + 1);
}

}  // namespace

std::vector<CompileRequest> parse_manifest(const std::string& text, const std::string& base_dir,
                                           const std::string& manifest_name) {
  std::vector<CompileRequest> out;
  std::vector<int> start_lines;
  bool in_kernel = false, have_source = false;
  auto finish = [&](int line) {
    if (in_kernel && !have_source) TDIST_FAIL(manifest_name, ":", line, ": [kernel] section without 'source ='");
  };
  std::istringstream is(text);
  int lineno = 0;
  for (std::string raw; std::getline(is, raw);) {
    ++lineno;
    std::string line = trim(raw);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line == "[kernel]") {
      finish(lineno);
      out.emplace_back();
      out.back().file_name.clear();
      start_lines.push_back(lineno);
      in_kernel = true;
      have_source = false;
      continue;
    }
    auto eq = line.find('=');
    if (!in_kernel || eq == std::string::npos)
      TDIST_FAIL(manifest_name, ":", lineno, ": expected '[kernel]' or 'key = value', got '", line, "'");
    std::string key = trim(line.substr(0, eq)), value = trim(line.substr(eq + 1));
    CompileRequest& r = out.back();
    if (key == "source") {
      std::string path = detail::join(base_dir, value);
      if (!read_file(path, r.source)) TDIST_FAIL(manifest_name, ":", lineno, ": cannot read source '", path, "'");
      r.file_name = path;
      have_source = true;
    } else if (key == "name") {
      r.name_expressions.push_back(value);
    } else if (key == "define") {
      r.defines.push_back(value);
    } else if (key == "flag") {
      r.flags.push_back(value);
    } else if (key == "include") {
      r.include_dirs.push_back(detail::join(base_dir, value));
    } else if (key == "compiler") {
      r.compiler = parse_compiler_kind(value);
    } else if (key == "const") {
      // "TYPE NAME = VALUE": the name is the last word before '='.
      auto ceq = value.find('=');
      std::string decl = trim(value.substr(0, ceq == std::string::npos ? 0 : ceq));
      auto sp = decl.find_last_of(" \t");
      if (ceq == std::string::npos || sp == std::string::npos)
        TDIST_FAIL(manifest_name, ":", lineno, ": expected 'const = TYPE NAME = VALUE', got '", value, "'");
      r.constants.push_back({trim(decl.substr(0, sp)), trim(decl.substr(sp + 1)), trim(value.substr(ceq + 1))});
    } else {
      TDIST_FAIL(manifest_name, ":", lineno, ": unknown key '", key, "'");
    }
  }
  finish(lineno);
  return out;
}

std::vector<CompileRequest> load_manifest(const std::string& path) {
  std::string text;
  TDIST_CHECK_ARG(read_file(path, text), "path", "cannot read manifest '", path, "'");
  return parse_manifest(text, detail::dirname(path), path);
}

}  // namespace tdist::jit
