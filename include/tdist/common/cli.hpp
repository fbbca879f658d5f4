// The command-line parser of every tdist tool and benchmark, so that they all behave alike:
//
//   --flag value and --flag=value; -n 4, -n4 and -n=4 for short names; -- ends the options
//   -h/--help prints the usage on stdout and exits 0; --version prints "tool VERSION" and exits 0
//   bad input prints "tool: error: <what>" and a pointer to --help on stderr and exits 2
//
// and cli::run_main() turns every exception that escapes a tool's body into "tool: error: <what>"
// and exit code 1 instead of std::terminate.
//
//   tdist::cli::Parser p("tdist-bench", "tdist's collectives beside NCCL.");
//   p.option("--iters", "N", "timed iterations", &iters, 3, 100000);
//   p.flag("--quick", "a short sweep", &quick);
//   p.parse(argc, argv);
#pragma once

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tdist/version.hpp"

namespace tdist::cli {

constexpr int kExitUsage = 2;

// Bad command-line input: printed as "tool: error: <what>", exit code 2.
class UsageError : public std::runtime_error {
 public:
  explicit UsageError(const std::string& what) : std::runtime_error(what) {}
};

// "4096", "4K", "64M", "1G", "2GiB", "8KB": binary multiples (1K = 1024), as nccl-tests reads them.
inline uint64_t parse_size(const std::string& text, const std::string& what) {
  const auto bad = [&] { return UsageError(what + " expects a size such as 4096, 64K, 1M or 2G, got '" + text + "'"); };
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0 || digits > 19) throw bad();
  uint64_t value = std::stoull(text.substr(0, digits));
  std::string unit = text.substr(digits);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit == "IB" || unit.empty() || unit == "B") return value;
  int shift = 0;
  switch (unit[0]) {
    case 'K': shift = 10; break;
    case 'M': shift = 20; break;
    case 'G': shift = 30; break;
    case 'T': shift = 40; break;
    default: throw bad();
  }
  const std::string rest = unit.substr(1);
  if (!rest.empty() && rest != "B" && rest != "IB") throw bad();
  if (value > (std::numeric_limits<uint64_t>::max() >> shift)) throw bad();
  return value << shift;
}

inline int64_t parse_int(const std::string& text, const std::string& what, int64_t lo, int64_t hi) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || end != text.c_str() + text.size() || errno != 0 || v < lo || v > hi)
    throw UsageError(what + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" +
                     text + "'");
  return v;
}

inline double parse_double(const std::string& text, const std::string& what, double lo, double hi) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v) || v < lo || v > hi) {
    char range[96];
    std::snprintf(range, sizeof(range), "[%g, %g]", lo, hi);
    throw UsageError(what + " expects a number in " + range + ", got '" + text + "'");
  }
  return v;
}

// "a,b,c" -> {"a", "b", "c"}; empty items are an error.
inline std::vector<std::string> split_list(const std::string& text, const std::string& what) {
  std::vector<std::string> out;
  for (size_t start = 0;;) {
    const size_t end = text.find(',', start);
    std::string item = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (item.empty())
      throw UsageError(what + " expects a comma-separated list without empty items, got '" + text + "'");
    out.push_back(std::move(item));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}

class Parser {
 public:
  Parser(std::string prog, std::string description) : prog_(std::move(prog)), description_(std::move(description)) {}

  const std::string& prog() const { return prog_; }

  // A switch: present means true. `names` is "--quick" or "-q,--quick".
  void flag(const std::string& names, const std::string& help, bool* out) {
    add(names, "", help, [out](const std::string&, const std::string&) { *out = true; });
  }
  // An option with a value handed to `set`, which throws UsageError on a bad one.
  void option(const std::string& names, const std::string& metavar, const std::string& help,
              std::function<void(const std::string&)> set) {
    add(names, metavar, help, [set = std::move(set)](const std::string&, const std::string& v) { set(v); });
  }
  void option(const std::string& names, const std::string& metavar, const std::string& help, std::string* out) {
    add(names, metavar, help, [out](const std::string&, const std::string& v) { *out = v; });
  }
  template <typename Int>
  void option(const std::string& names, const std::string& metavar, const std::string& help, Int* out, int64_t lo,
              int64_t hi) {
    add(names, metavar, help, [out, lo, hi](const std::string& what, const std::string& v) {
      *out = static_cast<Int>(parse_int(v, what, lo, hi));
    });
  }
  void option(const std::string& names, const std::string& metavar, const std::string& help, double* out, double lo,
              double hi) {
    add(names, metavar, help,
        [out, lo, hi](const std::string& what, const std::string& v) { *out = parse_double(v, what, lo, hi); });
  }
  // One of `choices`.
  void choice(const std::string& names, const std::string& help, std::vector<std::string> choices, std::string* out) {
    std::string metavar;
    for (const auto& c : choices) metavar += (metavar.empty() ? "" : "|") + c;
    add(names, metavar, help, [out, choices, metavar](const std::string& what, const std::string& v) {
      for (const auto& c : choices)
        if (v == c) {
          *out = v;
          return;
        }
      throw UsageError(what + " expects one of " + metavar + ", got '" + v + "'");
    });
  }
  // Words that are not options. With `stop_at_first`, the first one and everything after it are
  // positional (a launcher's program and its arguments).
  void positional(const std::string& metavar, const std::string& help, std::vector<std::string>* out,
                  bool stop_at_first = false) {
    positional_ = out;
    positional_metavar_ = metavar;
    positional_help_ = help;
    stop_at_first_ = stop_at_first;
  }
  // The usage line's text after the program name (default: "[options]" and the positional words).
  void usage(const std::string& text) { usage_ = text; }
  // Text printed after the option list by --help.
  void epilog(const std::string& text) { epilog_ = text; }

  enum class Outcome { kRun, kHelp, kVersion };

  // Parses without printing or exiting (tests); throws UsageError.
  Outcome parse_or_throw(const std::vector<std::string>& args) {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      if (a == "--") {
        take_positional(args, i + 1);
        return Outcome::kRun;
      }
      if (a.size() < 2 || a[0] != '-' || is_negative_number(a)) {
        if (positional_ == nullptr) throw UsageError("unexpected argument '" + a + "'");
        if (stop_at_first_) {
          take_positional(args, i);
          return Outcome::kRun;
        }
        positional_->push_back(a);
        continue;
      }
      if (a == "-h" || a == "--help") return Outcome::kHelp;
      if (a == "--version") return Outcome::kVersion;
      std::string name = a, value;
      bool has_value = false;
      if (const auto eq = a.find('='); eq != std::string::npos) {
        name = a.substr(0, eq);
        value = a.substr(eq + 1);
        has_value = true;
      }
      const Opt* opt = find(name);
      std::string used = name;  // errors name the option as the user typed it
      // "-n4": a short name with its value attached.
      if (opt == nullptr && !has_value && a[1] != '-' && a.size() > 2) {
        used = a.substr(0, 2);
        opt = find(used);
        if (opt != nullptr && !opt->metavar.empty()) {
          value = a.substr(2);
          has_value = true;
        } else {
          opt = nullptr;
        }
      }
      if (opt == nullptr) throw UsageError("unknown option '" + name + "'" + suggestion(name));
      if (opt->metavar.empty()) {
        if (has_value) throw UsageError(used + " takes no value, got '" + a + "'");
        opt->set(used, "");
        continue;
      }
      if (!has_value) {
        if (i + 1 >= args.size()) throw UsageError(used + " needs a value (" + opt->metavar + ")");
        value = args[++i];
      }
      opt->set(used, value);
    }
    return Outcome::kRun;
  }

  // Parses argv; prints and exits on --help (0), --version (0) and bad input (2).
  void parse(int argc, char** argv) {
    std::vector<std::string> args(argv + (argc > 0 ? 1 : 0), argv + argc);
    Outcome outcome;
    try {
      outcome = parse_or_throw(args);
    } catch (const UsageError& e) {
      fail(e.what());
    }
    if (outcome == Outcome::kHelp) {
      std::fputs(help().c_str(), stdout);
      std::exit(0);
    }
    if (outcome == Outcome::kVersion) {
      std::printf("%s %s\n", prog_.c_str(), tdist::version());
      std::exit(0);
    }
  }

  // Reports a usage error found after parsing (a missing required option) the same way.
  [[noreturn]] void fail(const std::string& message) const {
    std::fprintf(stderr, "%s: error: %s\n%sRun '%s --help' for the options.\n", prog_.c_str(), message.c_str(),
                 usage_line().c_str(), prog_.c_str());
    std::exit(kExitUsage);
  }

  std::string usage_line() const {
    if (!usage_.empty()) return "usage: " + prog_ + " " + usage_ + "\n";
    std::string u = "usage: " + prog_ + " [options]";
    if (positional_ != nullptr) u += (stop_at_first_ ? " [--] " : " ") + positional_metavar_;
    return u + "\n";
  }

  std::string help() const {
    std::string h = usage_line() + "\n" + description_ + "\n\noptions:\n";
    std::vector<std::pair<std::string, std::string>> rows;
    for (const Opt& o : opts_) rows.emplace_back(o.display + (o.metavar.empty() ? "" : " " + o.metavar), o.help);
    rows.emplace_back("-h, --help", "show this help and exit");
    rows.emplace_back("--version", "print the version and exit");
    if (positional_ != nullptr) rows.emplace_back(positional_metavar_, positional_help_);
    size_t width = 0;
    for (const auto& r : rows) width = std::max(width, r.first.size());
    width = std::min<size_t>(width, 30);
    for (const auto& [left, right] : rows) {
      h += "  " + left;
      if (left.size() > width)
        h += "\n  " + std::string(width, ' ');
      else
        h += std::string(width - left.size(), ' ');
      h += "  " + right + "\n";
    }
    if (!epilog_.empty()) h += "\n" + epilog_ + (epilog_.back() == '\n' ? "" : "\n");
    return h;
  }

 private:
  struct Opt {
    std::vector<std::string> names;
    std::string display, metavar, help;
    std::function<void(const std::string&, const std::string&)> set;
  };

  static bool is_negative_number(const std::string& a) {
    return a.size() > 1 && a[0] == '-' && std::isdigit(static_cast<unsigned char>(a[1]));
  }

  using Setter = std::function<void(const std::string& used_name, const std::string& value)>;

  void add(const std::string& names, const std::string& metavar, const std::string& help, Setter set) {
    Opt o{split_list(names, "option names"), "", metavar, help, std::move(set)};
    for (const auto& n : o.names) {
      if (n.size() < 2 || n[0] != '-' || n == "--help" || n == "-h" || n == "--version" || find(n) != nullptr)
        throw std::logic_error(prog_ + ": option name '" + n + "' is invalid or taken");
      o.display += (o.display.empty() ? "" : ", ") + n;
    }
    opts_.push_back(std::move(o));
  }

  const Opt* find(const std::string& name) const {
    for (const Opt& o : opts_)
      for (const auto& n : o.names)
        if (n == name) return &o;
    return nullptr;
  }

  // " (did you mean --iters?)" when one option shares the given name's first word.
  std::string suggestion(const std::string& name) const {
    const std::string stem = name.substr(0, std::min<size_t>(name.size(), 5));
    for (const Opt& o : opts_)
      for (const auto& n : o.names)
        if (n.size() > 2 && n.rfind(stem, 0) == 0) return " (did you mean " + n + "?)";
    return "";
  }

  void take_positional(const std::vector<std::string>& args, size_t from) {
    if (from < args.size() && positional_ == nullptr) throw UsageError("unexpected argument '" + args[from] + "'");
    for (size_t j = from; j < args.size(); ++j) positional_->push_back(args[j]);
  }

  std::string prog_, description_, epilog_, usage_;
  std::vector<Opt> opts_;
  std::vector<std::string>* positional_ = nullptr;
  std::string positional_metavar_, positional_help_;
  bool stop_at_first_ = false;
};

// Runs a tool's body; no exception reaches std::terminate: UsageError exits 2, anything else 1,
// each as "tool: error: <what>" on stderr.
template <typename Body>
int run_main(const char* prog, Body&& body) {
  try {
    return body();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: error: %s\nRun '%s --help' for the options.\n", prog, e.what(), prog);
    return kExitUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", prog, e.what());
    return 1;
  } catch (...) {
    std::fprintf(stderr, "%s: error: unknown exception\n", prog);
    return 1;
  }
}

}  // namespace tdist::cli
