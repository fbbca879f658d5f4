// Finds every header a source reaches through #include, for the cache key. NVRTC 13 has no
// dependency output (-M/-MD are rejected), so the scan is ours: it follows each #include
// directive whatever #if surrounds it, which yields a superset of the headers the compiler reads;
// a superset can only cause an extra recompile, never a stale hit.
#include <limits.h>
#include <stdlib.h>

#include <map>
#include <mutex>
#include <set>

#include "detail.hpp"
#include "tdist/jit/cache.hpp"

namespace tdist::jit::detail {
namespace {

struct Directive {
  std::string name;  // between the quotes or angle brackets, or the raw text if computed
  bool quoted = false;
  bool computed = false;
};

bool ident_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// Removes comments and joins continued lines; keeps string and character literals intact.
std::string strip_comments(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  std::size_t i = 0, n = s.size();
  auto at = [&](std::size_t k) { return k < n ? s[k] : '\0'; };
  while (i < n) {
    char c = s[i];
    if (c == '\\' && at(i + 1) == '\n') {  // line continuation
      i += 2;
      continue;
    }
    if (c == '/' && at(i + 1) == '/') {
      while (i < n && s[i] != '\n') {
        if (s[i] == '\\' && at(i + 1) == '\n') ++i;  // a continued // comment goes on
        ++i;
      }
      continue;
    }
    if (c == '/' && at(i + 1) == '*') {
      i += 2;
      while (i < n && !(s[i] == '*' && at(i + 1) == '/')) {
        if (s[i] == '\n') out += '\n';  // keep line structure
        ++i;
      }
      i += 2;
      out += ' ';
      continue;
    }
    if (c == '"' && i > 0 && s[i - 1] == 'R' &&
        (i < 2 || !ident_char(s[i - 2]) || s[i - 2] == '8' || s[i - 2] == 'u' || s[i - 2] == 'U' || s[i - 2] == 'L')) {
      // Raw string literal R"delim( ... )delim": copied whole, nothing inside is a directive.
      std::size_t open = s.find('(', i + 1);
      if (open != std::string::npos) {
        std::string close(1, ')');
        close.append(s, i + 1, open - i - 1);
        close += '"';
        std::size_t end = s.find(close, open + 1);
        end = end == std::string::npos ? n : end + close.size();
        for (std::size_t k = i; k < end; ++k) out += s[k] == '\n' ? '\n' : ' ';
        i = end;
        continue;
      }
    }
    if (c == '"' || (c == '\'' && (i == 0 || !ident_char(s[i - 1])))) {
      char q = c;
      out += s[i++];
      while (i < n && s[i] != q && s[i] != '\n') {
        if (s[i] == '\\' && i + 1 < n) out += s[i++];
        out += s[i++];
      }
      if (i < n && s[i] == q) out += s[i++];
      continue;
    }
    out += c;
    ++i;
  }
  return out;
}

std::vector<Directive> parse_directives(const std::string& text) {
  std::vector<Directive> out;
  std::string s = strip_comments(text);
  std::size_t pos = 0;
  while (pos < s.size()) {
    std::size_t eol = s.find('\n', pos);
    if (eol == std::string::npos) eol = s.size();
    std::size_t i = pos;
    auto skip_ws = [&] {
      while (i < eol && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r' || s[i] == '\f' || s[i] == '\v')) ++i;
    };
    skip_ws();
    if (i < eol && s[i] == '#') {
      ++i;
      skip_ws();
      std::size_t w = i;
      while (i < eol && ident_char(s[i])) ++i;
      std::string word = s.substr(w, i - w);
      if (word == "include" || word == "include_next" || word == "import") {
        skip_ws();
        Directive d;
        if (i < eol && (s[i] == '"' || s[i] == '<')) {
          char close = s[i] == '"' ? '"' : '>';
          std::size_t end = s.find(close, i + 1);
          if (end != std::string::npos && end < eol) {
            d.name = s.substr(i + 1, end - i - 1);
            d.quoted = close == '"';
            out.push_back(d);
          }
        } else if (i < eol) {
          std::size_t end = eol;
          while (end > i && (s[end - 1] == ' ' || s[end - 1] == '\t' || s[end - 1] == '\r')) --end;
          d.name = s.substr(i, end - i);
          d.computed = true;
          out.push_back(d);
        }
      }
    }
    pos = eol + 1;
  }
  return out;
}

std::string canonical(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

// Directives of a file, memoised by its content digest.
bool file_directives(const std::string& path, Digest& digest, std::vector<Directive>& dirs) {
  if (!file_digest(path, digest)) return false;
  static std::mutex mu;
  static std::map<Digest, std::vector<Directive>> memo;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = memo.find(digest);
    if (it != memo.end()) {
      dirs = it->second;
      return true;
    }
  }
  std::string text;
  if (!read_file(path, text)) return false;
  dirs = parse_directives(text);
  std::lock_guard<std::mutex> lock(mu);
  memo[digest] = dirs;
  return true;
}

bool is_nccl_header(const std::string& name) {
  return name == "nccl.h" || name == "nccl_device.h" || name.rfind("nccl_device/", 0) == 0;
}

}  // namespace

ScanResult scan_includes(const std::string& source, const std::string& source_dir,
                         const std::vector<std::string>& include_dirs) {
  ScanResult result;
  std::set<std::string> visited;       // canonical paths
  std::set<std::string> missing_seen;  // names not found, recorded once
  struct Frame {
    std::vector<Directive> dirs;
    std::size_t next = 0;
    std::string dir;  // folder of the file, for quoted includes
  };
  std::vector<Frame> stack;
  stack.push_back({parse_directives(source), 0, source_dir});
  while (!stack.empty()) {
    Frame& f = stack.back();
    if (f.next >= f.dirs.size()) {
      stack.pop_back();
      continue;
    }
    Directive d = f.dirs[f.next++];
    std::string from_dir = f.dir;
    if (is_nccl_header(d.name)) result.needs_nccl = true;
    if (d.computed) {
      result.has_computed_include = true;
      std::string spelled = "<computed: " + d.name + ">";
      if (missing_seen.insert(spelled).second) result.headers.push_back({spelled, "", Digest{}});
      continue;
    }
    std::string found;
    if (!d.name.empty() && d.name[0] == '/') {
      if (file_exists(d.name)) found = d.name;
    } else {
      if (d.quoted && !from_dir.empty() && file_exists(join(from_dir, d.name))) found = join(from_dir, d.name);
      for (std::size_t k = 0; found.empty() && k < include_dirs.size(); ++k)
        if (file_exists(join(include_dirs[k], d.name))) found = join(include_dirs[k], d.name);
    }
    if (found.empty()) {
      // Not on the search path: an NVRTC built-in header, a system header, or one behind an #if
      // that is not taken. The compiler's identity covers the first two.
      if (missing_seen.insert(d.name).second) result.headers.push_back({d.name, "", Digest{}});
      continue;
    }
    std::string canon = canonical(found);
    if (!visited.insert(canon).second) continue;
    ScannedInclude inc{d.name, canon, Digest{}};
    std::vector<Directive> sub;
    if (!file_directives(canon, inc.digest, sub)) {
      inc.resolved.clear();
      result.headers.push_back(inc);
      continue;
    }
    result.headers.push_back(inc);
    stack.push_back({std::move(sub), 0, dirname(canon)});
  }
  return result;
}

}  // namespace tdist::jit::detail
