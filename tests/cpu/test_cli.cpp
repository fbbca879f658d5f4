// The tools' shared pieces: the command-line parser, the JSON writer, the log settings and the
// version.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "tdist/common/cli.hpp"
#include "tdist/common/json.hpp"
#include "tdist/common/log.hpp"
#include "tdist/version.hpp"

using tdist::cli::Parser;
using tdist::cli::UsageError;

namespace {

struct Bench {
  int iters = 20;
  bool quick = false;
  std::string op = "all";
  double timeout = 0;
  uint64_t size = 0;
  std::vector<std::string> rest;

  Parser parser(bool launcher = false) {
    Parser p("tool", "A tool.");
    p.option("-i,--iters", "N", "iterations", &iters, 3, 1000);
    p.flag("-q,--quick", "a short sweep", &quick);
    p.choice("--op", "which op", {"all", "all_gather"}, &op);
    p.option("--timeout", "S", "seconds", &timeout, 0.0, 1e6);
    p.option("--size", "BYTES", "a size", [this](const std::string& v) { size = tdist::cli::parse_size(v, "--size"); });
    p.positional("ARGS", "the rest", &rest, launcher);
    return p;
  }
};

Parser::Outcome parse(Bench& b, std::vector<std::string> args, bool launcher = false) {
  Parser p = b.parser(launcher);
  return p.parse_or_throw(args);
}

}  // namespace

TEST(Cli, ValueForms) {
  Bench b;
  EXPECT_EQ(parse(b, {"--iters", "7", "--op=all_gather", "-q", "--timeout=2.5", "--size", "64K"}),
            Parser::Outcome::kRun);
  EXPECT_EQ(b.iters, 7);
  EXPECT_EQ(b.op, "all_gather");
  EXPECT_TRUE(b.quick);
  EXPECT_DOUBLE_EQ(b.timeout, 2.5);
  EXPECT_EQ(b.size, 64u << 10);
  Bench c;
  parse(c, {"-i9"});
  EXPECT_EQ(c.iters, 9);
  Bench d;
  parse(d, {"-i=11"});
  EXPECT_EQ(d.iters, 11);
}

TEST(Cli, HelpAndVersionWin) {
  Bench b;
  EXPECT_EQ(parse(b, {"--iters", "5", "--help"}), Parser::Outcome::kHelp);
  EXPECT_EQ(parse(b, {"-h"}), Parser::Outcome::kHelp);
  EXPECT_EQ(parse(b, {"--version"}), Parser::Outcome::kVersion);
  const std::string help = b.parser().help();
  EXPECT_NE(help.find("usage: tool [options]"), std::string::npos);
  EXPECT_NE(help.find("-i, --iters N"), std::string::npos);
  EXPECT_NE(help.find("all|all_gather"), std::string::npos);
  EXPECT_NE(help.find("--version"), std::string::npos);
}

TEST(Cli, BadInputNamesTheOption) {
  auto error_of = [](std::vector<std::string> args) -> std::string {
    Bench b;
    try {
      parse(b, std::move(args));
    } catch (const UsageError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of({"--iters", "x"}).find("--iters expects an integer in [3, 1000], got 'x'"), std::string::npos);
  EXPECT_NE(error_of({"--iters", "2"}).find("got '2'"), std::string::npos);
  EXPECT_NE(error_of({"--iters=1e3"}).find("--iters"), std::string::npos);
  EXPECT_NE(error_of({"--iters"}).find("--iters needs a value"), std::string::npos);
  EXPECT_NE(error_of({"--op", "bogus"}).find("one of all|all_gather"), std::string::npos);
  EXPECT_NE(error_of({"--quick=1"}).find("takes no value"), std::string::npos);
  EXPECT_NE(error_of({"--iter", "3"}).find("unknown option '--iter' (did you mean --iters?)"), std::string::npos);
  EXPECT_NE(error_of({"--timeout", "nan"}).find("--timeout expects a number"), std::string::npos);
  EXPECT_NE(error_of({"--timeout", "-1"}).find("--timeout"), std::string::npos);
  EXPECT_NE(error_of({"--size", "1K,4K"}).find("--size expects a size"), std::string::npos);
  EXPECT_NE(error_of({"--size", "4Q"}).find("--size expects a size"), std::string::npos);
  EXPECT_NE(error_of({"--size", "99999999999999999G"}).find("--size expects a size"), std::string::npos);
}

TEST(Cli, PositionalStopsForALauncher) {
  Bench b;
  parse(b, {"-q", "prog", "--iters", "5"}, /*launcher=*/true);
  EXPECT_TRUE(b.quick);
  EXPECT_EQ(b.iters, 20);  // belongs to the program
  EXPECT_EQ(b.rest, (std::vector<std::string>{"prog", "--iters", "5"}));
  Bench c;
  parse(c, {"--", "-q"}, true);
  EXPECT_FALSE(c.quick);
  EXPECT_EQ(c.rest, (std::vector<std::string>{"-q"}));
  Bench d;
  parse(d, {"a", "-q", "b"});
  EXPECT_TRUE(d.quick);
  EXPECT_EQ(d.rest, (std::vector<std::string>{"a", "b"}));
}

TEST(Cli, Sizes) {
  using tdist::cli::parse_size;
  EXPECT_EQ(parse_size("4096", "s"), 4096u);
  EXPECT_EQ(parse_size("1k", "s"), 1024u);
  EXPECT_EQ(parse_size("2GiB", "s"), 2ull << 30);
  EXPECT_EQ(parse_size("8MB", "s"), 8ull << 20);
  EXPECT_THROW(parse_size("", "s"), UsageError);
  EXPECT_THROW(parse_size("K", "s"), UsageError);
  EXPECT_THROW(parse_size("-1", "s"), UsageError);
  EXPECT_THROW(parse_size("1.5M", "s"), UsageError);
  EXPECT_THROW(parse_size("1KX", "s"), UsageError);
}

TEST(Cli, RunMainCatchesEverything) {
  testing::internal::CaptureStderr();
  EXPECT_EQ(tdist::cli::run_main("tool", []() -> int { throw UsageError("--x expects y"); }), 2);
  EXPECT_EQ(tdist::cli::run_main("tool", []() -> int { throw tdist::Error("it broke"); }), 1);
  EXPECT_EQ(tdist::cli::run_main("tool", []() -> int { throw 42; }), 1);
  EXPECT_EQ(tdist::cli::run_main("tool", [] { return 0; }), 0);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("tool: error: --x expects y"), std::string::npos);
  EXPECT_NE(err.find("tool: error: it broke"), std::string::npos);
  EXPECT_NE(err.find("tool: error: unknown exception"), std::string::npos);
}

TEST(Json, EscapesAndNonFinite) {
  namespace json = tdist::json;
  json::Value doc;
  doc["name"] = "a \"quoted\" \\ path\nwith\ttabs \x01";
  doc["nan"] = std::nan("");
  doc["inf"] = std::numeric_limits<double>::infinity();
  doc["half"] = 0.5;
  doc["third"] = 1.0 / 3.0;
  doc["big"] = uint64_t{1} << 63;
  doc["neg"] = -3;
  doc["ok"] = true;
  doc["none"] = nullptr;
  json::Value row = json::Object{{"op", "x"}, {"us", 1.25}};
  doc["rows"].push_back(row);
  row["us"] = 2.0;  // copies are deep
  doc["rows"].push_back(row);
  doc["empty"] = json::Array{};
  const std::string s = doc.dump();
  EXPECT_NE(s.find(R"("name": "a \"quoted\" \\ path\nwith\ttabs \u0001")"), std::string::npos) << s;
  EXPECT_NE(s.find(R"("nan": null)"), std::string::npos);
  EXPECT_NE(s.find(R"("inf": null)"), std::string::npos);
  EXPECT_NE(s.find(R"("half": 0.5)"), std::string::npos);
  EXPECT_NE(s.find(R"("third": 0.3333333333333333)"), std::string::npos) << s;
  EXPECT_NE(s.find(R"("big": 9223372036854775808)"), std::string::npos);
  EXPECT_NE(s.find(R"("neg": -3)"), std::string::npos);
  EXPECT_NE(s.find(R"({"op": "x", "us": 1.25})"), std::string::npos) << s;
  EXPECT_NE(s.find(R"({"op": "x", "us": 2})"), std::string::npos) << s;
  EXPECT_NE(s.find(R"("empty": [])"), std::string::npos);
  EXPECT_EQ(s.find("nan,"), std::string::npos);
}

TEST(Log, LevelsAndSubsystems) {
  using tdist::log::Level;
  EXPECT_EQ(tdist::log::parse_level("info"), Level::kInfo);
  EXPECT_EQ(tdist::log::parse_level(" TRACE "), Level::kTrace);
  EXPECT_EQ(tdist::log::parse_level("WARN"), Level::kWarn);
  EXPECT_EQ(tdist::log::parse_level("none"), Level::kNone);
  try {
    tdist::log::parse_level("loud");
    FAIL() << "no error";
  } catch (const tdist::Error& e) {
    EXPECT_NE(std::string(e.what()).find("TDIST_DEBUG 'loud': expected NONE, WARN, INFO or TRACE"), std::string::npos);
  }
  EXPECT_TRUE(tdist::log::subsys_matches("", "JIT"));
  EXPECT_TRUE(tdist::log::subsys_matches("ALL", "JIT"));
  EXPECT_TRUE(tdist::log::subsys_matches("init,jit", "JIT"));
  EXPECT_FALSE(tdist::log::subsys_matches("INIT", "JIT"));
  EXPECT_FALSE(tdist::log::subsys_matches("^JIT", "JIT"));
  EXPECT_TRUE(tdist::log::subsys_matches("^JIT,TUNE", "INIT"));
}

TEST(Version, MatchesTheVersionFile) {
  std::ifstream f(std::string(TDIST_SOURCE_DIR) + "/VERSION");
  std::string expected;
  f >> expected;
  EXPECT_EQ(tdist::version(), expected);
  EXPECT_EQ(std::to_string(tdist::version_major()) + "." + std::to_string(tdist::version_minor()) + "." +
                std::to_string(tdist::version_patch()),
            expected);
  const std::string report = tdist::version_report();
  EXPECT_NE(report.find("tdist: " + expected), std::string::npos);
  EXPECT_NE(report.find("NCCL built: 2."), std::string::npos);
  EXPECT_NE(report.find("CUDA driver: "), std::string::npos);
}

namespace {

// stderr of a child process that sets `env` (NAME=VALUE, or NAME alone to unset) and then logs one
// line per level and subsystem; the settings are read at the first log call, in the child.
std::string log_output(const std::vector<std::string>& env) {
  int fds[2];
  if (pipe(fds) != 0) return "pipe failed";
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    for (const char* name : {"TDIST_DEBUG", "TDIST_DEBUG_SUBSYS", "TDIST_JIT_VERBOSE"}) unsetenv(name);
    for (const auto& e : env) putenv(strdup(e.c_str()));
    TDIST_WARN(INIT, "warn-init");
    TDIST_INFO(INIT, "info-init ", 42);
    TDIST_INFO(JIT, "info-jit");
    TDIST_TRACE(JIT, "trace-jit");
    TDIST_TRACE(TUNE, "trace-tune");
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  waitpid(pid, nullptr, 0);
  return out;
}

bool has(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

}  // namespace

TEST(Log, LinesFollowTheSettings) {
  const std::string def = log_output({});
  EXPECT_TRUE(has(def, " TDIST WARN INIT: warn-init\n")) << def;
  EXPECT_FALSE(has(def, "info-init"));

  const std::string info = log_output({"TDIST_DEBUG=INFO"});
  EXPECT_TRUE(has(info, " TDIST INFO INIT: info-init 42\n")) << info;
  EXPECT_TRUE(has(info, "info-jit"));
  EXPECT_FALSE(has(info, "trace-jit"));
  // "host:pid" first, as NCCL's lines (the child's pid: any digits after the colon).
  EXPECT_NE(info.find(':'), std::string::npos);
  EXPECT_LT(info.find(':'), info.find(" TDIST "));

  const std::string jit_only = log_output({"TDIST_DEBUG=TRACE", "TDIST_DEBUG_SUBSYS=JIT"});
  EXPECT_TRUE(has(jit_only, "trace-jit")) << jit_only;
  EXPECT_FALSE(has(jit_only, "info-init"));
  EXPECT_FALSE(has(jit_only, "trace-tune"));

  const std::string not_jit = log_output({"TDIST_DEBUG=TRACE", "TDIST_DEBUG_SUBSYS=^JIT"});
  EXPECT_TRUE(has(not_jit, "trace-tune")) << not_jit;
  EXPECT_FALSE(has(not_jit, "info-jit"));

  const std::string none = log_output({"TDIST_DEBUG=NONE"});
  EXPECT_EQ(none, "");

  // The old switch still shows the JIT's lines at every level, and nothing else beyond the default.
  const std::string alias = log_output({"TDIST_JIT_VERBOSE=1"});
  EXPECT_TRUE(has(alias, "trace-jit")) << alias;
  EXPECT_FALSE(has(alias, "info-init"));

  const std::string bad = log_output({"TDIST_DEBUG=LOUD"});
  EXPECT_TRUE(has(bad, "invalid TDIST_DEBUG 'LOUD'")) << bad;
  EXPECT_TRUE(has(bad, "warn-init"));
}
