// Versions of the daemon and of the client<->daemon protocol. A client and a daemon talk only when
// their protocol versions are equal; the daemon version is informational.
#pragma once

#include <cstdint>
#include <string_view>

namespace trainstream {
inline constexpr std::string_view kVersion = "0.1.0";
inline constexpr uint32_t kProtocolVersion = 5;
}  // namespace trainstream
