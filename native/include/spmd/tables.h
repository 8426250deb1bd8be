// Name/code tables of the enums whose codes cross between Python and native code. Each table is
// defined once, next to the enum it describes; native code checks and names codes with it, and
// the extension modules export it (tables()), so that Python can read the codes instead of
// repeating them.
#ifndef SPMD_TABLES_H_
#define SPMD_TABLES_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace spmd {

struct NamedCode {
  const char* name;
  int64_t code;
};

// The name of `code` in `table`; nullptr if the table has no such code.
template <size_t N>
constexpr const char* NameOf(const NamedCode (&table)[N], int64_t code) {
  for (const NamedCode& e : table) {
    if (e.code == code) return e.name;
  }
  return nullptr;
}

template <size_t N>
constexpr bool HasCode(const NamedCode (&table)[N], int64_t code) {
  return NameOf(table, code) != nullptr;
}

// "1 (fp8), 2 (int8) or 3 (int4)": the valid codes, for an error message.
template <size_t N>
std::string CodeList(const NamedCode (&table)[N]) {
  std::string s;
  for (size_t i = 0; i < N; ++i) {
    s += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::to_string(table[i].code) + " (" +
         table[i].name + ")";
  }
  return s;
}

}  // namespace spmd

#endif  // SPMD_TABLES_H_
