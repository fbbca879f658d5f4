// Reading a cubin's ELF symbol and relocation tables.
//
// nvcc has no counterpart of nvrtcGetLoweredName. For nvcc builds tdist appends, per name
// expression i, `__device__ void* __tdist_name_expr_<i> = (void*)&<expression>;`: the
// initialiser instantiates the template and leaves a relocation against the kernel's mangled
// symbol at the variable's address, which is read back here.
#include <elf.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "detail.hpp"

namespace tdist::jit::detail {
namespace {

template <typename T>
bool read_at(const std::string& b, std::uint64_t off, T& out) {
  if (off > b.size() || b.size() - off < sizeof(T)) return false;
  std::memcpy(&out, b.data() + off, sizeof(T));
  return true;
}

}  // namespace

bool looks_like_elf(const std::string& b) {
  return b.size() >= sizeof(Elf64_Ehdr) && std::memcmp(b.data(), ELFMAG, SELFMAG) == 0 && b[EI_CLASS] == ELFCLASS64;
}

bool lowered_names_from_cubin(const std::string& b, std::size_t count, std::vector<std::string>& names,
                              std::string& error) {
  names.assign(count, "");
  if (count == 0) return true;
  if (!looks_like_elf(b)) {
    error = "not a 64-bit ELF file";
    return false;
  }
  Elf64_Ehdr eh;
  read_at(b, 0, eh);
  std::vector<Elf64_Shdr> sh(eh.e_shnum);
  for (std::size_t i = 0; i < sh.size(); ++i)
    if (!read_at(b, eh.e_shoff + i * eh.e_shentsize, sh[i])) {
      error = "truncated section table";
      return false;
    }
  // Symbol table and its string table.
  int symtab = -1;
  for (std::size_t i = 0; i < sh.size(); ++i)
    if (sh[i].sh_type == SHT_SYMTAB) symtab = int(i);
  if (symtab < 0 || sh[symtab].sh_link >= sh.size()) {
    error = "no symbol table";
    return false;
  }
  const Elf64_Shdr& strs = sh[sh[symtab].sh_link];
  auto str_at = [&](std::uint32_t off) -> std::string {
    if (off >= strs.sh_size || strs.sh_offset + off >= b.size()) return "";
    const char* p = b.data() + strs.sh_offset + off;
    std::size_t max = std::min<std::size_t>(b.size() - (strs.sh_offset + off), strs.sh_size - off);
    return std::string(p, strnlen(p, max));
  };
  std::vector<Elf64_Sym> syms(sh[symtab].sh_entsize ? sh[symtab].sh_size / sh[symtab].sh_entsize : 0);
  for (std::size_t i = 0; i < syms.size(); ++i)
    if (!read_at(b, sh[symtab].sh_offset + i * sh[symtab].sh_entsize, syms[i])) {
      error = "truncated symbol table";
      return false;
    }
  // Where each marker variable lives: (section, offset) -> expression index.
  std::map<std::pair<std::uint32_t, std::uint64_t>, std::size_t> markers;
  const std::string prefix = "__tdist_name_expr_";
  for (const auto& s : syms) {
    std::string name = str_at(s.st_name);
    if (name.rfind(prefix, 0) != 0) continue;
    std::size_t idx = std::strtoull(name.c_str() + prefix.size(), nullptr, 10);
    if (idx < count) markers[{s.st_shndx, s.st_value}] = idx;
  }
  // Relocations applied to those sections.
  for (std::size_t i = 0; i < sh.size(); ++i) {
    if (sh[i].sh_type != SHT_RELA && sh[i].sh_type != SHT_REL) continue;
    bool rela = sh[i].sh_type == SHT_RELA;
    std::size_t ent = sh[i].sh_entsize ? sh[i].sh_entsize : (rela ? sizeof(Elf64_Rela) : sizeof(Elf64_Rel));
    for (std::uint64_t off = 0; off + ent <= sh[i].sh_size; off += ent) {
      Elf64_Rela r{};
      if (rela) {
        if (!read_at(b, sh[i].sh_offset + off, r)) break;
      } else {
        Elf64_Rel rel{};
        if (!read_at(b, sh[i].sh_offset + off, rel)) break;
        r.r_offset = rel.r_offset;
        r.r_info = rel.r_info;
      }
      auto it = markers.find({sh[i].sh_info, r.r_offset});
      if (it == markers.end()) continue;
      std::size_t sym = ELF64_R_SYM(r.r_info);
      if (sym < syms.size()) names[it->second] = str_at(syms[sym].st_name);
    }
  }
  for (std::size_t k = 0; k < count; ++k)
    if (names[k].empty()) {
      error = "no relocation found for name expression #" + std::to_string(k);
      return false;
    }
  return true;
}

}  // namespace tdist::jit::detail
