// compile(): key, cache lookup, then NVRTC or nvcc.
#include "tdist/jit/compiler.hpp"

#include <cuda_runtime_api.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <map>
#include <mutex>
#include <sstream>

#include "detail.hpp"
#include "tdist/common/env.hpp"
#include "tdist/common/error.hpp"
#include "tdist/common/log.hpp"
#include "tdist/jit/cache.hpp"
#include "tdist/jit/paths.hpp"
#include "tdist/runtime/kernel_profiler.hpp"

namespace tdist::jit {

using detail::basename;
using detail::dirname;
using detail::join;

const char* to_string(CompilerKind kind) {
  switch (kind) {
    case CompilerKind::kAuto: return "auto";
    case CompilerKind::kNvrtc: return "nvrtc";
    case CompilerKind::kNvcc: return "nvcc";
  }
  return "?";
}

CompilerKind parse_compiler_kind(const std::string& s) {
  std::string l = s;
  for (auto& c : l) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (l == "nvrtc") return CompilerKind::kNvrtc;
  if (l == "nvcc") return CompilerKind::kNvcc;
  if (l == "auto" || l.empty()) return CompilerKind::kAuto;
  TDIST_FAIL("unknown JIT compiler '", s, "': expected nvrtc, nvcc or auto");
}

CompileRequest CompileRequest::from_file(const std::string& path) {
  CompileRequest r;
  TDIST_CHECK_ARG(read_file(path, r.source), "path", "cannot read kernel source '", path, "'");
  r.file_name = path;
  return r;
}

const std::string& CompiledKernel::lowered_name(const std::string& name_expression) const {
  for (const auto& [expr, sym] : lowered_names)
    if (expr == name_expression) return sym;
  TDIST_FAIL("name expression '", name_expression, "' was not among those compiled into ", file_name,
             " (give it in CompileRequest::name_expressions)");
}

std::string normalize_arch(const std::string& arch) {
  std::string a = arch;
  if (a.rfind("sm_", 0) == 0)
    a = a.substr(3);
  else if (a.rfind("sm", 0) == 0)
    a = a.substr(2);
  std::size_t i = 0;
  while (i < a.size() && std::isdigit(static_cast<unsigned char>(a[i]))) ++i;
  std::string suffix = a.substr(i);
  TDIST_CHECK_ARG(i >= 2 && i <= 3 && (suffix.empty() || suffix == "a" || suffix == "f"), "arch", "'", arch,
                  "' is not a real GPU architecture such as sm_90a (tdist stores CUBIN, not PTX)");
  return "sm_" + a;
}

std::string current_arch() {
  int dev = 0, major = 0, minor = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (e != cudaSuccess) {
    cudaGetLastError();
    TDIST_FAIL("no GPU to take the JIT target from (", cudaGetErrorString(e),
               "); give an explicit arch such as \"sm_90a\"");
  }
  // From compute capability 9.0 on, the 'a' variant unlocks the arch-specific instructions
  // (wgmma, setmaxnreg, ...); a cubin only runs on its own major.minor either way.
  return "sm_" + std::to_string(major) + std::to_string(minor) + (major >= 9 ? "a" : "");
}

void parse_spills(const std::string& log, std::int64_t& stores, std::int64_t& loads) {
  stores = loads = 0;
  auto number_before = [&](std::size_t pos) -> std::int64_t {
    // "... 1288 bytes spill stores": the number precedes " bytes".
    std::size_t end = log.rfind(" bytes", pos);
    if (end == std::string::npos) return 0;
    std::size_t start = end;
    while (start > 0 && std::isdigit(static_cast<unsigned char>(log[start - 1]))) --start;
    return start < end ? std::stoll(log.substr(start, end - start)) : 0;
  };
  for (std::size_t p = log.find("bytes spill stores"); p != std::string::npos;
       p = log.find("bytes spill stores", p + 1))
    stores += number_before(p + 5);
  for (std::size_t p = log.find("bytes spill loads"); p != std::string::npos; p = log.find("bytes spill loads", p + 1))
    loads += number_before(p + 5);
}

namespace {

std::string file_stamp(const std::string& path, const struct stat& st) {
  return path + "|" + std::to_string(st.st_dev) + "|" + std::to_string(st.st_ino) + "|" + std::to_string(st.st_size) +
         "|" + std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec) + "|" +
         std::to_string(st.st_ctim.tv_sec) + "." + std::to_string(st.st_ctim.tv_nsec);
}

// SHA-256 of a file's content, "" if unreadable. Hashing libnvrtc takes about half a second, so the
// digest is remembered across processes in <cache>/identity/, filed under the file's (path,
// device, inode, size, mtime, ctime): a replaced or rewritten library gets a new stamp. Only
// files unchanged for a while are remembered (file times tick coarsely), and the memo is read
// under the cache's trust rules, so it is as trustworthy as the kernels next to it.
std::string content_digest_hex(const std::string& path) {
  struct stat st;
  if (path.empty() || ::stat(path.c_str(), &st) != 0) return "";
  const std::string stamp = file_stamp(path, st);
  struct timespec now;
  ::clock_gettime(CLOCK_REALTIME, &now);
  const bool settled = now.tv_sec - std::max(st.st_mtim.tv_sec, st.st_ctim.tv_sec) >= 2;
  std::string dir, memo;
  if (settled && !detail::env_flag("TDIST_JIT_DISABLE_DISK_CACHE")) {
    try {
      dir = default_cache_dir();
      memo = join(dir, "identity/" + to_hex(sha256(stamp)).substr(0, 32) + ".txt");
    } catch (const Error&) {
      dir.clear();  // no usable cache folder: hash every time
    }
  }
  std::string text;
  if (!dir.empty() && trusted_folder(dir, "identity") && read_trusted_file(memo, text) &&
      text.size() == stamp.size() + 1 + 64 && text.compare(0, stamp.size(), stamp) == 0 && text[stamp.size()] == '\n')
    return text.substr(stamp.size() + 1);
  std::string data;
  if (!read_file(path, data)) return "";
  const std::string hex = to_hex(sha256(data));
  if (!dir.empty()) {
    try {
      detail::make_dirs(join(dir, "identity"));
      detail::make_dirs(join(dir, "tmp"));
      if (trusted_folder(dir, "identity") && trusted_folder(dir, "tmp"))
        write_file_atomic(memo, stamp + "\n" + hex, join(dir, "tmp"));
    } catch (const Error&) {
      // A read-only cache only costs the hash again next time.
    }
  }
  return hex;
}

// Base name and content digest of a library: a patch release or a rebuilt library of the same
// size changes the key, while the key stays free of paths (the same on every machine).
std::string file_content_tag(const std::string& path) {
  const std::string hex = content_digest_hex(path);
  return basename(path) + ":" + (hex.empty() ? std::string("?") : hex);
}

// nvcc reads these by itself: they change its output as much as flags given on its command line.
constexpr const char* kNvccEnv[] = {"NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN"};

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace

std::string compiler_identity(CompilerKind kind) {
  static std::mutex mu;
  static std::map<std::string, std::string> memo;
  const std::string ccbin = detail::env("NVCC_CCBIN");
  std::string tag = kind == CompilerKind::kNvcc ? "nvcc:" + nvcc_path() + ":" + ccbin : "nvrtc";
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = memo.find(tag);
    if (it != memo.end()) return it->second;
  }
  std::string id;
  if (kind == CompilerKind::kNvcc) {
    // nvcc --version names the exact build; the host compiler preprocesses the device code too.
    auto r = detail::run_process({nvcc_path(), "--version"});
    if (r.exit_code != 0) TDIST_FAIL("cannot run nvcc ('", nvcc_path(), "'): ", r.output);
    std::string version;
    std::istringstream is(r.output);
    for (std::string line; std::getline(is, line);)
      if (line.find("Copyright") == std::string::npos) version += line + "\n";
    auto host = detail::run_process({ccbin.empty() ? std::string("g++") : ccbin, "--version"});
    id = "nvcc\n" + version + "host: " + (host.exit_code == 0 ? first_line(host.output) : "unknown");
  } else {
    // nvrtcVersion gives major.minor only; the content hashes of the library actually loaded and
    // of its builtins tell patch releases apart without naming a path (so the key is the same on
    // every machine with the same NVRTC). Hashed once per process (memo below).
    const auto& api = detail::nvrtc();
    std::string builtins =
        join(dirname(api.path), "libnvrtc-builtins.so." + std::to_string(api.major) + "." + std::to_string(api.minor));
    id = "nvrtc " + std::to_string(api.major) + "." + std::to_string(api.minor) + " " + file_content_tag(api.path) +
         " " + file_content_tag(builtins);
  }
  std::lock_guard<std::mutex> lock(mu);
  memo[tag] = id;
  return id;
}

namespace {

// Everything compile() derives from a request before looking in the cache.
struct Plan {
  CompilerKind kind = CompilerKind::kNvrtc;
  std::string arch;
  std::string program_name;               // given to the compiler (the user's path), steers quoted includes
  std::string short_name;                 // base name: diagnostics, __FILE__, key
  std::string source;                     // constants + #line + source (+ nvcc name markers)
  std::vector<std::string> options;       // without include dirs: these enter the key
  std::vector<std::string> include_dirs;  // given to the compiler (-I); their paths do not enter the key
  detail::ScanResult scan;
  std::string identity;
  Digest key{};
};

bool starts_with(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }

std::string absolute(const std::string& p) {
  if (p.empty() || p[0] == '/') return p;
  char buf[4096];
  if (!::getcwd(buf, sizeof buf)) return p;
  return p == "." ? std::string(buf) : join(buf, p);
}

Plan make_plan(const CompileRequest& req) {
  Plan p;
  TDIST_CHECK_ARG(!req.source.empty(), "source", "the kernel source of '", req.file_name, "' is empty");
  p.arch = normalize_arch(req.arch.empty() ? current_arch() : req.arch);
  p.program_name = req.file_name.empty() ? std::string("kernel.cu") : req.file_name;
  p.short_name = basename(p.program_name);

  CompilerKind kind = req.compiler;
  if (kind == CompilerKind::kAuto)
    kind = parse_compiler_kind(env::choice("TDIST_JIT_COMPILER", "auto", {"auto", "nvrtc", "nvcc"}));

  // Options that enter the key. -I and -arch have their own fields.
  bool user_std = false, debug = false;
  std::vector<std::string> user;
  for (const auto& f : req.flags) {
    TDIST_CHECK_ARG(!starts_with(f, "-I") && !starts_with(f, "--include-path"), "flags", "'", f,
                    "': give include dirs in CompileRequest::include_dirs");
    TDIST_CHECK_ARG(!starts_with(f, "-arch") && !starts_with(f, "--gpu-architecture") && !starts_with(f, "-gencode"),
                    "flags", "'", f, "': give the target in CompileRequest::arch");
    if (starts_with(f, "-std=") || starts_with(f, "--std=")) user_std = true;
    if (f == "-G" || f == "--device-debug" || f == "-g") debug = true;
    user.push_back(f);
  }
  if (!user_std) p.options.push_back("-std=c++20");
  if (detail::env_flag("TDIST_JIT_LINEINFO")) p.options.push_back("-lineinfo");
  // One program per module under either compiler: the device API's per-module settings get
  // external linkage, so the loader can find and write them.
  p.options.push_back("-DTDIST_JIT_MODULE=1");
  // The intra-kernel profiler's recorder (device/profile.cuh), in the key like any define.
  if (KernelProfiler::jit_define()) p.options.push_back("-DTDIST_KERNEL_PROFILE=1");
  for (const auto& d : req.defines) p.options.push_back("-D" + d);
  p.options.insert(p.options.end(), user.begin(), user.end());

  // Generated source: constants, then the user's text with its own line numbers and name.
  std::string prelude;
  for (const auto& c : req.constants) prelude += "static constexpr " + c.type + " " + c.name + " = " + c.value + ";\n";
  std::string body = prelude + "#line 1 \"" + p.short_name + "\"\n" + req.source;
  if (!body.empty() && body.back() != '\n') body += '\n';

  // Include dirs: the request's, the source's folder (quoted includes of the program), tdist,
  // CUTLASS when needed, then CUDA (NVRTC) or NCCL (nvcc).
  std::string src_dir = absolute(dirname(p.program_name));
  auto plan_dirs = [&](CompilerKind k, bool with_cutlass) {
    std::vector<std::string> compile_dirs, scan_dirs;
    for (const auto& d : req.include_dirs) compile_dirs.push_back(absolute(d));
    if (k == CompilerKind::kNvcc) compile_dirs.push_back(src_dir);  // NVRTC does this by itself
    std::vector<std::string> defaults = default_include_dirs(k == CompilerKind::kNvcc);
    std::string cutlass = with_cutlass ? cutlass_include_dir() : "";
    for (const auto& d : defaults) {
      if (!cutlass.empty() && d == cuda_include_dir()) compile_dirs.push_back(cutlass), cutlass.clear();
      compile_dirs.push_back(d);
    }
    if (!cutlass.empty()) compile_dirs.push_back(cutlass);
    scan_dirs = compile_dirs;
    if (k == CompilerKind::kNvcc) {
      // nvcc searches CUDA's include dirs without being told: hash what it will find there.
      std::string cuda = cuda_include_dir();
      if (!cuda.empty()) {
        scan_dirs.push_back(cuda);
        scan_dirs.push_back(join(cuda, "cccl"));
      }
    }
    return std::make_pair(compile_dirs, scan_dirs);
  };
  auto scan_with = [&](CompilerKind k) {
    auto dirs = plan_dirs(k, false);
    auto scan = detail::scan_includes(body, k == CompilerKind::kNvrtc ? dirname(p.program_name) : "", dirs.second);
    bool wants_cutlass = std::any_of(scan.headers.begin(), scan.headers.end(), [](const auto& h) {
      return h.resolved.empty() && (starts_with(h.spelled, "cutlass/") || starts_with(h.spelled, "cute/"));
    });
    if (wants_cutlass && !cutlass_include_dir().empty()) {
      dirs = plan_dirs(k, true);
      scan = detail::scan_includes(body, k == CompilerKind::kNvrtc ? dirname(p.program_name) : "", dirs.second);
    }
    p.include_dirs = dirs.first;
    p.scan = std::move(scan);
  };

  scan_with(kind == CompilerKind::kNvcc ? CompilerKind::kNvcc : CompilerKind::kNvrtc);
  if (p.scan.needs_nccl) {
    // NVRTC cannot parse NCCL's device headers (they need libc headers and declare __host__
    // functions): such kernels always go through nvcc.
    TDIST_CHECK_ARG(kind != CompilerKind::kNvrtc, "compiler", p.program_name,
                    " includes NCCL's headers, which NVRTC cannot compile: use "
                    "CompilerKind::kNvcc (or kAuto), or keep NCCL types out of the kernel and pass "
                    "peer pointers through tdist's device descriptor");
    if (kind == CompilerKind::kAuto) scan_with(CompilerKind::kNvcc);
    kind = CompilerKind::kNvcc;
  }
  if (kind == CompilerKind::kAuto) kind = CompilerKind::kNvrtc;
  p.kind = kind;
  // CUTLASS and CuTe declare helpers without __host__/__device__; NVRTC rejects those as host code
  // unless unannotated functions default to device code.
  const bool uses_cutlass = std::any_of(p.scan.headers.begin(), p.scan.headers.end(), [](const auto& h) {
    return starts_with(h.spelled, "cutlass/") || starts_with(h.spelled, "cute/");
  });
  if (kind == CompilerKind::kNvrtc && uses_cutlass &&
      std::find(p.options.begin(), p.options.end(), "-default-device") == p.options.end())
    p.options.push_back("-default-device");

  if (kind == CompilerKind::kNvcc) {
    // Marker variables from which the mangled names are read back (cubin_elf.cpp).
    for (std::size_t i = 0; i < req.name_expressions.size(); ++i) {
      const std::string& e = req.name_expressions[i];
      body += "__device__ void* __tdist_name_expr_" + std::to_string(i) + " = (void*)" +
              (starts_with(e, "&") ? "" : "&") + e + ";\n";
    }
  }
  p.source = std::move(body);
  p.identity = compiler_identity(kind);

  Sha256 h;
  h.field("tdist.jit.key", "1");
  h.field("compiler", p.identity);
  h.field("arch", p.arch);
  h.field("file", p.short_name);
  // With -G the debug info records the program's path; otherwise only the base name shows.
  if (debug) h.field("program", absolute(p.program_name));
  h.field("source", p.source);
  for (const auto& o : p.options) h.field("option", o);
  if (kind == CompilerKind::kNvcc)
    for (const char* var : kNvccEnv) h.field(var, detail::env(var));
  for (const auto& e : req.name_expressions) h.field("name", e);
  for (const auto& inc : p.scan.headers) {
    h.field("include", inc.spelled);
    if (inc.resolved.empty())
      h.field("missing", "");
    else
      h.field("digest", std::string_view(reinterpret_cast<const char*>(inc.digest.data()), inc.digest.size()));
  }
  p.key = h.finish();
  return p;
}

std::string join_options(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& o : v) s += (s.empty() ? "" : " ") + o;
  return s;
}

struct Output {
  CompiledKernel kernel;
  std::string ptx;  // for dumps; may be empty
};

[[noreturn]] void compile_error(const Plan& p, const std::string& log) {
  TDIST_FAIL(to_string(p.kind), " failed to compile ", p.program_name, " for ", p.arch,
             (p.program_name != p.short_name ? " (reported as " + p.short_name + ")" : std::string()), ":\n", log);
}

Output compile_nvrtc(const Plan& p, const CompileRequest& req) {
  const auto& api = detail::nvrtc();
  std::vector<std::string> opts = {"-arch=" + p.arch, "--ptxas-options=-v"};
  opts.insert(opts.end(), p.options.begin(), p.options.end());
  for (const auto& d : p.include_dirs) opts.push_back("-I" + d);
  detail::verbose("nvrtc " + p.program_name + " " + join_options(opts));
  std::vector<const char*> argv;
  for (const auto& o : opts) argv.push_back(o.c_str());

  nvrtcProgram prog = nullptr;
  nvrtcResult r = api.CreateProgram(&prog, p.source.c_str(), p.program_name.c_str(), 0, nullptr, nullptr);
  if (r != NVRTC_SUCCESS) TDIST_FAIL("nvrtcCreateProgram failed: ", api.GetErrorString(r));
  struct Guard {
    const detail::NvrtcApi& api;
    nvrtcProgram& prog;
    ~Guard() { api.DestroyProgram(&prog); }
  } guard{api, prog};
  for (const auto& e : req.name_expressions) {
    r = api.AddNameExpression(prog, e.c_str());
    if (r != NVRTC_SUCCESS) TDIST_FAIL("nvrtcAddNameExpression('", e, "') failed: ", api.GetErrorString(r));
  }
  nvrtcResult cr = api.CompileProgram(prog, int(argv.size()), argv.data());
  Output out;
  std::size_t n = 0;
  api.GetProgramLogSize(prog, &n);
  std::string log(n, '\0');
  if (n > 0) api.GetProgramLog(prog, log.data());
  while (!log.empty() && log.back() == '\0') log.pop_back();
  if (cr != NVRTC_SUCCESS) compile_error(p, log.empty() ? api.GetErrorString(cr) : log);
  out.kernel.log = log;
  r = api.GetCUBINSize(prog, &n);
  if (r != NVRTC_SUCCESS || n == 0) TDIST_FAIL("NVRTC produced no CUBIN for ", p.program_name, " (", p.arch, ")");
  out.kernel.cubin.resize(n);
  api.GetCUBIN(prog, out.kernel.cubin.data());
  if (api.GetPTXSize(prog, &n) == NVRTC_SUCCESS && n > 1) {
    out.ptx.resize(n);
    api.GetPTX(prog, out.ptx.data());
    while (!out.ptx.empty() && out.ptx.back() == '\0') out.ptx.pop_back();
  }
  for (const auto& e : req.name_expressions) {
    const char* lowered = nullptr;
    r = api.GetLoweredName(prog, e.c_str(), &lowered);
    if (r != NVRTC_SUCCESS || !lowered) TDIST_FAIL("no lowered name for '", e, "': ", api.GetErrorString(r));
    out.kernel.lowered_names.emplace_back(e, lowered);
  }
  return out;
}

Output compile_nvcc(const Plan& p, const CompileRequest& req, bool want_ptx) {
  std::string tmp = detail::make_temp_dir("tdist-jit-");
  struct Cleanup {
    std::string dir;
    ~Cleanup() { detail::remove_tree(dir); }
  } cleanup{tmp};
  std::string src = join(tmp, p.short_name);
  std::string cubin = join(tmp, "out.cubin");
  write_file_atomic(src, p.source, tmp);
  std::vector<std::string> argv = {nvcc_path(), "-cubin", "-arch=" + p.arch, "-Xptxas", "-v"};
  argv.insert(argv.end(), p.options.begin(), p.options.end());
  for (const auto& d : p.include_dirs) argv.push_back("-I" + d);
  std::vector<std::string> compile_argv = argv;
  compile_argv.insert(compile_argv.end(), {"-o", cubin, src});
  detail::verbose(join_options(compile_argv));
  auto r = detail::run_process(compile_argv);
  // nvcc names the temporary copy; say the user's name instead.
  std::string log = r.output;
  for (std::size_t pos = log.find(src); pos != std::string::npos; pos = log.find(src, pos))
    log.replace(pos, src.size(), p.short_name);
  if (r.exit_code != 0) compile_error(p, log);
  Output out;
  out.kernel.log = log;
  if (!read_file(cubin, out.kernel.cubin) || !detail::looks_like_elf(out.kernel.cubin))
    TDIST_FAIL("nvcc produced no CUBIN for ", p.program_name, ":\n", log);
  std::vector<std::string> names;
  std::string error;
  if (!detail::lowered_names_from_cubin(out.kernel.cubin, req.name_expressions.size(), names, error))
    TDIST_FAIL("cannot find the kernels named in ", p.program_name, " in nvcc's cubin: ", error);
  for (std::size_t i = 0; i < names.size(); ++i)
    out.kernel.lowered_names.emplace_back(req.name_expressions[i], names[i]);
  if (want_ptx) {
    std::vector<std::string> ptx_argv = argv;
    ptx_argv[1] = "-ptx";
    std::string ptx = join(tmp, "out.ptx");
    ptx_argv.insert(ptx_argv.end(), {"-o", ptx, src});
    if (detail::run_process(ptx_argv).exit_code == 0) read_file(ptx, out.ptx);
  }
  return out;
}

void dump(const Plan& p, const CompiledKernel& k, const std::string& ptx) {
  std::string dir = detail::env("TDIST_JIT_DUMP");
  if (dir.empty() || dir == "0") return;
  if (dir == "1") dir = "tdist-jit-dump";
  detail::make_dirs(dir);
  std::string stem = p.short_name.substr(0, p.short_name.rfind('.'));
  std::string base = join(dir, stem + "." + to_hex(k.key).substr(0, 16));
  std::string tmp = join(dir, ".tmp");
  write_file_atomic(base + ".cu", p.source, tmp);
  write_file_atomic(base + ".cubin", k.cubin, tmp);
  std::string info = "compiler: " + k.compiler + "\narch: " + k.arch + "\noptions: " + join_options(p.options) + "\n";
  for (const auto& [e, s] : k.lowered_names) info += "name: " + e + " -> " + s + "\n";
  write_file_atomic(base + ".log", info + "\n" + k.log, tmp);
  if (!ptx.empty()) write_file_atomic(base + ".ptx", ptx, tmp);
  std::string tool = detail::find_tool("cuobjdump");
  detail::ProcessResult sass;
  if (!tool.empty()) {
    sass = detail::run_process({tool, "-sass", base + ".cubin"});
  } else if (!(tool = detail::find_tool("nvdisasm")).empty()) {
    sass = detail::run_process({tool, "-c", "-g", base + ".cubin"});
  }
  if (!tool.empty() && sass.exit_code == 0) write_file_atomic(base + ".sass", sass.output, tmp);
  ::rmdir(tmp.c_str());
  detail::verbose("dumped " + base + ".{cu,cubin,log" + (ptx.empty() ? "" : ",ptx") +
                  (!tool.empty() && sass.exit_code == 0 ? ",sass" : "") + "}");
}

// The log without ptxas' "Compile time = ..." lines, so that an entry's bytes depend on the
// inputs alone (the same kernel compiled on two machines gives the same file).
std::string deterministic_log(const std::string& log) {
  std::string out;
  std::istringstream is(log);
  for (std::string line; std::getline(is, line);)
    if (line.find("Compile time = ") == std::string::npos) out += line + "\n";
  return out;
}

void check_spills(const Plan& p, const CompiledKernel& k) {
  if (!detail::env_flag("TDIST_JIT_FAIL_ON_SPILLS") || (k.spill_stores == 0 && k.spill_loads == 0)) return;
  std::string lines;
  std::istringstream is(k.log);
  std::string prev;
  for (std::string line; std::getline(is, line); prev = line)
    if (line.find("spill") != std::string::npos && (line.find(" 0 bytes spill stores") == std::string::npos ||
                                                    line.find(" 0 bytes spill loads") == std::string::npos))
      lines += prev + "\n" + line + "\n";
  TDIST_FAIL(p.program_name, " spills registers on ", p.arch, " (", k.spill_stores, " bytes spill stores, ",
             k.spill_loads, " bytes spill loads) and TDIST_JIT_FAIL_ON_SPILLS is set:\n", lines);
}

std::shared_ptr<const CompiledKernel> finish_hit(const Plan& p, std::shared_ptr<const CompiledKernel> k,
                                                 const char* where, double ms) {
  detail::verbose(std::string("hit (") + where + ") " + p.short_name + " " + p.arch + " key " +
                  to_hex(p.key).substr(0, 16) + " in " + std::to_string(ms) + " ms");
  check_spills(p, *k);
  if (!detail::env("TDIST_JIT_DUMP").empty()) dump(p, *k, "");
  return k;
}

}  // namespace

Digest cache_key(const CompileRequest& req) { return make_plan(req).key; }

std::shared_ptr<const CompiledKernel> compile(const CompileRequest& req) { return compile(req, KernelCache::global()); }

std::shared_ptr<const CompiledKernel> compile(const CompileRequest& req, KernelCache& cache) {
  auto t0 = std::chrono::steady_clock::now();
  auto ms = [&] { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(); };
  Plan p = make_plan(req);
  if (auto k = cache.lookup_memory(p.key)) return finish_hit(p, k, "memory", ms());
  if (auto k = cache.lookup_disk(p.key)) return finish_hit(p, k, "disk", ms());
  // One process compiles a key at a time; the others wait and then read its entry.
  KernelCache::KeyLock lock(cache, p.key);
  if (auto k = cache.lookup_disk(p.key)) return finish_hit(p, k, "disk, after waiting", ms());
  cache.count_miss();
  bool want_dump = !detail::env("TDIST_JIT_DUMP").empty();
  Output out = p.kind == CompilerKind::kNvcc ? compile_nvcc(p, req, want_dump) : compile_nvrtc(p, req);
  out.kernel.key = p.key;
  out.kernel.arch = p.arch;
  out.kernel.compiler = p.identity;
  out.kernel.file_name = p.short_name;
  out.kernel.log = deterministic_log(out.kernel.log);
  parse_spills(out.kernel.log, out.kernel.spill_stores, out.kernel.spill_loads);
  auto k = std::make_shared<const CompiledKernel>(std::move(out.kernel));
  detail::verbose(std::string("compiled ") + p.short_name + " " + p.arch + " with " + to_string(p.kind) + " key " +
                  to_hex(p.key).substr(0, 16) + " in " + std::to_string(ms()) + " ms");
  TDIST_INFO(JIT, "compiled ", p.short_name, " for ", p.arch, " (not cached) in ", static_cast<long>(ms()), " ms");
  if (want_dump) dump(p, *k, out.ptx);
  // Stored before the spill check: the entry is valid; the setting only decides whether to use it.
  cache.store(k);
  check_spills(p, *k);
  return k;
}

}  // namespace tdist::jit
